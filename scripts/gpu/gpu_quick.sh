#!/usr/bin/env bash
# One device call: the new kernels compiled and checked on the GPU (prefill attention, codec),
# then their benchmarks (prefill vs SDPA with a short knob sweep; sealing). Logs under $OUT.
set -u
OUT="${OUT:-gpu_out}"; mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 240 python3 -m pytest -q -rs -x -p no:cacheprovider tests/test_prefill_attention.py tests/test_triton_codec.py \
  2>&1 | tee "$OUT/tests.log" | tail -6
timeout 60 python3 benchmarks/seal.py --out "$OUT" 2>&1 | tee "$OUT/seal.log" | tail -8
timeout 240 python3 benchmarks/prefill_attention.py --out "$OUT" --sweep --sweep-budget 120 2>&1 \
  | tee "$OUT/prefill_bench.log" | tail -30
