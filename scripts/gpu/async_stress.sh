#!/usr/bin/env bash
# The async-scheduling stress harness on the GPU (benchmarks/async_stress.py; docs/design.md, "The
# hang:"): llama-3.1-8b-random (weights uncompressed, so an engine builds fast), check_pages on,
# random device delays between the host's decisions and the GPU's progress, every run bounded in
# time and checked against the plain order. Three parts, each its own engine(s):
#   fast  the default engine (estimate admission), mixed prompts, 1.5 GiB KV    FAST_MIN (3) minutes
#   det   deterministic, optimistic admission, arrivals, aborts, stop tokens   DET_MIN (1.5)
#   long  6 x ~14K-token prompts, 3 GiB KV, fast (the hang's shape, smaller)    LONG_MIN (1.5)
# ~7 min on an H100 by default. $OUT/<part>/async_stress.json and worker_<n>.err (stacks of a
# hang), $OUT/<part>.log (a line per run); the tables last. STRESS_ARGS: more harness options
# (`STRESS_ARGS=--smoke FAST_MIN=0.5 DET_MIN=0.5 LONG_MIN=0.5`: the same on the CPU, demo model).
#   bash scripts/gpu/async_stress.sh
set -u
OUT=${OUT:-/tmp/async_stress_out}; mkdir -p "$OUT"
. scripts/gpu/env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
ENGINE=${ENGINE:-'{"weight_compression": false}'}

part() {   # name minutes [harness options ...]
  local name=$1 min=$2; shift 2
  local lim; lim=$(python3 -c "print(int($min * 60 + 90))")
  echo "== $name: $min min (limit $lim s)"
  timeout -k 10 "$lim" python3 benchmarks/async_stress.py --out "$OUT/$name" --minutes "$min" \
      --engine-args "$ENGINE" "$@" ${STRESS_ARGS:-} > "$OUT/$name.log" 2>&1
  echo "rc $? after $SECONDS s; $(grep -c '\] .* v[1-9]: ' "$OUT/$name.log") stressed runs"
  grep -E '^(hang|mismatch|error|diverged):' "$OUT/$name.log" | head -5 | cut -c1-400
}
part fast "${FAST_MIN:-3}" --modes fast --variants 3
part det "${DET_MIN:-1.5}" --modes det --variants 3
part long "${LONG_MIN:-1.5}" --modes fast --shape long --variants 2
for name in fast det long; do
  echo "== $name"; grep -A6 '^async stress:' "$OUT/$name.log" | cut -c1-300
done
echo "total ${SECONDS}s"
