#!/usr/bin/env bash
# One device call for the attention kernels: build the CUDA kernel, run the GPU attention
# tests, then tune/benchmark against FlashInfer. Usage: bash scripts/gpu/gpu_attention.sh [bench args]
# (TESTS_K: the tests' -k expression; TESTS_ARGS: more pytest arguments, e.g. --cuda-define ZF_ESC_KIND)
set -u
OUT="${OUT:-gpu_out}"; mkdir -p "$OUT"
. scripts/gpu/env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
(nvcc -O3 -gencode=arch=compute_90,code=sm_90 --use_fast_math -std=c++17 -Xptxas -v -shared -Xcompiler -fPIC -o /tmp/zf.so \
  src/zipfusion/kernels/cuda/decode_attention.cu > "$OUT/ptxas.txt" 2>&1) &   # registers, beside the tests
timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -rs -x -p no:cacheprovider tests/test_decode_attention.py \
  -k "${TESTS_K:-cuda or adversarial or large or split_pages}" ${TESTS_ARGS:-} 2>&1 | tee "$OUT/attn_tests.log" | tail -15
timeout ${BENCH_TIMEOUT:-400} python3 benchmarks/attention.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | tail -45
wait
