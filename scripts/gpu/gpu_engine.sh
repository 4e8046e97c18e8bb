#!/usr/bin/env bash
# One device call: every gpu-marked test (the kernel/engine test files included), then the
# workload benchmark (arguments go to workloads.py) in what is left of a 10-minute call.
#   bash scripts/gpu/gpu_engine.sh --scenarios burst --modes compressed,uncompressed
set -u
OUT="${OUT:-gpu_out}"; mkdir -p "$OUT"
. scripts/gpu/env.sh || exit 1
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout ${TEST_LIMIT:-240} python3 -m pytest -q -rs -p no:cacheprovider -m gpu ${TESTS:-tests} 2>&1 | tee "$OUT/gpu_marked.log" | tail -6
fi
timeout -k 10 $(( ${BUDGET_S:-560} - SECONDS )) python3 benchmarks/workloads.py --out "$OUT" "$@" 2>&1 | tee "$OUT/workloads.log" | tail -25
echo "total ${SECONDS}s"
