#!/usr/bin/env bash
# Every GPU test, in parts that each fit a device call (default: marked and checks):
#   marked  -- every test marked gpu, which on a GPU includes every test of the kernel modules
#              that run on CUDA tensors there (conftest.py); TESTS narrows it (default: tests)
#   checks  -- the capacity GPU check and the codec benchmark
#   fp8     -- the gpu tests whose names say FP8 (-k fp8)
# Results and logs under $OUT (device tool) or ./gpu_out. Send .carry along
# (scripts/gpu/carry_wheels.sh) so that no GPU test skips for a missing package.
#   bash scripts/gpu/gpu_check.sh [marked] [checks] [fp8]
set -u
OUT="${OUT:-gpu_out}"; mkdir -p "$OUT"
. scripts/gpu/env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
for p in ${*:-marked checks}; do
case $p in
marked)
  timeout ${TEST_LIMIT:-570} python3 -m pytest -q -rs -p no:cacheprovider -m gpu ${TESTS:-tests} \
    2>&1 | tee "$OUT/gpu_marked_tests.log" | tail -25 ;;
checks)
  timeout 60 python3 benchmarks/capacity.py --gpu-check "$OUT/capacity_gpu.json" 2>&1 | tail -8
  timeout 90 python3 benchmarks/codec.py --out "$OUT" 2>&1 | tail -12 ;;
fp8)
  timeout ${FP8_LIMIT:-300} python3 -m pytest -q -rs -p no:cacheprovider -m gpu -k fp8 tests \
    2>&1 | tee "$OUT/gpu_fp8_tests.log" | tail -6 ;;
*) echo "unknown part $p (marked, checks, fp8)"; exit 2 ;;
esac
done
