#!/usr/bin/env bash
# Issue 20 on one H200: benchmarks/workloads.py, whole runs timed from the first request to the last
# (burst, mix, long, deterministic, long_generation x compressed / uncompressed / FlashInfer), each
# (scenario, mode) in its own process. Arguments go to workloads.py. Send .carry/ along (bash
# scripts/gpu/carry_wheels.sh) for the flashinfer mode; without FlashInfer that mode is skipped, the
# reason recorded. Writes into $OUT: workloads.json workloads.md workloads.png steps.json workloads.log
# (partial results after each process). The script stops itself at 570 s, inside one 10-minute call.
#   bash scripts/gpu/workloads_gpu.sh --scale 0.25 --modes compressed,uncompressed --timeout 150   # ~6-7 min
#   bash scripts/gpu/workloads_gpu.sh --scenarios burst,deterministic                               # one part
#     of the full run (parts: docs/benchmarks.md "Workloads"), then on the CPU:
#   python3 benchmarks/workloads.py --merge P1/workloads.json P2/workloads.json ... --out benchmarks/results/workloads_h200
set -uo pipefail
OUT=${OUT:-/tmp/workloads_out}
mkdir -p "$OUT"
. scripts/gpu/env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader | tee "$OUT/workloads.log"
timeout -k 10 570 python3 benchmarks/workloads.py --out "$OUT" --timeout 540 "$@" 2>&1 | tee -a "$OUT/workloads.log"
echo "total ${SECONDS}s"
