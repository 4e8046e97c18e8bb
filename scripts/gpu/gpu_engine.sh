#!/usr/bin/env bash
# One device call: every gpu-marked test and the kernel/engine test files on the GPU, then the
# workload benchmark (arguments go to workloads.py) in what is left of a 10-minute call.
#   bash scripts/gpu/gpu_engine.sh --scenarios burst --modes compressed,uncompressed
set -u
OUT="${OUT:-gpu_out}"; mkdir -p "$OUT"
. scripts/gpu/env.sh || exit 1
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 150 python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests 2>&1 | tee "$OUT/gpu_marked.log" | tail -6
  timeout 90 python3 -m pytest -q -x -p no:cacheprovider -m "not gpu" tests/test_prefill_attention.py \
    tests/test_engine_kernel.py 2>&1 | tee "$OUT/gpu_kernel_tests.log" | tail -4
fi
timeout -k 10 $(( ${BUDGET_S:-560} - SECONDS )) python3 benchmarks/workloads.py --out "$OUT" "$@" 2>&1 | tee "$OUT/workloads.log" | tail -25
echo "total ${SECONDS}s"
