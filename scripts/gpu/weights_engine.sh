#!/usr/bin/env bash
# Compressed weights in the engine (issue 61), one call, at most ~8 min on an H100 (limits below): the GPU tests of
# tests/test_weight_engine.py; bench throughput weights / compressed / uncompressed on
# llama-3.1-8b-random at 16 GiB of KV (the weights mode's KV gets what its weights saved on
# top); the weight analyzer on qwen3-32b-random (4 layers); qwen3-32b-random started at default memory with weights compressed and not (both sizes,
# the KV budget and the tokens it holds); bench serve weights vs uncompressed when the server
# extra is there (.carry/, scripts/gpu/carry_wheels.sh) and time is left. A short table last.
#   bash scripts/gpu/weights_engine.sh
set -u
OUT=${OUT:-/tmp/weights_out}; mkdir -p "$OUT"
. scripts/gpu/env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

timeout -k 5 ${TEST_LIMIT:-90} python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_weight_engine.py \
    2>&1 | tail -6 | tee "$OUT/gpu_tests.log"

timeout -k 10 ${TP_LIMIT:-190} python3 -m zipfusion bench throughput --model llama-3.1-8b-random --device cuda \
    --kv-memory-gb 16 --compare weights,compressed,uncompressed --dataset reasoning --num-prompts 128 \
    --output-len 500 --timeout 90 --out "$OUT/throughput_8b" 2>&1 | tail -12 | cut -c1-220

for m in qwen3-32b-random; do      # the analyzer on the GPU, 4 layers sampled
  timeout -k 5 ${ANALYZE_LIMIT:-45} python3 -m zipfusion analyze --weights $m --layers 4 --device cuda \
      --plot "$OUT/analyze_$m.png" --json "$OUT/analyze_$m.json" 2>&1 | grep -A7 "^kind" | tail -8
done

# qwen3-32b-random at default memory: each setting in its own process (a clean GPU)
for wc in 0 1; do
  timeout -k 10 ${QWEN_LIMIT:-80} python3 - "$wc" "$OUT/qwen32_$wc.json" <<'EOF' 2>&1 | grep -v "it/s\|tensor/s" | tail -4
import json, sys, time
import torch
from zipfusion import LLMEngine
wc = sys.argv[1] == "1"
t0 = time.perf_counter()
eng = LLMEngine("qwen3-32b-random", device="cuda", weight_compression=wc, kv_compression=wc, enforce_eager=True)
pages = eng.cache.capacity_new_pages()
rec = {"weight_compression": wc, "kv_compression": wc, "start_s": time.perf_counter() - t0,
       "weights_gb": eng.weights.original_bytes / 2**30, "weights_stored_gb": eng.weights.stored_bytes / 2**30,
       "kv_memory_gb": eng.kv_memory_gb, "kv_open_tokens": pages * 16,
       "free_gb_after": torch.cuda.mem_get_info()[0] / 2**30, "gpu": torch.cuda.get_device_name()}
print(json.dumps(rec))
json.dump(rec, open(sys.argv[2], "w"))
EOF
done

if [ "$SECONDS" -lt "${SERVE_IF_BEFORE:-300}" ] && python3 -c "import fastapi, uvicorn, httpx" 2>/dev/null; then
  timeout -k 10 ${SERVE_LIMIT:-150} python3 -m zipfusion bench serve --model llama-3.1-8b-random --device cuda \
      --kv-memory-gb 16 --compare weights,uncompressed --dataset reasoning --output-len 300 --num-prompts 96 \
      --request-rates inf --max-concurrency 64 --warmup 2 --out "$OUT/serve_8b" 2>&1 | tail -8 | cut -c1-220
else
  echo "bench serve skipped (server extra missing or past ${SERVE_IF_BEFORE:-300} s)"
fi

python3 - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
print("\n== summary ==")
p = os.path.join(out, "throughput_8b.json")
if os.path.exists(p):
    r = json.load(open(p))
    for x in r["records"]:
        if "output_tok_s" in x:
            print(f"8B throughput {x['mode']:<13} {x['output_tok_s']:>9,.0f} out tok/s  peak batch {x['peak_batch']:>4}  "
                  f"weights {x['weights_stored_gb']:.2f} GiB  KV {x['kv_memory_gb']:.2f} GiB")
        else:
            print(f"8B throughput {x['mode']:<13} {(x.get('error') or x.get('skipped', ''))[-150:]}")
    print("identical tokens:", r.get("identical_outputs"))
q = [os.path.join(out, f"qwen32_{w}.json") for w in (0, 1)]
if all(os.path.exists(x) for x in q):
    a, b = (json.load(open(x)) for x in q)
    for x in (a, b):
        print(f"qwen3-32b weights {'on ' if x['weight_compression'] else 'off'}: {x['weights_gb']:.1f} -> "
              f"{x['weights_stored_gb']:.1f} GiB, KV {x['kv_memory_gb']:.1f} GiB, {x['kv_open_tokens']:,} tokens open")
    print(f"qwen3-32b KV tokens on/off (open pages): {b['kv_open_tokens'] / a['kv_open_tokens']:.2f}x "
          "(x the KV ratio, ~1.33, once pages are compressed)")
p = os.path.join(out, "serve_8b.json")
if os.path.exists(p):
    r = json.load(open(p))
    for m, x in r["modes"].items():
        s = x.get("summary", {})
        print(f"8B serve {m:<13} {json.dumps({k: v for k, v in s.items() if 'tok' in k})[:160]}  KV "
              f"{x.get('server', {}).get('kv_memory_gb')}")
EOF
echo "total ${SECONDS}s"
