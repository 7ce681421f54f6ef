#!/usr/bin/env bash
# Issue 34's checks on a lent GPU, each bounded; logs under $OUT (default /tmp/gpu_issue34):
#
#   bash benchmarks/gpu_issue34.sh
#
# 1. the update kernels with and without CowClip + row L2 on the device (Pallas GPU against the
#    XLA reference: tests/recscale/kernels/test_on_device.py, its embedding_update cases);
# 2. benchmarks/cowclip_update.py on the GPU: the CowClip update in the kernel against the row
#    path it replaced, in the same run;
# 3. DLRM training steps with kernels=auto (one-id narrow bags on XLA, multi-id bags in Pallas:
#    embedding_bag.api.auto_choice) against kernels=xla, configs A2048 (26 one-id tables of
#    width 16), C and B (20 and 100 ids, width 64), in one run each on the same machine;
# 4. a dlrm/synthetic run with the engine default and the plan's device profile from the kind.
#
# Packages the GPU image lacks travel as wheels in .whl/ (as benchmarks/gpu_checks.sh).
set -u
OUT=${OUT:-/tmp/gpu_issue34}
source benchmarks/gpu_env.sh

echo "== 1. update kernels with the clip, on the device"
JAX_PLATFORMS=cuda RECSCALE_TEST_XLA_OPT=1 RECSCALE_TEST_JAX_CACHE=0 timeout "${T_TEST:-150}" \
  python3 -m pytest -m gpu tests/recscale/kernels/test_on_device.py -k embedding_update \
  -p no:cacheprovider -p no:benchmark -q -n 4 2>&1 | tail -15 | tee "$OUT/tests.txt"

echo "== 2. CowClip update: kernel against the row path"
timeout "${T_BENCH:-120}" python3 benchmarks/cowclip_update.py --batch 8192 --dim 64 \
  --hotness 1 20 --reps 5 --optimizers rowwise_adagrad sgd 2>&1 | tee "$OUT/cowclip_update.txt"

echo "== 3. DLRM steps: kernels auto against xla"
for k in auto xla; do
  timeout "${T_DLRM:-75}" python3 benchmarks/torchrec_vs_recscale.py --skip-torchrec \
    --kernels "$k" --configs A2048 C B --steps 20 --warmup 3 --windows 2 2>&1 |
    tee "$OUT/dlrm_$k.txt"
done

echo "== 4. dlrm/synthetic with the engine default"
timeout "${T_TRAIN:-120}" python3 -m dlrm.train dlrm/synthetic --workdir /tmp/gpu34_run \
  --train.num-steps 300 --train.no-progress 2>&1 | tail -25 | tee "$OUT/train.txt"
