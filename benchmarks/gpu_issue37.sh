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
# 3. the sequential families end to end on the GPU: 300 steps of hstu/games with the kernel
#    (kernels.hstu_attention pallas_gpu) and with XLA, tokens/s of each (Video.txt must be on
#    the machine: SASREC_VIDEO=path; skipped without it).
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

echo "== 3. hstu/games steps: the kernel against XLA"
if [ -n "${SASREC_VIDEO:-}" ]; then
  for k in pallas_gpu xla; do
    timeout "${T_TRAIN:-90}" python3 -m sequential.hstu.train hstu/games \
      --workdir "/tmp/gpu37_$k" --data.sasrec-path "$SASREC_VIDEO" \
      --kernels.hstu-attention "$k" --train.num-steps 300 --train.log-every 100 \
      --train.eval-every 100000 --train.no-progress 2>&1 | tail -4 | tee "$OUT/train_$k.txt"
  done
else
  echo "SASREC_VIDEO unset: skipped" | tee "$OUT/train.txt"
fi
