#!/usr/bin/env bash
# Issue 20's checks on a lent GPU, each bounded; logs under $OUT (default /tmp/gpu_issue20):
#
#   bash benchmarks/gpu_issue20.sh
#
# 1. a dlrm/synthetic model trained briefly on the GPU (latency does not depend on its quality);
# 2. benchmarks/serving.py on the GPU: latency-bounded throughput per table precision and batch
#    policy (one instance: the GPU is the shared resource), against no batching in the same run;
# 3. benchmarks/int8_dense.py on the GPU: whether int8 dense layers pay there (on XLA:CPU they
#    do not, BENCHMARKS.md).
#
# Packages the GPU image lacks travel as wheels in .whl/ (as benchmarks/gpu_checks.sh).
set -u
OUT=${OUT:-/tmp/gpu_issue20}
source benchmarks/gpu_env.sh

echo "== 1. train dlrm/synthetic briefly"
timeout "${T_TRAIN:-120}" python3 -m dlrm.train dlrm/synthetic --workdir "$OUT/run" \
  --train.num-steps 50 --train.no-progress 2>&1 | tail -5 | tee "$OUT/train.txt"

echo "== 2. latency-bounded serving on the GPU"
timeout "${T_SERVE:-240}" python3 benchmarks/serving.py --workdir "$OUT/run" \
  --precisions float32 int8 int4 --policies 1:0 64:1 256:2 --colocation t1 \
  --rates 1000 4000 16000 64000 --duration 2 --out "$OUT/serving" 2>&1 | tee "$OUT/serving.txt"

echo "== 3. int8 dense layers on the GPU"
timeout "${T_INT8:-90}" python3 benchmarks/int8_dense.py 2>&1 | tee "$OUT/int8_dense.txt"
