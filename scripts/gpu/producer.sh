#!/usr/bin/env bash
# Issue 23, the producer-warp decode kernel, in parts that fit a device call (send .carry):
#   bash scripts/gpu/producer.sh kernel   # its GPU tests, benchmarks/attention.py --quick at the
#                                         # default config, then the COMPRESSED_ESC kind built in
#                                         # (ZIPFUSION_CUDA_ESC_KIND=1): tests, --tune at 1.0 / 0.92
#   bash scripts/gpu/producer.sh whole    # packed-request kernel tests; whole runs through
#                                         # LLM.generate (benchmarks/workloads.py): long_generation
#                                         # x0.25 compressed / uncompressed, and compressed with
#                                         # the per-warp kernel (ZIPFUSION_CUDA_PRODUCER=0)
#   bash scripts/gpu/producer.sh burst    # the burst scenario (72 x 8K + 256, 52 GiB): compressed
#                                         # with the producer kernel and with the per-warp one,
#                                         # uncompressed (~5 min; on an H100 80GB the engine sees
#                                         # 47.7 GiB free: BURST_ARGS="--scale 0.75")
# (long_generation x0.25 takes > 200 s a mode: its 16 requests run in two waves, the second a
# long tail of 8,192 steps)
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
whole)
  mkdir -p "$OUT/whole"
  (export PYTHONPATH=src ZIPFUSION_CACHE=/tmp/zfcache
   timeout 120 python3 -m pytest -q -rs -x -p no:cacheprovider tests/test_decode_attention.py \
     -k "packed_requests_cuda or producer" > "$OUT/whole/tests.log" 2>&1; echo "kernel tests rc $?"; tail -1 "$OUT/whole/tests.log")
  OUT=$OUT/whole/default bash scripts/gpu/workloads_gpu.sh --scenarios long_generation --scale 0.25 \
    --modes compressed,uncompressed --timeout 200 2>&1 | grep -E "done in|total [0-9]+s|Error" | cut -c1-220
  OUT=$OUT/whole/per_warp ZIPFUSION_CUDA_PRODUCER=0 bash scripts/gpu/workloads_gpu.sh --scenarios long_generation \
    --scale 0.25 --modes compressed --timeout 200 2>&1 | grep -E "done in|total [0-9]+s|Error" | cut -c1-220
  for f in "$OUT"/whole/*/workloads.json; do
    python3 -c "
import json, sys
for r in json.load(open(sys.argv[1]))['records']:
    print(sys.argv[1].split('/')[-2], r['scenario'], r['mode'], 'total %.0f tok/s' % r['total_tok_s'], 'wall %.1f s' % r['wall_s'],
          'peak batch', r.get('peak_batch'), 'decode@peak %.0f' % (r.get('decode_tok_s_at_peak_batch') or 0), str(r.get('outputs_sha256'))[:12])" "$f"
  done
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
