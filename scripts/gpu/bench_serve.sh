#!/usr/bin/env bash
# zipfusion bench serve on the device machine, one mode per call (a call has 10 minutes; both modes
# with a sweep take ~15): Llama-3.1-8B (random weights), 16 GiB of KV memory (it binds: ~130K tokens
# uncompressed), the decode-heavy dataset (prompts ~200 tokens, answers ~1,000, capped at 4,000), 100
# requests per rate, a sweep from saturation to 2x, SLO TTFT 2 s / TPOT 50 ms. Needs .carry/ (bash
# scripts/gpu/carry_wheels.sh: fastapi, uvicorn, httpx and friends). The JSON is written after every
# rate, so a run cut short keeps what it measured. Extra arguments go to zipfusion bench serve.
#   bash scripts/gpu/bench_serve.sh compressed      # device call 1 (~7-9 min)
#   bash scripts/gpu/bench_serve.sh uncompressed    # device call 2
#   zipfusion bench serve --merge C/serve_compressed.json U/serve_uncompressed.json --out benchmarks/results/bench_serve
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/env.sh
OUT=${OUT:-/tmp/bench_out}
mkdir -p "$OUT"
mode=${1:?usage: bench_serve.sh compressed|uncompressed|flashinfer [zipfusion bench serve options]}
shift
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader | tee "$OUT/serve_$mode.log"
timeout -k 20 ${BUDGET_S:-570} python3 -m zipfusion bench serve --model llama-3.1-8b-random --device cuda \
  --kv-memory-gb 16 --mode "$mode" --dataset reasoning --output-len 1000 --num-prompts 100 --sweep \
  --goodput ttft:2000 tpot:50 --out "$OUT/serve_$mode" "$@" >> "$OUT/serve_$mode.log" 2>&1
echo "rc $?"
grep -v "^  \[" "$OUT/serve_$mode.log" | tail -25 | cut -c1-250
