#!/usr/bin/env bash
# Where a compressed decode-heavy run's extra step time goes (issue 44): the run of
# benchmarks/results/fp8_h100 (128 reasoning requests at 4 GiB of KV; compressed steps took 8.45
# ms at 20.1 rows on average against 7.98 ms at 18.0 uncompressed) with steps 1000..1199 of each
# mode traced by torch.profiler: Chrome traces (open in Perfetto) and the top operators by GPU
# time in the JSON. The traced steps run slower: the modes' tokens/s here are not timings.
#   bash scripts/gpu/trace_decode_heavy.sh      # ~3 min; $OUT/trace.json, $OUT/trace_<mode>.trace.json.gz
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/env.sh || exit 1
OUT=${OUT:-/tmp/trace_out}; mkdir -p "$OUT"
timeout -k 10 ${LIMIT:-300} python3 -m zipfusion bench throughput --model llama-3.1-8b-random --device cuda \
  --kv-memory-gb 4 --compare compressed,uncompressed --dataset reasoning --num-prompts 128 --output-len 500 \
  --timeout 140 --profile-steps ${STEPS:-1000:1200} --out "$OUT/trace" > "$OUT/trace.log" 2>&1; echo "rc $?"
python3 - "$OUT/trace.json" <<'P'
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    print(f"== {r['mode']}: {len(r.get('profile', {}).get('top_ops', []))} operators")
    for op in r.get("profile", {}).get("top_ops", [])[:15]:
        print(f"  {op.get('device_ms', op.get('cpu_ms', 0)):9.2f} ms  {op['calls']:6d}  {op['name'][:90]}")
P
