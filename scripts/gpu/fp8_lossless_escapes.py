"""Where the lossless FP8 kernel's time goes (issue 47): the kernel over pages whose blocks have no
escapes (exponents inside a blk3 window: the restore's common path alone) against pages of
model-like values (escapes in most blocks), and the open FP8 kernel over the same bytes; batch B,
context C, CUDA-graph timing as `zipfusion bench kernel`.
    PYTHONPATH=src python3 scripts/gpu/fp8_lossless_escapes.py [--batch 32 --context 8192]
"""
import argparse

import torch

from zipfusion.analysis.synthetic import realistic_pages
from zipfusion.bench.kernel import time_calls
from zipfusion.format.fp8 import Fp8PageLayout, quantize_e4m3
from zipfusion.format.fp8_blocks import encode_fp8_pages, exponent_field
from zipfusion.kernels.fp8_attention import decode_attention_fp8
from zipfusion.kernels.fp8_lossless_attention import decode_attention_fp8_lossless

ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, default=32)
ap.add_argument("--context", type=int, default=8192)
args = ap.parse_args()
H, D, G, dev = 8, 128, 4, "cuda"
lay = Fp8PageLayout(H, D)
P = 256                                               # distinct pages, reused by every request
B, W = args.batch, args.context // 16
g = torch.Generator().manual_seed(0)
q = torch.randn(B, H * G, D, generator=g).to(torch.bfloat16).to(dev)
bt = torch.stack([torch.randperm(P, generator=g)[:W] if W <= P else torch.randint(0, P, (W,), generator=g)
                  for _ in range(B)]).to(torch.int32).to(dev)
lens = torch.full((B,), args.context, dtype=torch.int32, device=dev)
for name, x in (("model-like", realistic_pages(P, H, D, seed=1)),
                ("no escapes", torch.randn(P, 2, 16, H, D, generator=g).abs().clamp(0.26, 3.9)
                 * torch.sign(torch.randn(P, 2, 16, H, D, generator=g)))):
    codes = quantize_e4m3(x)
    e = exponent_field(codes)
    enc, sizes = encode_fp8_pages(codes)
    starts = torch.cumsum(sizes, 0) - sizes
    arena = torch.zeros(int(sizes.sum()) + 64, dtype=torch.uint8)
    for i in range(P):
        arena[int(starts[i]):int(starts[i] + sizes[i])] = enc[i, :int(sizes[i])]
    arena, loc = arena.to(dev), starts.to(dev)
    open_arena = codes.reshape(-1).to(dev)
    open_loc = (torch.arange(P) * lay.open_page_bytes).to(dev) | 1
    t_open, _, _ = time_calls(lambda i: decode_attention_fp8(q, open_arena, open_loc, bt, lens, lay, D ** -0.5,
                                                             validate=False), 1)
    t_enc, _, _ = time_calls(lambda i: decode_attention_fp8_lossless(q, arena, loc, bt, lens, lay, D ** -0.5,
                                                                     validate=False), 1)
    same = torch.equal(decode_attention_fp8(q, open_arena, open_loc, bt, lens, lay, D ** -0.5),
                       decode_attention_fp8_lossless(q, arena, loc, bt, lens, lay, D ** -0.5))
    print(f"{name}: exponents {int(e.min())}..{int(e.max())}, stored {float(sizes.sum()) / codes.numel():.3f} of FP8; "
          f"fp8 {t_open * 1e3:.4f} ms, fp8_lossless {t_enc * 1e3:.4f} ms ({t_enc / t_open:.2f}x); same bits {same}")
