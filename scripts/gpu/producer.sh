#!/usr/bin/env bash
# Issue 23, the producer-warp decode kernel, in parts that fit a device call (send .carry):
#   bash scripts/gpu/producer.sh kernel   # its GPU tests, benchmarks/attention.py --quick at the
#                                         # default config, then the COMPRESSED_ESC kind built in
#                                         # (ZIPFUSION_CUDA_ESC_KIND=1): tests, --tune at 1.0 / 0.92
#   bash scripts/gpu/producer.sh burst    # the burst scenario (72 x 8K + 256, 52 GiB): compressed
#                                         # with the producer kernel and with the per-warp one,
#                                         # uncompressed (~5 min; on an H100 80GB the engine sees
#                                         # 47.7 GiB free: BURST_ARGS="--scale 0.75")
# (long_generation x0.25 is no quick whole run: > 200 s a mode, its 16 requests in two waves, the
# second a tail of 8,192 steps; results/attention_producer_2026-12-05/long_generation_x0.25_timeout)
# Output under $OUT/<part>.
set -u
OUT=${OUT:-/tmp/producer}
for part in "$@"; do
case $part in
kernel)
  TESTS="producer or pipeline or escape_patterns_gpu or packed_requests_cuda or small_cases_cuda"
  OUT=$OUT/default TESTS_K="$TESTS" TESTS_TIMEOUT=180 BENCH_TIMEOUT=150 \
    bash scripts/gpu/gpu_attention.sh --quick 2>&1 | grep -E "passed|failed|error|Error|^\| (fused|twin|flashinfer|unfused)" | head -40
  OUT=$OUT/esc ZIPFUSION_CUDA_ESC_KIND=1 TESTS_K="producer or escape or pipeline" TESTS_TIMEOUT=150 BENCH_TIMEOUT=120 \
    bash scripts/gpu/gpu_attention.sh --tune --fractions 1.0,0.92 2>&1 | grep -E "passed|failed|error|Error| fused " | head -30
  ;;
burst)
  mkdir -p "$OUT/burst"
  OUT=$OUT/burst/default bash scripts/gpu/workloads_gpu.sh --scenarios burst --modes compressed,uncompressed ${BURST_ARGS:-} \
    --timeout 130 2>&1 | grep -E "done in|FAILED|Error" | cut -c1-220
  OUT=$OUT/burst/per_warp ZIPFUSION_CUDA_PRODUCER=0 bash scripts/gpu/workloads_gpu.sh --scenarios burst \
    --modes compressed ${BURST_ARGS:-} --timeout 130 2>&1 | grep -E "done in|FAILED|Error" | cut -c1-220
  ;;
esac
done
