#!/usr/bin/env bash
# One lent GPU's checks, in priority order, each bounded so that a failure leaves time for the
# rest; logs under $OUT (default /tmp/gpu_checks). Run from the repository root on a machine with
# jax[cuda] (and torch for the PyTorch baseline):
#
#   bash benchmarks/gpu_checks.sh
#
# 1. every Pallas kernel compiled on the GPU against the XLA reference (tests/recscale/kernels/
#    test_on_device.py, `pytest -m gpu`): what may go into common.HARDWARE_VERIFIED;
# 2. benchmarks/kernels.py: each kernel against XLA at production shapes, with rooflines;
# 3. DLRM training/inference throughput, recscale (XLA, then the Pallas kernels) against plain
#    PyTorch on the same GPU (benchmarks/torchrec_vs_recscale.py --baseline torch).
#
# Python packages the GPU image lacks (grain, array_record, tyro and their small dependencies)
# travel as wheels in .whl/ (see /work/.library/device/README.md) and are installed to /tmp/site.
set -u
OUT=${OUT:-/tmp/gpu_checks}
source benchmarks/gpu_env.sh

echo "== 1. kernels on the device"
JAX_PLATFORMS=cuda RECSCALE_TEST_XLA_OPT=1 RECSCALE_TEST_JAX_CACHE=0 timeout "${T_TESTS:-210}" \
  python3 -m pytest -m gpu tests/recscale/kernels/test_on_device.py -p no:cacheprovider -q \
  -n 4 --junitxml "$OUT/on_device.xml" 2>&1 | tee "$OUT/on_device.txt"

echo "== 2. kernel benchmark"
timeout "${T_KERNELS:-180}" python3 benchmarks/kernels.py --batches 8192 65536 --reps 5 2>&1 |
  tee "$OUT/kernels.txt"

echo "== 3. DLRM: recscale vs PyTorch on this GPU"
for k in xla pallas_gpu; do
  extra=(); [ "$k" = pallas_gpu ] && extra=(--skip-torchrec)
  timeout "${T_DLRM:-75}" python3 benchmarks/torchrec_vs_recscale.py --baseline torch \
    --kernels "$k" --configs A2048 C B --steps 20 --warmup 3 --windows 2 "${extra[@]}" 2>&1 |
    tee "$OUT/dlrm_$k.txt"
done
