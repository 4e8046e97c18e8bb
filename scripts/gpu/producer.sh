#!/usr/bin/env bash
# Issue 23, the producer-warp decode kernel, in parts that fit a device call (send .carry):
#   bash scripts/gpu/producer.sh kernel   # its GPU tests, benchmarks/attention.py --quick at the
#                                         # default config, then the COMPRESSED_ESC kind built in
#                                         # (--define ZF_ESC_KIND): tests, --tune at 1.0 / 0.92
#   bash scripts/gpu/producer.sh diag     # --quick with the two diagnostic builds (--diag copy|compute):
#                                         # the copies alone, the instructions alone
#   bash scripts/gpu/producer.sh splits   # --quick at 100 % over the split count (SPLITS="2 3 4 ..."),
#                                         # the kernel and its copies alone
#   bash scripts/gpu/producer.sh burst    # the burst scenario (72 x 8K + 256, 52 GiB): compressed
#                                         # with the producer kernel and with the per-warp one,
#                                         # uncompressed (~5 min; on an H100 80GB the engine sees
#                                         # 47.7 GiB free: BURST_ARGS="--scale 0.75")
# (long_generation x0.25 is no quick whole run: > 200 s a mode, its 16 requests in two waves, the
# second a tail of 8,192 steps; benchmarks/results/workloads_h100/long_generation_x0.25)
# Output under $OUT/<part>.
set -u
OUT=${OUT:-/tmp/producer}
for part in "$@"; do
case $part in
kernel)
  TESTS="producer or pipeline or escape_patterns_gpu or packed_requests_cuda or small_cases_cuda"
  OUT=$OUT/default TESTS_K="$TESTS" TESTS_TIMEOUT=180 BENCH_TIMEOUT=150 \
    bash scripts/gpu/gpu_attention.sh --quick 2>&1 | grep -E "passed|failed|error|Error|^\| (fused|uncompressed|flashinfer|unfused)" | head -40
  OUT=$OUT/esc TESTS_ARGS="--cuda-define ZF_ESC_KIND" TESTS_K="producer or escape or pipeline" TESTS_TIMEOUT=150 \
    BENCH_TIMEOUT=120 bash scripts/gpu/gpu_attention.sh --tune --fractions 1.0,0.92 --define ZF_ESC_KIND 2>&1 | grep -E "passed|failed|error|Error| fused " | head -30
  ;;
diag)   # what bounds the producer kernel: its copies alone, its instructions alone (wrong outputs)
  for d in copy compute; do
    OUT=$OUT/diag_$d TESTS_K="build_defines" TESTS_TIMEOUT=60 BENCH_TIMEOUT=150 \
      bash scripts/gpu/gpu_attention.sh --quick --diag $d 2>&1 | grep -E "passed|failed|rror|^\| (fused|uncompressed|flashinfer) " | head -20
  done
  ;;
splits) # fixed cost a CTA: the producer kernel, whole and its copies alone, over the split count
  . scripts/gpu/env.sh || exit 1
  for d in full copy; do for S in ${SPLITS:-2 3 4 6 8 12 16}; do
    diag=""; [ $d = copy ] && diag="--diag copy"
    timeout 60 python3 benchmarks/attention.py --quick --fractions 1.0 --num-splits $S $diag \
      --out $OUT/splits/${d}_S$S 2>&1 | grep -E "^\| fused " | sed "s/^/$d S=$S /"
  done; done
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
