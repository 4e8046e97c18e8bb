#!/usr/bin/env bash
# Issue 47 item 4 on one GPU: BF16 (open), BF16-lossless (compressed) and FP8 KV side by side.
#   kernel -- zipfusion bench kernel: decode attention over the same values as BF16 compressed /
#             open pages, FlashInfer's BF16 decode, our FP8 kernel and FlashInfer's FP8 decode
#             (its E4M3 JIT build, ~30 s), batch 32/64 x 8K at 100 % and the real model's 92 %
#             compressible (~2 min)
#   run    -- zipfusion bench throughput: a decode-heavy run (the reasoning dataset, 128 requests,
#             answers ~500 tokens) at 4 GiB of KV in every mode, each mode in its own process
#             (~4 min): capacity (peak batch) and whole-run tokens/s; flashinfer_fp8: the FP8
#             cache decoded by FlashInfer's FP8 kernel (RUN_MODES picks)
# FP8 + lossless: scripts/gpu/fp8_lossless.sh.
#   bash scripts/gpu/fp8_side_by_side.sh [kernel] [run]     # results under $OUT
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/env.sh || exit 1
OUT=${OUT:-/tmp/fp8_out}; mkdir -p "$OUT"
for part in ${*:-kernel run}; do
case $part in
kernel)
  timeout -k 10 ${KERNEL_LIMIT:-200} python3 -m zipfusion bench kernel --compare \
    compressed,uncompressed,flashinfer,fp8,flashinfer_fp8 --fractions ${FRACTIONS:-1,0.92} --batches 32,64 --contexts 8192 \
    --out "$OUT/kernel_fp8" > "$OUT/kernel_fp8.log" 2>&1; echo "kernel rc $?"; tail -8 "$OUT/kernel_fp8.log" ;;
run)
  timeout -k 10 ${RUN_LIMIT:-330} python3 -m zipfusion bench throughput --model llama-3.1-8b-random --device cuda \
    --kv-memory-gb 4 --compare ${RUN_MODES:-compressed,uncompressed,fp8,flashinfer_fp8} --dataset reasoning --num-prompts 128 --output-len 500 \
    --timeout 130 --out "$OUT/throughput_fp8" > "$OUT/throughput_fp8.log" 2>&1; echo "run rc $?"
  grep -v "^  \[" "$OUT/throughput_fp8.log" | tail -12 | cut -c1-250 ;;
*) echo "unknown part $part (kernel, run)"; exit 2 ;;
esac
done
