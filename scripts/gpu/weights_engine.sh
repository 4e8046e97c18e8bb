#!/usr/bin/env bash
# Compressed weights in the engine, on one GPU; parts (default: all), each bounded by a limit:
#   tests -- the GPU tests of the weights' engine path and of the model families (CUDA graphs,
#            grouped GEMM, windows)
#   run8b -- bench throughput weights / compressed / uncompressed on llama-3.1-8b-random at KV_GB (8) GiB
#            of KV (the weights mode's KV gets what its weights saved on top: the same total memory)
#   qwen  -- bench throughput weights vs uncompressed on qwen3-32b-random at the KV budget qwencap found
#            uncompressed (an 80 GB GPU's default; the weights mode adds what its weights saved)
#   qwencap -- qwen3-32b-random started at default memory with weights + KV compressed and with
#            neither: both sizes, the KV budget and the tokens it holds at open size (AS_FREE_GIB:
#            a larger GPU holds back all but that much, e.g. 78.5 for an H100 80GB)
#   serve -- bench serve, closed loop of SERVE_CONC (64), weights / compressed / uncompressed at 16 GiB (8B)
# A short table last.   bash scripts/gpu/weights_engine.sh [tests] [run8b] [qwen] [serve]
set -u
OUT=${OUT:-/tmp/weights_out}; mkdir -p "$OUT"
. scripts/gpu/env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
for part in ${*:-tests run8b qwen serve}; do
case $part in
tests)
  timeout -k 5 ${TEST_LIMIT:-150} python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_weight_engine.py \
      tests/test_model_families.py > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc $?"; tail -4 "$OUT/gpu_tests.log" | cut -c1-200 ;;
run8b)
  timeout -k 10 ${TP_LIMIT:-220} python3 -m zipfusion bench throughput --model llama-3.1-8b-random --device cuda \
      --kv-memory-gb ${KV_GB:-8} --compare weights,compressed,uncompressed --dataset reasoning --num-prompts 128 \
      --output-len 500 --timeout ${MODE_TIMEOUT:-150} --out "$OUT/throughput_8b" > "$OUT/throughput_8b.log" 2>&1
  echo "run8b rc $?"; tail -8 "$OUT/throughput_8b.log" | cut -c1-220 ;;
qwen)   # at the uncompressed KV budget qwencap found (an 80 GB GPU's default), if it ran
  kv=$(python3 -c "import json,sys; print('--kv-memory-gb %.2f' % json.load(open(sys.argv[1]))['kv_memory_gb'])" \
       "$OUT/qwen32_0.json" 2>/dev/null)
  timeout -k 10 ${QWEN_LIMIT:-240} python3 -m zipfusion bench throughput --model qwen3-32b-random --device cuda $kv \
      --compare weights,uncompressed --dataset reasoning --num-prompts 96 --output-len 400 --timeout ${QWEN_MODE_TIMEOUT:-160} \
      --out "$OUT/throughput_qwen32" > "$OUT/throughput_qwen32.log" 2>&1
  echo "qwen rc $?"; tail -8 "$OUT/throughput_qwen32.log" | cut -c1-220
  [ "${ANALYZE:-0}" = 1 ] && timeout -k 5 ${ANALYZE_LIMIT:-45} python3 -m zipfusion analyze --weights qwen3-32b-random --layers 4 --device cuda \
      --plot "$OUT/analyze_qwen32.png" --json "$OUT/analyze_qwen32.json" 2>&1 | grep -A7 "^kind" | tail -8 ;;
qwencap)   # qwen3-32b-random at default memory, both compressed or neither (CAP_ORDER)
  for wc in ${CAP_ORDER:-0 1}; do
    timeout -k 10 ${CAP_LIMIT:-80} python3 - "$wc" "$OUT/qwen32_$wc.json" <<'EOF' 2>&1 | grep -v "it/s\|tensor/s" | tail -4
