#!/usr/bin/env bash
# Async scheduling against the plain order (issue 44): the GPU tests the first call of 2026-12-06
# left (its `marked` part ran out of time at 85 %), then whole runs, each mode in its own process:
# `long` (16 x (32K + 512), 24 GiB: compressed, uncompressed, compressed_sync) and
# `deterministic` at half scale (compressed, compressed_sync: tokens identical on and off).
# ~7 min on an H100. Needs .carry/. (Run on 2026-12-06 while async scheduling was briefly the
# default, as modes compressed / compressed_sync: benchmarks/results/workloads_h100/async_long/.)
#   bash scripts/gpu/async_default.sh
set -u
OUT=${OUT:-/tmp/async_out}; mkdir -p "$OUT"
. scripts/gpu/env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout -k 5 ${TEST_LIMIT:-170} python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_prefill_attention.py \
    tests/test_tensor_parallel.py tests/test_triton_codec.py 2>&1 | tail -8 | tee "$OUT/gpu_tests.log"
timeout -k 10 ${LONG_LIMIT:-250} python3 benchmarks/workloads.py --out "$OUT/long" --scenarios long \
    --modes compressed,uncompressed,compressed_sync --timeout 100 2>&1 | tail -12 | cut -c1-250
timeout -k 10 ${DET_LIMIT:-130} python3 benchmarks/workloads.py --out "$OUT/det" --scenarios deterministic --scale 0.5 \
    --modes compressed,compressed_sync --timeout 70 2>&1 | tail -8 | cut -c1-250
echo "total ${SECONDS}s"
