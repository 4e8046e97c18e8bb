#!/usr/bin/env python3
"""Prefill-attention benchmark: the paged Triton kernels (fused over compressed pages, twin over
open pages) vs torch SDPA (flash / cuDNN / efficient) over contiguous K/V (GPU; --cpu-smoke
checks the script on the CPU at tiny shapes through the Triton interpreter).

One prompt of 32K tokens, Llama-3.1-8B attention (32 query heads, 8 KV heads, head_dim 128),
page size 16, KV data with an exact fraction of compressible blocks (default 0.96,
zipfusion.analysis.synthetic.pages_with_fraction). The prompt's pages are scattered in the
arena (random page ids), every page compressed for the fused kernel; the twin reads the same
values from open pages. Cases: one chunk of 8192 new tokens at start 0 (a fresh 8K prompt),
then chunks of 8192 at starts 8192 / 16384 / 24576 (the rest of a 32K prompt in 8K chunks).
SDPA gets the ideal input: K/V already contiguous and repeated to 32 heads (not timed), a
bottom-right causal mask. Times are do_bench medians; TFLOP/s count 4·D flops per query head
and attended key. At starts > 0 also the engine's restore before its dense route (``gather_kv``
over compressed and over open pages, GB/s of K/V written, a few ``tile_pages``): what a compressed
mixed step adds.

    python3 benchmarks/prefill_attention.py --out DIR            # the 4 cases -> DIR/prefill_attention.json
    python3 benchmarks/prefill_attention.py --sweep --out DIR    # + a knob sweep at start 24576
    python3 benchmarks/prefill_attention.py --cpu-smoke          # tiny shapes on the CPU
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
if "--cpu-smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from common import write_json  # noqa: E402  (benchmarks/common.py)

from zipfusion.analysis.synthetic import compressible_fraction, pages_with_fraction  # noqa: E402
from zipfusion.format import PageLayout, encode_pages_into, page_sizes  # noqa: E402
from zipfusion.kernels import paged_prefill_attention, plan_prefill  # noqa: E402
from zipfusion.kernels.prefill_attention import prefill_flops  # noqa: E402

GPU = dict(HQ=32, H=8, D=128, chunk=8192, starts=(0, 8192, 16384, 24576))
SMOKE = dict(HQ=8, H=2, D=64, chunk=8, starts=(0, 20))
SWEEP = dict(block_m=(64, 128), tile_pages=(2, 4, 8), num_warps=(4, 8), num_stages=(1, 2, 3))
KNOBS = tuple(SWEEP)
GATHER_TILE_PAGES = (1, 2, 4, 8)   # gather_kv's pages a program (the engine uses 1)


class Prompt:
    """One prompt's pages: a compressed arena and an open arena, page ids shuffled."""

    def __init__(self, tokens, H, D, fraction, device, seed=0):
        P = -(-tokens // 16)
        self.layout = PageLayout(H, D)
        pages = pages_with_fraction(P, H, D, fraction, seed=seed).to(device)
        self.fraction = compressible_fraction(pages[:64].cpu())
        perm = torch.randperm(P, generator=torch.Generator().manual_seed(seed)).to(device)
        sizes = page_sizes(pages)
        offsets = torch.cumsum(sizes, 0) - sizes
        self.arena_c = torch.empty(int(sizes.sum()), dtype=torch.uint8, device=device)
        encode_pages_into(pages, self.arena_c, offsets)
        self.loc_c = torch.empty(P, dtype=torch.int64, device=device)
        self.loc_c[perm] = offsets                                 # page id perm[i] = page i
        self.arena_o = pages.contiguous().view(-1).view(torch.uint8)
        self.loc_o = torch.empty_like(self.loc_c)
        self.loc_o[perm] = torch.arange(P, device=device) * self.layout.open_page_bytes | 1
        self.block_table = perm.to(torch.int32)[None, :]
        self.k = pages[:, 0].reshape(P * 16, H, D)                 # contiguous K/V for SDPA
        self.v = pages[:, 1].reshape(P * 16, H, D)
        self.ratio = int(sizes.sum()) / (P * self.layout.open_page_bytes)


class Case:
    """A chunk of n new tokens at ``start``: its inputs for the paged kernels and for SDPA."""

    def __init__(self, prompt: Prompt, HQ, start, n, device, seed=1):
        g = torch.Generator().manual_seed(seed + start)
        self.p, self.start, self.n = prompt, start, n
        self.q = torch.randn(n, HQ, prompt.layout.head_dim, generator=g).to(torch.bfloat16)
        self.q = self.q.to(device)
        self.indptr = torch.tensor([0, n], dtype=torch.int32, device=device)
        self.q_start = torch.tensor([start], dtype=torch.int32, device=device)
        self.out = torch.empty_like(self.q)
        self.flops = prefill_flops([0, n], [start], HQ, prompt.layout.head_dim)
        self.scale = prompt.layout.head_dim ** -0.5
        self.plans = {}

    def paged(self, fused: bool, **knobs):
        """A no-argument call of the fused (or twin) kernel with these knobs; plan made once."""
        block_m = knobs.pop("block_m", None)
        if block_m not in self.plans:
            self.plans[block_m] = plan_prefill([0, self.n], [self.start], self.q.shape[1],
                                               self.p.layout.num_kv_heads, block_m=block_m,
                                               device=self.q.device)
        plan = self.plans[block_m]
        arena, loc = (self.p.arena_c, self.p.loc_c) if fused else (self.p.arena_o, self.p.loc_o)
        return lambda: paged_prefill_attention(
            self.q, arena, loc, self.p.block_table, self.indptr, self.q_start, self.p.layout,
            self.scale, self.out, compressed=fused, plan=plan, validate=False, **knobs)

    def sdpa(self, backend):
        """SDPA over the contiguous prefix, K/V heads repeated (outside the timing)."""
        from torch.nn.attention import sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right
        F = torch.nn.functional
        G = self.q.shape[1] // self.p.layout.num_kv_heads
        L = self.start + self.n
        q = self.q.transpose(0, 1)[None]
        k = self.p.k[:L].repeat_interleave(G, 1).transpose(0, 1)[None].contiguous()
        v = self.p.v[:L].repeat_interleave(G, 1).transpose(0, 1)[None].contiguous()
        mask = None if self.start == 0 else causal_lower_right(self.n, L)

        def run():
            with sdpa_kernel([backend]):
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                   is_causal=mask is None, scale=self.scale)
            return o[0].transpose(0, 1)
        return run


    def engine(self, split: bool):
        """The engine's continuation routes over the contiguous prefix (K/V heads not repeated):
        one varlen FlashAttention call (bottom-right causal), or ``split_prefill`` (cuDNN over
        the prefix and over the chunk itself, merged by log-sum-exp)."""
        from zipfusion.attention.prefill_stored import _varlen_options, split_prefill
        L = self.start + self.n
        k, v = self.p.k[:L], self.p.v[:L]
        if split:
            return lambda: split_prefill(self.q, k, v, self.scale)
        attn, causal, gqa = _varlen_options()
        cu_q = torch.tensor([0, self.n], dtype=torch.int32, device=self.q.device)
        cu_k = torch.tensor([0, L], dtype=torch.int32, device=self.q.device)
        if not gqa:
            G = self.q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
        kw = {"enable_gqa": True} if gqa else {}
        return lambda: attn(self.q, k, v, cu_q, cu_k, self.n, L, scale=self.scale, **causal, **kw)


