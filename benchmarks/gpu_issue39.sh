#!/usr/bin/env bash
# Issue 39 on a lent GPU: the learned sharding cost model measured, trained and judged on the GPU
# (the Pallas embedding kernels `auto` picks there); logs and files under $OUT (default
# /tmp/gpu_issue39):
#
#   bash benchmarks/gpu_issue39.sh
#
# 1. benchmarks/cost_table.py for MIN minutes: device shard sets timed with the GPU's kernels;
# 2. python -m recscale.embeddings.fit_cost_model: the model and both models' held-out error;
# 3. benchmarks/planner_quality.py on 4 tasks: measured plans of every planner on the GPU.
set -u
OUT=${OUT:-/tmp/gpu_issue39}
source benchmarks/gpu_env.sh
PROFILE=${PROFILE:-gpu-h200}
echo "== 1. cost table, ${MIN:-3} minutes"
timeout "${T_TABLE:-240}" python3 benchmarks/cost_table.py --out "$OUT/${PROFILE}_v1.jsonl" \
  --minutes "${MIN:-3}" 2>&1 | tail -2
echo "== 2. train"
timeout 120 python3 -m recscale.embeddings.fit_cost_model "$OUT/${PROFILE}_v1.jsonl" \
  --out "$OUT/$PROFILE.npz" --profile "$PROFILE" 2>&1 | tail -12 | tee "$OUT/train.txt"
echo "== 3. planner quality"
timeout "${T_QUALITY:-200}" python3 benchmarks/planner_quality.py --model "$OUT/$PROFILE.npz" \
  --profile "$PROFILE" --tables 20 60 --devices 8 --repeats 5 --out "$OUT/quality" 2>&1 |
  tail -60 | tee "$OUT/quality.txt"
