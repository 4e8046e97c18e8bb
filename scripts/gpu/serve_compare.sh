#!/usr/bin/env bash
# Compressed vs uncompressed serving in one device call: zipfusion bench serve, one server per mode
# (each its own process, one after the other, the same KV memory), Poisson arrivals at fixed rates
# (no saturation probe: both modes fit one 10-minute call), then the two runs merged.
# Llama-3.1-8B (random weights: 100 % of KV blocks compressible), 8 GiB of KV (it binds: ~65K
# tokens uncompressed), the decode-heavy dataset with answers of median 500 tokens (cap 2,000),
# SLO TTFT 2 s / TPOT 50 ms. Needs .carry/ (bash scripts/gpu/carry_wheels.sh).
#   bash scripts/gpu/serve_compare.sh                      # ~8-9 min
#   RATES=4,8,12 PROMPTS=120 bash scripts/gpu/serve_compare.sh --kv-memory-gb 16
#   MODES="compressed uncompressed fp8" ...          # other modes (zipfusion.bench.MODES)
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/env.sh || exit 1
OUT=${OUT:-/tmp/serve_out}
mkdir -p "$OUT"
LOG=$OUT/serve_compare.log
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$LOG"
for mode in ${MODES:-compressed uncompressed}; do
  timeout -k 20 ${MODE_S:-270} python3 -m zipfusion bench serve --model llama-3.1-8b-random --device cuda \
    --kv-memory-gb 8 --mode $mode --dataset reasoning --output-len 500 --num-prompts ${PROMPTS:-160} \
    --request-rates ${RATES:-6,10,14,18,22} --goodput ttft:2000 tpot:50 --out "$OUT/serve_$mode" "$@" \
    > "$OUT/serve_$mode.log" 2>&1
  echo "$mode: rc $?" | tee -a "$LOG"
  grep -v "^  \[" "$OUT/serve_$mode.log" | tail -14 | cut -c1-220 | tee -a "$LOG"
  # the server's memory warnings (MemoryWatch: the step that grew it), here too: a device reply
  # may leave the mode's log out
  grep -E "WARNING: the server|\]   server: " "$OUT/serve_$mode.log" | tail -6 | cut -c1-400 | tee -a "$LOG"
done
python3 -m zipfusion bench serve --merge $(for m in ${MODES:-compressed uncompressed}; do echo "$OUT/serve_$m.json"; done) \
  --out "$OUT/serve" 2>&1 | tail -20 | tee -a "$LOG"
echo "total ${SECONDS}s" | tee -a "$LOG"