def seconds(fn, device) -> float:
    """Median seconds per call (do_bench on the GPU; one call on the CPU, a smoke test)."""
    if device.type == "cuda":
        import triton.testing
        fn()
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def measure(case: Case, device, knobs) -> list[dict]:
    """Fused, twin and the SDPA backends on one case; checks fused == twin bits and the error
    against SDPA."""
    from torch.nn.attention import SDPBackend
    recs, outs = [], {}
    kernels = {"fused": case.paged(True, **knobs), "twin": case.paged(False, **knobs)}
    backends = ([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                 SDPBackend.EFFICIENT_ATTENTION] if device.type == "cuda" else [SDPBackend.MATH])
    for b in backends:
        kernels["sdpa_" + b.name.lower().replace("_attention", "")] = case.sdpa(b)
    if device.type == "cuda" and case.start > 0:
        kernels["engine_varlen"] = case.engine(split=False)
        kernels["engine_split"] = case.engine(split=True)
    for name, fn in kernels.items():
        try:
            outs[name] = fn().clone()
            s = seconds(fn, device)
        except Exception as e:  # noqa: BLE001 - a backend that does not apply: say so, go on
            print(f"  {name}: not run ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
            continue
        recs.append(dict(kernel=name, start=case.start, new_tokens=case.n, ms=s * 1e3,
                         tflops=case.flops / s / 1e12, **(knobs if name in ("fused", "twin")
                                                         else {})))
    sdpa = next((outs[k] for k in outs if k.startswith("sdpa")), None)
    same = torch.equal(outs["fused"].view(torch.int16), outs["twin"].view(torch.int16))
    if case.start > 0:                            # the CPU's interpreter has one tile size
        recs += gathers(case, device, GATHER_TILE_PAGES if device.type == "cuda" else (1,))
    for r in recs:
        r.setdefault("fused_equals_twin", same)
        if sdpa is not None and r["kernel"] in outs:
            r["rel_err_vs_sdpa"] = rel(outs[r["kernel"]], sdpa)
    if not same:
        print("  WARNING: fused and twin outputs differ")
    return recs


def gathers(case: Case, device, tile_pages=GATHER_TILE_PAGES) -> list[dict]:
    """The engine's continuation route restores the request's pages into one contiguous K/V
    before dense attention (``gather_kv``, GatherPrefill): its cost over compressed pages against
    open ones is what a compressed mixed step adds. Both must give the same bits."""
    from zipfusion.kernels.prefill_attention import gather_kv
    p, L = case.p, case.start + case.n
    pages = p.block_table[0]
    recs = []
    for tp in tile_pages:
        got = {}
        for compressed in (True, False):
            arena, loc = (p.arena_c, p.loc_c) if compressed else (p.arena_o, p.loc_o)
            fn = functools.partial(gather_kv, arena, loc, pages, L, p.layout, compressed=compressed, tile_pages=tp)
            got[compressed] = fn()
            s = seconds(fn, device)
            written = 2 * L * p.layout.num_kv_heads * p.layout.head_dim * 2
            recs.append(dict(kernel="gather_" + ("compressed" if compressed else "open"), start=case.start,
                             new_tokens=case.n, ms=s * 1e3, tflops=float("nan"), gb_s=written / s / 1e9,
                             tile_pages=tp))
        same = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(got[True], got[False]))
        for r in recs[-2:]:
            r["fused_equals_twin"] = same
        if not same:
            print(f"  WARNING: gather over compressed and open pages differ (tile_pages {tp})")
    return recs


