#!/usr/bin/env bash
# Issue 34's checks on a lent GPU, each bounded; logs under $OUT (default /tmp/gpu_issue34):
#
#   bash benchmarks/gpu_issue34.sh
#
# 1. the update kernels with CowClip and row L2 on the device (Pallas GPU against the
#    reference: tests/recscale/kernels/test_on_device.py, its cowclip cases);
# 2. benchmarks/cowclip_update.py on the GPU: the CowClip update in the kernel against the row
#    path it replaced, in the same run;
# 3. a dlrm/synthetic run with the engine default (embedding_bag auto: one-id narrow bags on
#    XLA, multi-id bags in Pallas) and the plan's device profile from the device kind.
#
# Packages the GPU image lacks travel as wheels in .whl/ (as benchmarks/gpu_checks.sh).
set -u
OUT=${OUT:-/tmp/gpu_issue34}
source benchmarks/gpu_env.sh

echo "== 1. update kernels with the clip, on the device"
timeout "${T_TEST:-180}" python3 -m pytest -q -p no:cacheprovider \
  tests/recscale/kernels/test_on_device.py -k "embedding_update" 2>&1 | tail -15 | tee "$OUT/tests.txt"

echo "== 2. CowClip update: kernel against the row path"
timeout "${T_BENCH:-180}" python3 benchmarks/cowclip_update.py --batch 8192 --dim 64 \
  --hotness 1 20 --reps 5 --optimizers rowwise_adagrad sgd 2>&1 | tee "$OUT/cowclip_update.txt"

echo "== 3. dlrm/synthetic with the engine default"
timeout "${T_TRAIN:-150}" python3 -m dlrm.train dlrm/synthetic --workdir "$OUT/run" \
  --train.num-steps 300 --train.no-progress 2>&1 | tail -25 | tee "$OUT/train.txt"
