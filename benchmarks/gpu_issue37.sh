#!/usr/bin/env bash
# Issue 37's checks on a lent GPU, each bounded; logs under $OUT (default /tmp/gpu_issue37):
#
#   bash benchmarks/gpu_issue37.sh
#
# 1. HSTU's jagged attention kernel (Pallas Triton) against the XLA reference on the device,
#    forward and backward, float32 and bfloat16, every mask option
#    (tests/recscale/kernels/test_on_device.py -k hstu): what may go into
#    common.HARDWARE_VERIFIED;
# 2. benchmarks/kernels.py --ops hstu_attention: the kernel against XLA at sequence 4,096
#    (d 128, bfloat16) and 8,192 (d 256, float32), with the FLOP roofline of the profile;
# 3. the sequential families end to end on the GPU: 2,000 steps of hstu/games with the kernel
#    (kernels.hstu_attention pallas_gpu) and with XLA, and of sasrec/games_softmax, steps/s of
#    each (Video.txt must be on the machine: SASREC_VIDEO=path; skipped without it).
#
# Packages the GPU image lacks travel as wheels in .whl/ (as benchmarks/gpu_checks.sh).
set -u
OUT=${OUT:-/tmp/gpu_issue37}
source benchmarks/gpu_env.sh

echo "== 1. HSTU attention on the device"
JAX_PLATFORMS=cuda RECSCALE_TEST_XLA_OPT=1 RECSCALE_TEST_JAX_CACHE=0 timeout "${T_TEST:-180}" \
  python3 -m pytest -m gpu tests/recscale/kernels/test_on_device.py -k hstu \
  -p no:cacheprovider -p no:benchmark -q -n 4 2>&1 | tail -15 | tee "$OUT/tests.txt"

echo "== 2. HSTU attention: kernel against XLA at production shapes"
timeout "${T_BENCH:-150}" python3 benchmarks/kernels.py --ops hstu_attention --reps 5 2>&1 |
  tee "$OUT/hstu_kernel.txt"

echo "== 3. games steps on the GPU: hstu/games with the kernel and with XLA, sasrec/games_softmax"
if [ -n "${SASREC_VIDEO:-}" ]; then
  for run in "hstu hstu/games pallas_gpu" "hstu hstu/games xla" "sasrec sasrec/games_softmax -"; do
    set -- $run
    extra=(); [ "$3" != - ] && extra=(--kernels.hstu-attention "$3")
    tag="${1}_${3/-/default}" && wd="/tmp/gpu37_$tag"
    timeout "${T_TRAIN:-75}" python3 -m sequential.$1.train "$2" --workdir "$wd" \
      --data.sasrec-path "$SASREC_VIDEO" "${extra[@]}" --train.num-steps "${STEPS:-2000}" \
      --train.log-every 1000 --train.eval-every 100000 --train.no-progress > "$OUT/train_$tag.txt" 2>&1
    rc=$? && echo "$2 $3 rc=$rc $(tail -c 300 "$OUT/train_$tag.txt" | tr '\n' ' ')"
    [ "$rc" = 0 ] && python3 - "$wd/timings.jsonl" <<'PY' 2>&1 | tee -a "$OUT/games_steps.txt"
import json, sys
r = json.loads(open(sys.argv[1]).readlines()[-1])
t, d = r["phases"]["train"], r["phases"]["data"]
s = t["seconds"] - t["compile_s"]
print(f"{sys.argv[1]}: {t['count']} steps, {t['count'] / s:.1f} steps/s after compile "
      f"({t['compile_s']:.1f} s), data wait {d['seconds']:.1f} s")
PY
  done
else
  echo "SASREC_VIDEO unset: skipped" | tee "$OUT/train.txt"
fi
