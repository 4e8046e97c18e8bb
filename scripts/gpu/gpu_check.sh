#!/usr/bin/env bash
# Every GPU test, in parts that each fit a device call (default: all three, ~10 min on an H100):
#   marked  -- every test of the suite marked gpu (~4 min)
#   kernels -- the other tests of the kernel and codec files, on the GPU's tensors, and two GPU
#              tests of files that do not mark them (~5 min)
#   checks  -- the capacity GPU check and the codec benchmark
#   fp8     -- the FP8 KV cache's tests and the Triton kernels it shares with BF16 (~4 min;
#              part of marked + kernels, for a call that checks only these)
# Results and logs under $OUT (device tool) or ./gpu_out. Send .carry along
# (scripts/gpu/carry_wheels.sh) so that no GPU test skips for a missing package.
#   bash scripts/gpu/gpu_check.sh [marked] [kernels] [checks]
set -u
OUT="${OUT:-gpu_out}"; mkdir -p "$OUT"
. scripts/gpu/env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
for p in ${*:-marked kernels checks}; do
case $p in
marked)
  timeout 330 python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests \
    2>&1 | tee "$OUT/gpu_marked_tests.log" | tail -25 ;;
kernels)
  timeout 420 python3 -m pytest -q -rs -p no:cacheprovider -m "not gpu" \
    tests/test_decode_attention.py tests/test_triton_codec.py tests/test_format.py \
    tests/test_prefill_attention.py tests/test_engine_kernel.py tests/test_merged_ops.py \
    "tests/test_memory.py::test_cuda_round_trip_and_pending_chunks" \
    "tests/test_engine.py::test_gpu_compression_on_off_identical_with_cuda_graphs" \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
checks)
  timeout 60 python3 benchmarks/capacity.py --gpu-check "$OUT/capacity_gpu.json" 2>&1 | tail -8
  timeout 90 python3 benchmarks/codec.py --out "$OUT" 2>&1 | tail -12 ;;
fp8)
  timeout ${FP8_LIMIT:-300} python3 -m pytest -q -rs -p no:cacheprovider tests/test_fp8_kv.py tests/test_merged_ops.py \
    2>&1 | tee "$OUT/gpu_fp8_tests.log" | tail -6
  timeout ${FP8_LIMIT:-300} python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_decode_attention.py \
    tests/test_prefill_attention.py 2>&1 | tee -a "$OUT/gpu_fp8_tests.log" | tail -6 ;;
*) echo "unknown part $p (marked, kernels, checks, fp8)"; exit 2 ;;
esac
done
