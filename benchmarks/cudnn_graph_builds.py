"""What the first cuDNN SDPA call of a new shape costs on the host (CUDA only).

torch builds a cuDNN execution graph for every new (query length, key length, causal) problem and
caches it; this times a call of each listed shape twice: first (with the build) and again. Llama-8B
heads (32 query, 8 KV, 128 dims), bf16, with the log-sum-exp. Why the engine buckets cuDNN shapes
(attention/prefill_open.py, CUDNN_BUCKET). Prints one line per shape:

    PYTHONPATH=src python3 benchmarks/cudnn_graph_builds.py > benchmarks/results/prefill_h200/cudnn_graph_builds.txt
"""
import time

import torch

op = torch.ops.aten._scaled_dot_product_cudnn_attention


def call(n, L, causal, lse=True):
    """(seconds of the first call of this shape, seconds of a second one)."""
    q = torch.randn(1, 32, n, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(1, 8, L, 128, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize(); t = time.perf_counter()
    op(q, k, k, None, lse, 0.0, causal, False, scale=0.08)
    torch.cuda.synchronize(); a = time.perf_counter() - t
    t = time.perf_counter(); op(q, k, k, None, lse, 0.0, causal, False, scale=0.08); torch.cuda.synchronize()
    return a, time.perf_counter() - t


shapes = [(64, 64, False), (1025, 8191, False), (1025, 1025, True), (8192, 8192, False), (8192, 8192, True),
          (8186, 8186, False), (8186, 8186, True), (8192, 16384, False), (8191, 16382, False), (8191, 16383, False),
          (8190, 24573, False), (7000, 7000, True), (7001, 7001, True), (7003, 7003, True), (1500, 1500, True),
          (1536, 1536, True), (2048, 2048, True), (1499, 1499, True), (8192, 4096, False), (8192, 4000, False),
          (4093, 8190, False), (4093, 4093, True)]
for n, L, c in shapes:
    a, b = call(n, L, c)
    print(f"cudnn n={n:5d} L={L:5d} causal={c!s:5}: first {a*1e3:8.1f} ms  again {b*1e3:7.2f} ms", flush=True)
