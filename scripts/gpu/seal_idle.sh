#!/usr/bin/env bash
# Measure d36e6df (issue 44): seals wait longer when nothing waits for room. One device call (~7 min):
#   1. the page store's small seals on this host (benchmarks/seal.py --small: where a placement's time goes)
#   2. the decode-heavy run of balanced_h100 / onepass_h100 (128 `reasoning` requests, 4 GiB),
#      compressed and uncompressed, each in its own process: seal host time a step (before: 0.16 ms,
#      352 placements, steady_h100/run) and decode steps at equal rows (p50 / p99)
#   3. the decode kernel at 1K and 8K contexts, batches 32 and 128 (the reasoning run's contexts
#      are ~1K: its compressed steps were 2-4 % slower at equal rows)
#   bash scripts/gpu/seal_idle.sh        # details under $OUT/seal_idle, a table printed last
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/env.sh || exit 1
T=/tmp/seal_idle; mkdir -p "$T"
OUT=$T bash scripts/gpu/balanced_splits.sh sealprof 2>&1 | tail -7
RUN_MODES=compressed,uncompressed RUN_LIMIT=${RUN_LIMIT:-300} OUT=$T bash scripts/gpu/balanced_splits.sh run 2>&1 | grep -v "^|" | tail -16
timeout -k 5 ${KERNEL_LIMIT:-150} python3 -m zipfusion bench kernel --compare compressed,uncompressed,flashinfer \
  --fractions 1 --batches 32,128 --contexts 1024,8192 --out "$T/kernel_short" > "$T/kernel_short.log" 2>&1
echo "kernel rc $?"; grep -v "^  \[" "$T/kernel_short.log" | tail -12
R=${OUT:-/tmp/seal_idle_out}/seal_idle; mkdir -p "$R"
cp "$T"/seal_small.json "$T"/throughput_fp8.json "$T"/throughput_fp8_steps.json "$T"/kernel_short.json "$R"/ 2>/dev/null
grep -v "^  \[" "$T/throughput_fp8.log" > "$R/throughput.log"; cp "$T/kernel_short.log" "$R/" 2>/dev/null
python3 benchmarks/step_stats.py "$T/throughput_fp8_steps.json" > "$R/step_stats.md"
awk -F'|' 'NR<=2 || ($2+0>=20 && $2+0<=40)' "$R/step_stats.md"
python3 - "$T/throughput_fp8_steps.json" <<'PY'
import json, sys
import numpy as np
for mode, st in json.load(open(sys.argv[1])).items():
    i, rows = st["fields"].index, np.array(st["rows"], dtype=float)
    seal, placed = rows[:, i("seal_s")] * 1e3, rows[:, i("sealed_pages")] > 0
    print(f"{mode}: {len(rows)} steps, seal host {seal.mean():.3f} ms a step, {int(placed.sum())} placements "
          f"({seal[placed].mean() if placed.any() else 0:.2f} ms each), other steps {seal[~placed].mean():.3f} ms")
PY
