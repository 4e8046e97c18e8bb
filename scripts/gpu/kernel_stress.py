#!/usr/bin/env python3
"""Does the decode kernel ever stall? The engine's `long` run hung in its tail (2 requests of
~33K tokens decoding, the host waiting for a step's tokens, the GPU busy): this launches the
decode kernel as the engine does in that tail -- a few requests, every page compressed but the
last one (open), the context one token longer each launch -- thousands of times, an event after
each launch, and waits for them with a deadline. A launch that never completes is named with its
batch, context lengths and split settings; otherwise the launches' count and time are printed.

    PYTHONPATH=src python3 scripts/gpu/kernel_stress.py [--launches 50000] [--deadline 20]
"""

from __future__ import annotations

import argparse
import time

import torch

from zipfusion.analysis.synthetic import pages_with_fraction
from zipfusion.format import PageLayout, encode_pages_into, page_sizes
from zipfusion.kernels import decode_attention

PS, H, HQ, D = 16, 8, 32, 128                  # Llama-3.1-8B's KV heads, query heads, head dim


def arena_for(B: int, max_ctx: int, seed: int, dev: str):
    """An arena holding B requests of up to max_ctx tokens: pages 0..P-2 of each compressed, its
    last page open (as the engine's running requests); the page table and block table."""
    layout = PageLayout(H, D)
    npr = -(-max_ctx // PS)
    pool = pages_with_fraction(256, H, D, 1.0, seed=seed).to(dev)
    sizes = page_sizes(pool)
    idx = torch.arange(B * npr, device=dev) % 256
    comp = sizes[idx]
    off = torch.cumsum(comp, 0) - comp
    comp_bytes = int(comp.sum())
    open_at = (comp_bytes + 15) // 16 * 16
    arena = torch.zeros(open_at + B * layout.open_page_bytes, dtype=torch.uint8, device=dev)
    encode_pages_into(pool[idx], arena, off)
    loc = off.clone()
    last = torch.arange(B, device=dev) * npr + npr - 1
    loc[last] = (open_at + torch.arange(B, device=dev) * layout.open_page_bytes) | 1
    arena[open_at:].view(torch.bfloat16).copy_(pool[:B].reshape(-1)[:B * layout.open_page_bytes // 2])
    table = torch.arange(B * npr, dtype=torch.int32, device=dev).view(B, npr)
    return layout, arena, loc, table, npr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launches", type=int, default=50000)
    ap.add_argument("--deadline", type=float, default=20.0, help="seconds a launch may take to complete")
    ap.add_argument("--batches", default="1,2,3,5,7")
    ap.add_argument("--context", type=int, default=32768, help="first context length (tokens)")
    ap.add_argument("--device", default="cuda", help="cpu: the Triton interpreter, a check of this script only")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    per = args.launches // len(batches)
    t0, total = time.perf_counter(), 0
    for B in batches:
        max_ctx = args.context + per + PS
        dev = args.device
        layout, arena, loc, table, npr = arena_for(B, max_ctx, seed=B, dev=dev)
        q = torch.randn(B, HQ, D, device=dev, dtype=torch.bfloat16)
        out = torch.empty_like(q)
        pending = []
        first = torch.full((B,), args.context, dtype=torch.int32, device=dev)
        bt0 = table[:, :-(-args.context // PS)].clone()
        bt0[:, -1] = table[:, npr - 1]
        decode_attention(q, arena, loc, bt0, first, layout, D ** -0.5, out, validate=True)   # sound tables
        for i in range(per):
            # the engine's tail: every request one token further each step; the open last page
            # holds the newest tokens, so the context ends inside it (its page count fixed here)
            ctx = args.context + i
            n_pages = -(-ctx // PS)
            lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
            bt = table[:, :n_pages].clone()
            bt[:, -1] = table[:, npr - 1]                       # the open page last
            decode_attention(q, arena, loc, bt, lens, layout, D ** -0.5, out, validate=False)
            ev = torch.cuda.Event() if dev != "cpu" else None
            if ev is not None:
                ev.record()
            pending.append((ev, B, ctx))
            if len(pending) >= 256:
                wait(pending, args.deadline)
                pending = []
        wait(pending, args.deadline)
        total += per
        print(f"B={B}: {per} launches, contexts {args.context}..{args.context + per - 1}: all completed "
              f"({time.perf_counter() - t0:.1f} s so far)", flush=True)
    print(f"STRESS OK: {total} launches completed, no stall ({time.perf_counter() - t0:.1f} s)")


def wait(pending, deadline: float) -> None:
    end = time.perf_counter() + deadline
    for ev, B, ctx in pending:
        while ev is not None and not ev.query():
            if time.perf_counter() > end:
                raise SystemExit(f"STALL: a decode launch (B={B}, context {ctx}) did not complete in "
                                 f"{deadline} s")
            time.sleep(1e-3)


if __name__ == "__main__":
    main()
