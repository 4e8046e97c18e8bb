#!/usr/bin/env bash
# The page store on the GPU (issue 44: compression costs the decode path no host wait): the
# engine's GPU tests of the paths it owns (seal, compaction, host tier, prefix cache, chunk pool),
# then whole runs of a decode-heavy workload, each mode in its own process. One device call:
#   bash scripts/gpu/page_store.sh                 # tests + long_generation x0.25 c/u  (~9 min)
#   PART=sync bash scripts/gpu/page_store.sh       # long_generation x0.25 without async scheduling (c/u)
# Writes into $OUT: page_store.log, workloads.json / .md / .png, steps.json.
set -uo pipefail
OUT=${OUT:-/tmp/page_store_out}
mkdir -p "$OUT"
. scripts/gpu/env.sh || exit 1
LOG=$OUT/page_store.log
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$LOG"
git log --oneline -1 | tee -a "$LOG"
if [ "${PART:-main}" = main ]; then
  timeout -k 5 ${TEST_LIMIT:-200} python3 -m pytest -q -m gpu -rs tests/test_engine.py tests/test_host_tier.py \
      tests/test_memory.py tests/test_prefix_cache.py tests/test_engine_kernel.py 2>&1 | tail -25 | tee -a "$LOG"
  MODES=compressed,uncompressed
else
  MODES=compressed_sync,uncompressed_sync
fi
timeout -k 10 ${RUN_LIMIT:-370} python3 benchmarks/workloads.py --out "$OUT" --scenarios long_generation --scale 0.25 \
    --modes $MODES --timeout ${MODE_LIMIT:-180} 2>&1 | tail -40 | tee -a "$LOG"
echo "total ${SECONDS}s" | tee -a "$LOG"
