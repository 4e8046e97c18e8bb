#!/usr/bin/env bash
# The H200 measurements issues 22 and 23 still wait for, in parts that each fit a device call
# (10 min) together as below. Send .carry along (scripts/gpu/carry_wheels.sh). Output under $OUT.
#   bash scripts/gpu/open_goals.sh tests preemption esc     # ~9 min
#   bash scripts/gpu/open_goals.sh server                   # ~5 min
# tests:      the host tier's GPU tests (encoded_pages + place_pages round trip on CUDA, the copies' timing events)
# preemption: long_swap vs long_recompute, compressed: workloads.json's preemption_cost (issue 22:
#             <= 0.05 of what recompute costs)
# esc:        the decode kernel's COMPRESSED_ESC page kind (built with -DZF_ESC_KIND): its CUDA
#             tests, then benchmarks/attention.py --quick without and with it (issue 23)
# packed:     packed decode (attention/packing.py): its CUDA kernel tests, then shared_prefix with and
#             without it, compressed and uncompressed, side by side (~7 min)
# server:     the shared-prefix workload through `zipfusion serve`, compressed and uncompressed
#             (issue 22: "through LLM.generate and through the server")
set -u
OUT=${OUT:-/tmp/open_goals}; mkdir -p "$OUT"
. scripts/gpu/env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

packed() {
  timeout 150 python3 -m pytest -q -rs -x -p no:cacheprovider tests/test_decode_attention.py tests/test_engine_kernel.py \
    -k "packed and (cuda or graphs)" > "$OUT/packed_tests.log" 2>&1
  echo "packed kernel tests: rc $?"; tail -2 "$OUT/packed_tests.log"
  mkdir -p "$OUT/packed"
  timeout -k 5 420 python3 benchmarks/workloads.py --out "$OUT/packed" --timeout 100 --scenarios shared_prefix \
    --modes "${PACKED_MODES:-compressed_packed,uncompressed_packed,compressed,uncompressed}" > "$OUT/packed/workloads.log" 2>&1
  echo "packed shared_prefix: rc $?"; grep -E "done in" "$OUT/packed/workloads.log" | cut -c1-200
  python3 - "$OUT/packed/workloads.json" <<'P'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["records"]:
    print(f"{r.get('mode'):22s} total {r.get('total_tok_s', 0):9.0f} tok/s  peak batch {r.get('peak_batch')}  "
          f"decode@peak {r.get('decode_tok_s_at_peak_batch', 0):8.0f}  sha {str(r.get('outputs_sha256'))[:12]}")
for scen, rs in d.get("ratios", {}).items():
    for name, v in rs.items():
        print(scen, name, f"total {v.get('total_tok_s', float('nan')):.3f}x")
P
}

tests() {
  timeout 90 python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_host_tier.py > "$OUT/host_tier_gpu.log" 2>&1
  echo "host tier GPU tests: rc $?"; tail -2 "$OUT/host_tier_gpu.log"
}

preemption() {
  mkdir -p "$OUT/preemption"
  timeout -k 5 190 python3 benchmarks/workloads.py --out "$OUT/preemption" --timeout 180 \
    --scenarios long_swap,long_recompute --modes compressed > "$OUT/preemption/workloads.log" 2>&1
  echo "preemption: rc $?"; grep -E "done in" "$OUT/preemption/workloads.log" | cut -c1-200
  python3 -c "import json; print('preemption_cost', json.load(open('$OUT/preemption/workloads.json')).get('preemption_cost'))" 2>&1 | tail -1
}

esc() {
  timeout 80 python3 -m pytest -q -rs -x -p no:cacheprovider tests/test_decode_attention.py \
    -k "cuda or escape or adversarial" --cuda-define ZF_ESC_KIND > "$OUT/esc_tests.log" 2>&1
  echo "ESC kind tests: rc $?"; tail -2 "$OUT/esc_tests.log"
  for v in plain esc; do
    define=""; [ $v = esc ] && define="--define ZF_ESC_KIND"
    timeout 100 python3 benchmarks/attention.py --quick $define --out "$OUT/$v" > "$OUT/$v.log" 2>&1
    echo "attention --quick, $v: rc $?"
  done
  python3 - "$OUT" <<'P'
import json, os, sys
for v in ("plain", "esc"):
    for name in ("attention_quick.json", "attention_partial.json"):
        f = os.path.join(sys.argv[1], v, name)
        if os.path.exists(f):
            break
    else:
        print(v, "no result"); continue
    rows = {}
    for r in json.load(open(f)):
        rows.setdefault(r["compressible_fraction_nominal"], {})[r["kernel"]] = r["median_ms"]
    for frac, d in sorted(rows.items(), key=lambda x: -x[0]):
        fi = d.get("flashinfer")
        print(v, f"{frac:.2f}", " ".join(f"{k} {ms:.4f} ms" + (f" ({fi / ms:.3f}x FI)" if fi else "") for k, ms in sorted(d.items())))
P
}

server() {
  # both modes, one server process each (zipfusion bench serve --compare)
  timeout -k 5 560 python3 -m zipfusion bench serve --model llama-3.1-8b-random --device cuda --compare \
    --request-rates inf --dataset random --num-prompts 512 --input-len 256 --output-len 256 --shared-prefix 4096 \
    --prefix-group 16 --kv-memory-gb 16 --out "$OUT/serve_shared_prefix" > "$OUT/serve.log" 2>&1
  echo "server: rc $?"; tail -8 "$OUT/serve.log" | cut -c1-300
}

parts=("$@"); [ $# -eq 0 ] && parts=(tests preemption esc)
for part in "${parts[@]}"; do "$part"; done
echo "total ${SECONDS}s"