def sweep(case: Case, device, budget_s: float) -> list[dict]:
    """Every knob combination (fused and twin) on one case, until the time budget is spent."""
    recs, t0 = [], time.time()
    for values in itertools.product(*SWEEP.values()):
        knobs = dict(zip(KNOBS, values))
        for fused in (True, False):
            if time.time() - t0 > budget_s:
                print(f"  sweep stopped after {budget_s:.0f} s (--sweep-budget)")
                return recs
            name = "fused" if fused else "twin"
            try:
                s = seconds(case.paged(fused, **knobs), device)
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: record, go on
                recs.append(dict(kernel=name, error=f"{type(e).__name__}", **knobs))
                continue
            recs.append(dict(kernel=name, ms=s * 1e3, tflops=case.flops / s / 1e12, **knobs))
            print(f"  {name:5s} {knobs}: {s * 1e3:8.3f} ms {recs[-1]['tflops']:7.1f} TFLOP/s")
    return recs


def table(recs) -> str:
    rows = ["| start | new | kernel | ms | TFLOP/s | rel err vs SDPA |", "|---|---|---|---|---|---|"]
    for r in recs:
        rows.append(f"| {r['start']} | {r['new_tokens']} | {r['kernel']} | {r['ms']:.3f} | "
                    f"{r['tflops']:.1f} | {r.get('rel_err_vs_sdpa', float('nan')):.2e} |")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="folder for prefill_attention.json")
    ap.add_argument("--fraction", type=float, default=0.96, help="compressible block fraction")
    ap.add_argument("--sweep", action="store_true", help="sweep the knobs at the last start")
    ap.add_argument("--sweep-budget", type=float, default=360.0, help="seconds for the sweep")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU")
    for k in KNOBS:
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=None)
    a = ap.parse_args()
    shape = SMOKE if a.cpu_smoke else GPU
    device = torch.device("cpu" if a.cpu_smoke else "cuda")
    knobs = {k: getattr(a, k) for k in KNOBS if getattr(a, k) is not None}
    tokens = shape["starts"][-1] + shape["chunk"]
    prompt = Prompt(tokens, shape["H"], shape["D"], a.fraction, device)
    print(f"prompt {tokens} tokens, Hq={shape['HQ']} H={shape['H']} D={shape['D']}, "
          f"{prompt.fraction:.3f} of blocks compressible, stored {prompt.ratio:.3f} of open")
    recs = []
    for start in shape["starts"]:
        case = Case(prompt, shape["HQ"], start, shape["chunk"], device)
        recs += measure(case, device, knobs)
    print(table(recs))
    result = dict(info=dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
                            device=torch.cuda.get_device_name() if device.type == "cuda"
                            else "cpu (Triton interpreter)",
                            torch=torch.__version__, shape=shape,
                            compressible_fraction=prompt.fraction, stored_ratio=prompt.ratio,
                            knobs=knobs),
                  records=recs)
    if a.sweep:
        case = Case(prompt, shape["HQ"], shape["starts"][-1], shape["chunk"], device)
        result["sweep"] = sweep(case, device, a.sweep_budget)
        for name in ("fused", "twin"):
            ok = [r for r in result["sweep"] if r["kernel"] == name and "ms" in r]
            if ok:
                best = min(ok, key=lambda r: r["ms"])
                result[f"best_{name}"] = best
                print(f"best {name}: {({k: best[k] for k in KNOBS})} {best['ms']:.3f} ms "
                      f"{best['tflops']:.1f} TFLOP/s")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        write_json(result, os.path.join(a.out, "prefill_attention.json"))
        print("wrote", os.path.join(a.out, "prefill_attention.json"))


if __name__ == "__main__":
    main()
