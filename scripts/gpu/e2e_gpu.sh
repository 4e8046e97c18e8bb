#!/usr/bin/env bash
# Issue 13 on one H200: FlashInfer GPU tests, then benchmarks/e2e.py (Llama-3.1-8B shape, 52 GiB KV,
# 8192 + 256 tokens; fused / uncompressed-twin / uncompressed-flashinfer / unfused / nvCOMP composites),
# then, if time is left, the Qwen3-8B shape for fused vs FlashInfer at 85 % compressible.
# Needs .carry/ (bash scripts/gpu/carry_wheels.sh: FlashInfer trimmed wheel, apache_tvm_ffi, typing_extensions, nvidia_nvcomp_cu13,
# nvidia_libnvcomp_cu13) sent along. Writes into $OUT (at most 8 files):
#   e2e.json e2e.md e2e.png e2e.log e2e_tests.log [qwen3/e2e.json qwen3/e2e.md qwen3/e2e.png]
# Budget: under 8 minutes (tests ~1.5 min incl. FlashInfer's JIT build, Llama run ~5 min).
#   bash scripts/gpu/e2e_gpu.sh
set -uo pipefail
OUT=${OUT:-/tmp/e2e_out}
mkdir -p "$OUT"
[ -d .carry ] || { echo "send .carry along (bash scripts/gpu/carry_wheels.sh)"; exit 1; }
. scripts/gpu/env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv | tee "$OUT/e2e_tests.log"
python3 -c "import flashinfer, torch; print('flashinfer', flashinfer.__version__, 'torch', torch.__version__)" \
  2>&1 | tee -a "$OUT/e2e_tests.log"
python3 -c "from nvidia import nvcomp; print('nvcomp', nvcomp.__version__)" 2>&1 | tee -a "$OUT/e2e_tests.log"

# Whole runs (long generation among them: 64 x (1K prompt + 8K generated)) are benchmarks/workloads.py's:
#    bash scripts/gpu/workloads_gpu.sh (docs/benchmarks.md, "Workloads")

# 1. correctness first (also builds FlashInfer's tensor-core decode for head_dim 128 into /tmp)
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_flashinfer_decode.py 2>&1 | tee -a "$OUT/e2e_tests.log"

# 2. the experiment; partial results are written after each method
timeout 330 python3 benchmarks/e2e.py --out "$OUT" --requests 64 --steps 8 --worker-timeout 150 \
  2>&1 | tee "$OUT/e2e.log"

# 3. Qwen3-8B shape, if at least 100 s are left of the 8 minutes
if [ "$SECONDS" -lt 380 ]; then
  timeout $((470 - SECONDS)) python3 benchmarks/e2e.py --out "$OUT/qwen3" --model qwen3-8b-random \
    --methods fused,uncompressed-flashinfer --points synthetic --fractions 0.85 --batches 32 --steps 8 \
    --nvcomp 0 2>&1 | tail -20 | tee -a "$OUT/e2e.log"
fi
echo "== e2e (llama-3.1-8b-random) =="
cat "$OUT/e2e.md" 2>/dev/null
echo "total ${SECONDS}s"
