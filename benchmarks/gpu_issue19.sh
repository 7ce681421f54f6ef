#!/usr/bin/env bash
# Issue 19's checks on a lent GPU, each bounded; logs under $OUT (default /tmp/gpu_issue19):
#
#   bash benchmarks/gpu_issue19.sh
#
# 1. benchmarks/compress_codec.py: the compressed exchange's encode/decode time on this GPU at
#    a production step's shapes, and the exchange time each scheme would save on the H100/H200
#    and TPU profiles' links;
# 2. benchmarks/tiered_tables.py on the GPU: the table in device memory against the same table
#    behind a device cache over host DRAM (the host's work per step against a GPU step).
#
# Packages the GPU image lacks travel as wheels in .whl/ (as benchmarks/gpu_checks.sh).
set -u
OUT=${OUT:-/tmp/gpu_issue19}
source benchmarks/gpu_env.sh

echo "== 1. compressed exchange codec"
timeout "${T_CODEC:-150}" python3 benchmarks/compress_codec.py --out "$OUT/codec.json" 2>&1 |
  tee "$OUT/codec.txt"

echo "== 2. tiered tables on the GPU"
timeout "${T_TIERS:-200}" python3 benchmarks/tiered_tables.py --platform '' \
  --configs in_memory dram --steps 300 --warmup 500 --out "$OUT/tiers" 2>&1 | tee "$OUT/tiers.txt"
