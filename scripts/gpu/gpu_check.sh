#!/usr/bin/env bash
# One device call: every test of the suite marked gpu, then the other tests of the kernel and
# codec files (on the GPU's tensors) and two GPU tests of files that do not mark them yet, the
# capacity GPU check and the codec benchmark. Results and logs under $OUT (device tool) or
# ./gpu_out. Send .carry along (scripts/gpu/carry_wheels.sh) so that no GPU test skips for a missing package.
set -u
OUT="${OUT:-gpu_out}"; mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
if [ -d .carry ]; then            # scripts/gpu/carry_wheels.sh: FlashInfer, nvCOMP, server and GGUF extras
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/*.whl .carry/extra/*.whl
  export PYTHONPATH=/tmp/site:src PATH=/opt/torch/.venv/bin:$PATH CUDA_HOME=/usr/local/cuda \
         FLASHINFER_WORKSPACE_BASE=/tmp MAX_JOBS=16
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 300 python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests \
  2>&1 | tee "$OUT/gpu_marked_tests.log" | tail -25
timeout 180 python3 -m pytest -q -rs -p no:cacheprovider -m "not gpu" \
  tests/test_decode_attention.py tests/test_triton_codec.py tests/test_format.py \
  tests/test_prefill_attention.py tests/test_engine_kernel.py tests/test_merged_ops.py \
  "tests/test_memory.py::test_cuda_round_trip_and_pending_chunks" \
  "tests/test_engine.py::test_gpu_compression_on_off_identical_with_cuda_graphs" \
  2>&1 | tee "$OUT/gpu_tests.log" | tail -25
timeout 60 python3 benchmarks/capacity.py --gpu-check "$OUT/capacity_gpu.json" 2>&1 | tail -8
timeout 90 python3 benchmarks/codec.py --out "$OUT" 2>&1 | tail -12
