#!/usr/bin/env bash
# Issue 23, the producer-warp decode kernel: its GPU tests, the kernel benchmark at the default
# config (fused = producer kernel on Hopper), then the same with the COMPRESSED_ESC page kind
# built in (ZIPFUSION_CUDA_ESC_KIND=1): its tests and a tune at 100 % and the real statistics.
# Output under $OUT/{default,esc}. Send .carry along.
set -u
OUT=${OUT:-/tmp/producer}
TESTS="producer or pipeline or escape_patterns_gpu or packed_requests_cuda or small_cases_cuda"
OUT=$OUT/default TESTS_K="$TESTS" TESTS_TIMEOUT=180 BENCH_TIMEOUT=150 \
  bash scripts/gpu/gpu_attention.sh --quick 2>&1 | grep -E "passed|failed|error|Error|^\| (fused|twin|flashinfer|unfused)" | head -40
OUT=$OUT/esc ZIPFUSION_CUDA_ESC_KIND=1 TESTS_K="producer or escape or pipeline" TESTS_TIMEOUT=150 BENCH_TIMEOUT=120 \
  bash scripts/gpu/gpu_attention.sh --tune --fractions 1.0,0.92 2>&1 | grep -E "passed|failed|error|Error| fused " | head -30
