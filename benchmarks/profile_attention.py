#!/usr/bin/env python3
"""Profile target for Nsight Compute: one decode-attention case (batch 32, 8K, Llama-3.1-8B
shapes), each kernel called a few times. Usage on the GPU machine:

    ncu --clock-control none -k regex:attention_kernel --launch-skip 2 --launch-count 1 \
        python3 benchmarks/profile_attention.py --kernel fused --fraction 1.0 --stages 4 --splits 8
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import attention as bench  # noqa: E402  (benchmarks/attention.py)

ap = argparse.ArgumentParser()
ap.add_argument("--kernel", choices=["uncompressed", "fused"], default="fused")
ap.add_argument("--fraction", type=float, default=1.0)
ap.add_argument("--batch", type=int, default=32)
ap.add_argument("--context", type=int, default=8192)
ap.add_argument("--stages", type=int, default=None)
ap.add_argument("--splits", type=int, default=None)
args = ap.parse_args()
bench.ROTATE_BYTES = 1                      # one copy of the inputs
case = bench.Case(bench.Pool(args.fraction, seed=1), args.batch, args.context)
fn = getattr(case, "run_" + args.kernel)
for _ in range(3):
    fn(0, stages=args.stages, num_splits=args.splits)
torch.cuda.synchronize()
print("done")
