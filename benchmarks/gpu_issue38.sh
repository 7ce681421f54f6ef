#!/usr/bin/env bash
# Issue 38 on a lent GPU: the planner's predicted step against a measured one, on the GPU itself
# (logs under $OUT, default /tmp/gpu_issue38):
#
#   bash benchmarks/gpu_issue38.sh
#
# 1. python -m recscale.plan PRESET --hardware gpu-h200x1 --compile: the step compiled for this
#    GPU, its roofline (compute, HBM, serial and overlapped) from the compiled HLO;
# 2. the same preset trained STEPS steps on the same batch (synthetic data, no files): the
#    measured time of a step after compile, from the run's timings.jsonl.
set -u
OUT=${OUT:-/tmp/gpu_issue38}
source benchmarks/gpu_env.sh
P=${PRESET:-wukong/table5-3}
# the same batch for the plan and the run (EXTRA=--model.scan-layers: the scanned layers)
FLAGS=(--data.kind synthetic --data.batch-size "${BATCH:-8192}" ${EXTRA:-})
echo "== 1. $P planned and compiled for this GPU"
timeout "${T_PLAN:-100}" python3 -m recscale.plan "$P" --hardware "${HW:-gpu-h200x1}" --compile \
  --json "$OUT/plan.jsonl" "${FLAGS[@]}" 2>&1 | grep -E "on gpu|predicted per chip|compiled|predicted step" |
  tee "$OUT/plan.txt"
echo "== 2. $P trained ${STEPS:-60} steps"
timeout "${T_TRAIN:-120}" python3 -m wukong.train "$P" --workdir /tmp/gpu38 "${FLAGS[@]}" \
  --train.num-steps "${STEPS:-60}" --train.log-every 20 \
  --train.eval-every 0 --train.checkpoint-every 0 --train.eval-max-batches 1 --train.no-progress \
  > "$OUT/train.txt" 2>&1
echo "train rc=$?"
python3 - /tmp/gpu38/timings.jsonl "$OUT/plan.jsonl" <<'PY' 2>&1 | tee "$OUT/compare.txt"
import json, sys
r = json.loads(open(sys.argv[1]).readlines()[-1])
t, d = r["phases"]["train"], r["phases"]["data"]
step = (t["seconds"] - t["compile_s"]) / max(t["count"] - 1, 1)
p = json.loads(open(sys.argv[2]).readlines()[-1])["step_time"]
print(f"measured {1e3 * step:.2f} ms a step ({t['count']} steps, compile {t['compile_s']:.1f} s, "
      f"data wait {d['seconds']:.1f} s); predicted serial {1e3 * p['serial']:.2f} ms, "
      f"overlapped {1e3 * p['overlapped']:.2f} ms: measured / serial "
      f"{step / p['serial']:.2f}, / overlapped {step / p['overlapped']:.2f}")
PY
