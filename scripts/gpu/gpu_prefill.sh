#!/usr/bin/env bash
# One device call for the prefill kernel: its tests compiled on the GPU (the CPU tests run on
# CUDA tensors, plus the gpu-marked ones), then the benchmark vs SDPA. Usage:
#   bash scripts/gpu/gpu_prefill.sh                 # tests + the 4 cases (defaults)
#   bash scripts/gpu/gpu_prefill.sh --sweep         # + the knob sweep (about 6 min more)
# Results and logs under $OUT (device tool) or ./gpu_out.
set -u
OUT="${OUT:-gpu_out}"; mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 200 python3 -m pytest -q -rs -x -p no:cacheprovider tests/test_prefill_attention.py \
    2>&1 | tee "$OUT/prefill_tests.log" | tail -15
fi
timeout 560 python3 benchmarks/prefill_attention.py --out "$OUT" "$@" 2>&1 \
  | tee "$OUT/prefill_bench.log" | tail -45
