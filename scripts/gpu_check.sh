#!/usr/bin/env bash
# One device call: the GPU halves of the test suite, the memory manager's GPU check, then the
# codec benchmark. Results and logs under $OUT (device tool) or ./gpu_out.
set -u
OUT="${OUT:-gpu_out}"; mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider \
  tests/test_decode_attention.py tests/test_triton_codec.py tests/test_format.py \
  "tests/test_memory.py::test_cuda_round_trip_and_pending_chunks" \
  "tests/test_engine.py::test_gpu_compression_on_off_identical_with_cuda_graphs" \
  2>&1 | tee "$OUT/gpu_tests.log" | tail -25
timeout 60 python3 benchmarks/capacity.py --gpu-check "$OUT/capacity_gpu.json" 2>&1 | tail -8
timeout 90 python3 benchmarks/codec.py --out "$OUT" 2>&1 | tail -12