import json, sys, time
import torch
from zipfusion import LLMEngine
from zipfusion.kernels import weight_linear
wc = sys.argv[1] == "1"
free0 = torch.cuda.mem_get_info()[0]
# a larger GPU plays an 80 GB H100 (AS_FREE_GIB free at start): the rest is held by a blocker
as_free = float(__import__("os").environ.get("AS_FREE_GIB", 0)) * 2**30
blocker = torch.empty(int(free0 - as_free), dtype=torch.uint8, device="cuda") if 0 < as_free < free0 else None
built = {"free_gb_at_start": torch.cuda.mem_get_info()[0] / 2**30}
_warmup = weight_linear.warmup
def timed(*a, **k):                       # the fused kernels' build time, apart from the rest
    t = time.perf_counter(); _warmup(*a, **k); built["warmup_s"] = time.perf_counter() - t
weight_linear.warmup = timed
t0 = time.perf_counter()
eng = LLMEngine("qwen3-32b-random", device="cuda", weight_compression=wc, kv_compression=wc, enforce_eager=True)
pages = eng.cache.capacity_new_pages()
rec = {"weight_compression": wc, "kv_compression": wc, "start_s": time.perf_counter() - t0, **built,
       "weights_gb": eng.weights.original_bytes / 2**30, "weights_stored_gb": eng.weights.stored_bytes / 2**30,
       "kv_memory_gb": eng.kv_memory_gb, "kv_open_tokens": pages * 16,
       "free_gb_after": torch.cuda.mem_get_info()[0] / 2**30, "gpu": torch.cuda.get_device_name()}
print(json.dumps(rec))
json.dump(rec, open(sys.argv[2], "w"))
EOF
  done ;;
serve)
  timeout -k 10 ${SERVE_LIMIT:-330} python3 -m zipfusion bench serve --model llama-3.1-8b-random --device cuda \
      --kv-memory-gb 16 --compare ${SERVE_MODES:-weights,compressed,uncompressed} --dataset reasoning --output-len 400 \
      --num-prompts ${SERVE_N:-160} --request-rates inf --max-concurrency ${SERVE_CONC:-64} --out "$OUT/serve_8b" > "$OUT/serve_8b.log" 2>&1
  echo "serve rc $?"; tail -10 "$OUT/serve_8b.log" | cut -c1-220 ;;
esac
done

python3 - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
print("\n== summary ==")
for name in ("throughput_8b", "throughput_qwen32"):
  p = os.path.join(out, name + ".json")
  if os.path.exists(p):
    r = json.load(open(p))
    for x in r["records"]:
        if "output_tok_s" in x:
            print(f"{name} {x['mode']:<13} {x['output_tok_s']:>9,.0f} out tok/s  peak batch {x['peak_batch']:>4}  "
                  f"weights {x['weights_stored_gb']:.2f} GiB  KV {x['kv_memory_gb']:.2f} GiB")
        else:
            print(f"{name} {x['mode']:<13} {(x.get('error') or x.get('skipped', ''))[-150:]}")
    print("identical tokens:", r.get("identical_outputs"))
q = [os.path.join(out, f"qwen32_{w}.json") for w in (0, 1)]
if all(os.path.exists(x) for x in q):
    a, b = (json.load(open(x)) for x in q)
    for x in (a, b):
        print(f"qwen3-32b {'compressed  ' if x['weight_compression'] else 'uncompressed'}: weights {x['weights_gb']:.1f} -> "
              f"{x['weights_stored_gb']:.1f} GiB, KV {x['kv_memory_gb']:.1f} GiB, {x['kv_open_tokens']:,} tokens at open size")
    print("qwen3-32b start-up s:", {x['weight_compression']: (round(x['start_s'], 1), round(x.get('warmup_s', 0), 1)) for x in (a, b)})
    print(f"qwen3-32b KV tokens compressed / uncompressed at open size: {b['kv_open_tokens'] / a['kv_open_tokens']:.2f}x")
p = os.path.join(out, "serve_8b.json")
if os.path.exists(p):
    r = json.load(open(p))
    for m, x in r["modes"].items():
        s = x.get("summary", {})
        print(f"8B serve {m:<13} {json.dumps({k: v for k, v in s.items() if 'tok' in k})[:160]}  KV "
              f"{x.get('server', {}).get('kv_memory_gb')}")
EOF
echo "total ${SECONDS}s"
