#!/usr/bin/env bash
# Issue 47 items 3-4 on one GPU: FP8 pages in the lossless FP8 block format, read in place.
#   tests  -- the lossless kernel compiled (bit-identical to the open FP8 kernel) and the engine
#             with kv_cache_dtype="fp8" compressed vs not (the same tokens and logits) (~1-2 min)
#   kernel -- zipfusion bench kernel: our FP8 kernel over open pages, the lossless one over the same
#             E4M3 values encoded, FlashInfer's FP8 decode; batch 32 / 128 x 8K (~2 min)
#   run    -- zipfusion bench throughput: the decode-heavy run (reasoning, 128 requests, 4 GiB of KV)
#             in RUN_MODES (default uncompressed,fp8,fp8_lossless), each in its own process (~5 min)
#   bash scripts/gpu/fp8_lossless.sh [tests] [kernel] [run]     # results under $OUT/fp8_lossless
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/env.sh || exit 1
R=${OUT:-/tmp/fp8_lossless_out}/fp8_lossless; mkdir -p "$R"
for part in ${*:-tests kernel run}; do
case $part in
tests)
  timeout -k 10 ${TEST_LIMIT:-150} python3 -m pytest -q -x -p no:cacheprovider tests/test_fp8_lossless_attention.py \
    "tests/test_fp8_kv.py::test_lossless_fp8_engine_on_cuda_gives_the_open_fp8_bits_gpu" > "$R/tests.log" 2>&1
  echo "tests rc $?"; tail -4 "$R/tests.log" ;;
kernel)
  timeout -k 10 ${KERNEL_LIMIT:-150} python3 -m zipfusion bench kernel --compare fp8,fp8_lossless,flashinfer_fp8 \
    --fractions 1 --batches 32,128 --contexts 8192 --out "$R/kernel" > "$R/kernel.log" 2>&1
  echo "kernel rc $?"; grep -v "^  \[" "$R/kernel.log" | tail -8 | cut -c1-220 ;;
run)
  timeout -k 10 ${RUN_LIMIT:-330} python3 -m zipfusion bench throughput --model llama-3.1-8b-random --device cuda \
    --kv-memory-gb 4 --compare ${RUN_MODES:-uncompressed,fp8,fp8_lossless} --dataset reasoning --num-prompts 128 \
    --output-len 500 --timeout 130 --out "$R/throughput" > "$R/throughput.log" 2>&1; echo "run rc $?"
  grep -v "^  \[" "$R/throughput.log" | tail -12 | cut -c1-250 ;;
*) echo "unknown part $part (tests, kernel, run)"; exit 2 ;;
esac
done
