#!/usr/bin/env bash
# Verify and measure ad54bd1 (issue 44): decode splits balanced per request, and the seal's
# analysis launched behind the step's sampling. Neither has run on a GPU yet.
#   tests -- the decode kernels' GPU tests (balanced splits on the CUDA kernel, tables 2,047
#            pages wide; the producer kernel; small cases) and the engine's seal / sync tests (~2 min)
#   run   -- the decode-heavy run of benchmarks/results/trace_h100 (128 `reasoning` requests, 4 GiB
#            of KV) compressed, uncompressed and fp8, each in its own process (~5 min), then decode
#            steps at equal rows (benchmarks/step_stats.py): before, 9.4-9.7 ms p50 compressed
#            against 8.3-8.7 uncompressed at 28-31 rows (measured: benchmarks/results/balanced_h100)
#   serve -- serving at 4 GiB of KV, where the decode-heavy mix saturates near 3.6 req/s
#            uncompressed (the offline run's rate), at Poisson 3 / 4 / 5 req/s (~9 min; 8 GiB did
#            not saturate at 7 req/s in balanced_h100)
#   steady -- serving at saturation in steady state: a closed loop of 64 requests in flight (more
#            than 4 GiB holds in either mode: the KV binds) over 300 requests, both modes; the
#            number is the output rate while requests keep being sent (~5 min; 160 Poisson
#            requests a rate were mostly ramp and tail: benchmarks/results/onepass_h100, section 5);
#            KV_GB=16 PROMPTS=800 CONCURRENCY=256: the issue's 16 GiB (MODE_S=270);
#            ADMISSION=lookahead runs both servers with that admission (the simulated closed loop
#            ran 1.51x / 1.57x the requests: benchmarks/results/closed_loop_sim_cpu)
#   gather -- what a compressed mixed step adds: the engine's restore of a chunk's pages before
#            its dense prefill (gather_kv) over compressed vs open pages, tile sizes 1-8, beside the
#            paged and dense prefill kernels (benchmarks/prefill_attention.py, ~2 min); the
#            prefill-heavy run's steps with prefill took 10 % longer compressed (balanced_h100)
#   mixprof -- where a compressed mixed step's time goes: the prefill-heavy `agent` run (G) with
#            steps 40-47 traced by torch.profiler in each mode (top operators by device time in
#            the JSON; ~3 min)
#   sealprof -- the page store's small seals on the GPU's host (benchmarks/seal.py --small: analysis and
#            placement host ms for 1-80 pages, cProfile of each in seal_small.json; ~1 min)
#   bash scripts/gpu/balanced_splits.sh [tests] [run] [serve] [steady] [gather] [mixprof] [sealprof]   # results under $OUT
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/env.sh || exit 1
OUT=${OUT:-/tmp/balanced_out}; mkdir -p "$OUT"
for part in ${*:-tests run}; do
case $part in
tests)
  timeout -k 5 ${TEST_LIMIT:-150} python3 -m pytest -q -x -m gpu tests/test_decode_attention.py \
    -k "balanced or producer or small_cases_cuda or split_pages_batch or packed_requests_cuda" > "$OUT/tests_kernel.log" 2>&1
  echo "kernel tests rc $?"; tail -2 "$OUT/tests_kernel.log"
  timeout -k 5 ${TEST_LIMIT:-150} python3 -m pytest -q -x tests/test_engine_kernel.py tests/test_engine.py tests/test_page_store.py \
    -k "seals_around or page_table_kept or wait or identical or packed_decode" > "$OUT/tests_engine.log" 2>&1
  echo "engine tests rc $?"; tail -2 "$OUT/tests_engine.log" ;;
run)     # fp8_side_by_side.sh's whole run (writes throughput_fp8*), without FlashInfer's FP8 JIT build
  RUN_MODES=${RUN_MODES:-compressed,uncompressed,fp8} OUT=$OUT bash scripts/gpu/fp8_side_by_side.sh run \
    2>&1 | grep -v "^WARNING: Target"
  python3 benchmarks/step_stats.py "$OUT/throughput_fp8_steps.json" | awk -F'|' 'NR<=2 || ($2+0>=24 && $2+0<=34)' ;;
serve)
  RATES=${RATES:-3,4,5} PROMPTS=${PROMPTS:-180} MODE_S=${MODE_S:-270} OUT=$OUT/serve \
    bash scripts/gpu/serve_compare.sh --kv-memory-gb 4 2>&1 | grep -v "^WARNING: Target" | tail -24 ;;
steady)
  RATES=inf PROMPTS=${PROMPTS:-300} MODE_S=${MODE_S:-200} OUT=$OUT/steady \
    bash scripts/gpu/serve_compare.sh --kv-memory-gb ${KV_GB:-4} --max-concurrency ${CONCURRENCY:-64} \
    ${ADMISSION:+--server-args "--admission $ADMISSION"} 2>&1 \
    | grep -v "^WARNING: Target" | tail -12 ;;
gather)
  timeout -k 5 ${GATHER_LIMIT:-240} python3 benchmarks/prefill_attention.py --out "$OUT/prefill" 2>&1 | tail -30 ;;
mixprof)
  timeout -k 10 ${PROF_LIMIT:-240} python3 -m zipfusion bench throughput --model llama-3.1-8b-random --device cuda \
    --kv-memory-gb 4 --compare compressed,uncompressed --dataset agent --num-prompts 160 --timeout 110 \
    --profile-steps ${PROF_STEPS:-40:48} --out "$OUT/mixprof" > "$OUT/mixprof.log" 2>&1; echo "mixprof rc $?"
  rm -f "$OUT"/mixprof_*.trace.json.gz
  python3 - "$OUT/mixprof.json" "$OUT/mixprof_steps.json" <<'EOF'
import json, sys
d, steps = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
for r in d["records"]:
    p = r.get("profile")
    if not p:
        print(r["mode"], "no profile:", r.get("error", "")[-300:]); continue
    a, b = p["steps"]
    st = steps[r["mode"]]; i = st["fields"].index
    rows = st["rows"][a:b]
    print(f"{r['mode']}: steps {a}..{b - 1}: prefill tokens {[x[i('prefill_tokens')] for x in rows]}, "
          f"decode rows {[x[i('decode_rows')] for x in rows]}, ms {[round(1e3 * x[i('seconds')], 1) for x in rows]}")
    for o in p["top_ops"][:18]:
        print(f"  {o.get('device_ms', o.get('cpu_ms', 0)):9.2f} ms {o['calls']:6d}  {o['name'][:90]}")
EOF
  ;;
sealprof)
  timeout -k 5 ${SEAL_LIMIT:-150} python3 benchmarks/seal.py --small ${SEAL_PAGES:-1,2,8,40,80} --reps 9 --out "$OUT" \
    > "$OUT/seal_small.log" 2>&1; echo "seal small rc $?"; grep "^seal of" "$OUT/seal_small.log" ;;
*) echo "unknown part $part (tests, run, serve, steady, gather, mixprof, sealprof)"; exit 2 ;;
esac
done
