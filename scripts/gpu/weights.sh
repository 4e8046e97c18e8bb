#!/usr/bin/env bash
# One device call for the weight-format kernels (kernels/weight_linear.py): the GPU tests beside a
# parallel precompile, then the tuning sweep (scripts/gpu/weights_tune.py), or with BENCH=1 the
# full `zipfusion bench kernel --linear` run and the restore variants. Logs and JSON under $OUT.
#   cd .carry/wkernel && [BENCH=1] bash scripts/gpu/weights.sh
set -u
OUT="${OUT:-gpu_out}"; mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
timeout "${TEST_S:-150}" python3 -m pytest -q -rs -x -p no:cacheprovider -m gpu tests/test_weight_linear.py \
  tests/test_weight_format.py > "$OUT/tests.log" 2>&1 &
tests=$!
if [ "${BENCH:-0}" = 1 ]; then
  timeout 120 python3 scripts/gpu/weights_tune.py --restore-variants --precompile-only 2>&1 | tee "$OUT/variants.log" | tail -3
  wait $tests                                   # no timing while the tests run
  timeout "${BENCH_S:-300}" python3 -m zipfusion bench kernel --linear --out "$OUT/weights_kernel" ${BENCH_ARGS:-} \
    2>&1 | tee "$OUT/bench.log" | tail -48
  timeout "${VARIANTS_S:-60}" python3 scripts/gpu/weights_tune.py --restore-variants --no-precompile 2>&1 \
    | tee -a "$OUT/variants.log" | tail -14
else
  timeout 120 python3 scripts/gpu/weights_tune.py --precompile-only 2>&1 | tee "$OUT/tune.log" | tail -5
  wait $tests
  timeout "${TUNE_S:-240}" python3 scripts/gpu/weights_tune.py --no-precompile ${TUNE_ARGS:-} 2>&1 \
    | tee -a "$OUT/tune.log" | tail -75
fi
echo "== tests"; tail -8 "$OUT/tests.log"
