"""Sealing one long prompt: ``KVCacheManager.compress_pages`` end to end at the Llama-8B shape.

A real manager (32 layers, 8 KV heads x 128, so 64 KiB open pages) gets the 512 pages of one 8K
prompt filled with synthetic KV of which ~96 % of the blocks compress
(``zipfusion.analysis.synthetic.pages_with_fraction``), then ``compress_pages`` compresses them
(16,384 pages: 1.07 GB of open pages read, ~0.82 GB of compressed pages written). Each
repetition frees the previous pages and fills fresh ones; the median is reported:

* ``total``    host clock from the call until the device has finished (``synchronize``), and
               the same span in CUDA events;
* ``analyze``  CUDA events around ``codec.analyze`` (offsets upload, analyze kernel), and the
               host time spent in it (it ends with the one sync: the sizes to the host);
* ``host``     host time of the call outside ``codec.analyze`` and ``codec.encode``:
               placement, bookkeeping, page_loc upload (the device idles during most of it);
* ``encode``   CUDA events around the ``codec.encode`` calls (one per wave);
* GB/s = (open bytes read + stored bytes written) / total.

``--batch-by-batch`` seals one batch of S pages per placement and encode launch (the structure
before waves), to measure what waves save. One repetition is checked: every layer's pages read
back equal to what was written, and two layers' stored bytes equal ``format.encode_pages_into``.

Prediction (not measured: written without GPU time), H200, 512 x 32 pages, 96 % compressible.
Before: ~13 ms (140 GB/s), the brief's measurement. Where it went, by reading the code: 16
batches of S = 32 pages each paid two blocking host->device copies (each a stream sync, so the
host waited for the previous batch's encode), two index gathers, a 7-launch torch prefix sum for
the record offsets, a Triton launch, a CUDA event with a query per chunk, and ~0.1-0.2 ms of
numpy placement: ~0.75 ms a batch, ~12 ms; plus the analysis (~0.25 ms kernel + two syncs).
After, each change and what it should save:

1. waves (manager.compress_pages / _wave): the 16 batches fit in the pool at once, so one
   vectorised placement and one encode launch: saves ~15 x (launch + torch ops + event) and
   15 idle gaps of the device, ~8-10 ms;
2. pinned asynchronous uploads of offsets / indices / destinations (memory.copy.to_device):
   no stream sync but the sizes' one; saves ~33 syncs, ~1 ms;
3. encode by index, record offsets in the kernel (compress_open_pages(index=)): no gathers and
   no torch prefix sum (9 launches per batch), ~0.3 ms before waves, ~30 us after;
4. vectorised next fit (packed._split / place): the placement of 16,384 pages measured 1.3 ms
   of host on the 2-core CPU box (device="meta"), expected ~0.4-0.6 ms on the GPU host.

Predicted after: analyze ~0.25 ms + sync ~0.03 + host ~0.5 + encode ~0.6 (the compress kernel
moved 3.4 TB/s read + written in benchmarks/results/codec_h200/codec.md: 1.89 GB -> 0.55 ms) = ~1.4 ms, so
~1.3 TB/s effective (goal >= 1 TB/s; the two-pass floor is (2 x 1.07 + 0.82) GB / 4.3 TB/s =
0.69 ms). ``--batch-by-batch`` should land near 3-4 ms (the structure before, minus changes
2-4). What then remains is the host placement between the sync and the encode launch.

    PYTHONPATH=src python benchmarks/seal.py --out benchmarks/results/seal_h200  # on a CUDA GPU
    PYTHONPATH=src python benchmarks/seal.py --layers 2 --heads 1 --head-dim 64 --pages 8 --reps 2
                                                                                # CPU smoke run

``--small 1,2,8,40,80``: the page store's seals instead (memory/page_store.py), a few pages at a
time from several fill streams as a decode step leaves them: the host time of ``analyze_pages``
(launched behind one step's sampling) and of ``place_pages`` (behind the next step's forward:
sizes read, placement, encode launch), the device idle (synchronized) before each, medians over
``--reps``; the first repetition of each size is profiled (cProfile: the functions with the most
own time, in the JSON). A decode-heavy run on an H100 paid ~0.8 ms a placement whatever its size
(benchmarks/results/seal_host_cpu): this says where it goes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

from zipfusion.analysis.synthetic import compressible_fraction, pages_with_fraction
from zipfusion.format import PageLayout, encode_pages_into
from zipfusion.format.layout import loc_is_compressed, loc_offset
from zipfusion.memory import KVCacheManager, codec

GB = 1e9


class Probe:
    """Times codec.analyze / codec.encode from inside compress_pages (host clock, and CUDA
    events on the GPU)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.analyze, self.encode = codec.analyze, codec.encode
        self.reset()

    def reset(self):
        self.calls = {"analyze": 0, "encode": 0}
        self.host = {"analyze": 0.0, "encode": 0.0}
        self.events = {"analyze": [], "encode": []}

    def _wrap(self, name, fn):
        def timed(*args, **kwargs):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            self.host[name] += time.perf_counter() - t
            self.calls[name] += 1
            if self.cuda:
                b.record()
                self.events[name].append((a, b))
            return out
        return timed

    def __enter__(self):
        codec.analyze, codec.encode = self._wrap("analyze", self.analyze), self._wrap("encode", self.encode)
        return self

    def __exit__(self, *exc):
        codec.analyze, codec.encode = self.analyze, self.encode

    def device_ms(self, name) -> float:
        return sum(a.elapsed_time(b) for a, b in self.events[name])


def fill(m: KVCacheManager, ids: list[int], pool: torch.Tensor) -> dict:
    """Write pool pages (rolled per layer) into the open pages ``ids`` of every layer; returns
    {layer: pages written} for the layers the check reads back."""
    n, open_bytes = len(ids), m.layout.open_page_bytes
    rows = m.arena.view(-1, open_bytes)
    src = pool.view(pool.shape[0], -1).view(torch.uint8)
    written = {}
    for layer in range(m.num_layers):
        pick = (torch.arange(n) + 7 * layer) % pool.shape[0]
        loc = torch.from_numpy(loc_offset(m.table.loc[layer, ids]) // open_bytes)
        rows[loc.to(m.device)] = src[pick.to(m.device)]
        written[layer] = pick
    return written


def check(m: KVCacheManager, ids: list[int], pool: torch.Tensor, written: dict) -> str:
    for layer, pick in written.items():
        got = m.read_pages(layer, ids)
        assert torch.equal(got.view(torch.int16), pool[pick.to(pool.device)].view(torch.int16)), \
            f"layer {layer}: pages read back differ from those written"
    for layer in {0, m.num_layers - 1}:
        loc = m.table.loc[layer, ids]
        comp = loc_is_compressed(loc)
        off = torch.from_numpy(loc[comp])
        pages = pool[written[layer].to(pool.device)][torch.from_numpy(np.nonzero(comp)[0]).to(pool.device)]
        ref = torch.zeros_like(m.arena)
        encode_pages_into(pages.contiguous(), ref, off.to(m.device))
        sizes = m.table.size[layer, np.array(ids)[comp]]
        for o, s in zip(off.tolist(), sizes.tolist()):
            assert torch.equal(m.arena[o:o + s], ref[o:o + s]), f"layer {layer}: stored bytes differ at {o}"
    return "every layer's pages read back; layers 0 and L-1 byte-identical to encode_pages_into"


def run(args, batch_by_batch: bool) -> dict:
    cuda = torch.cuda.is_available() and not args.cpu
    device = "cuda" if cuda else "cpu"
    layout = PageLayout(args.heads, args.head_dim)
    L, n = args.layers, args.pages
    open_total = L * n * layout.open_page_bytes
    chunk = args.chunk_pages * layout.open_page_bytes
    m = KVCacheManager(L, layout, int(open_total * 2.2) + 4 * L * chunk, device=device, chunk_bytes=chunk)
    pool = pages_with_fraction(min(n, args.pool), args.heads, args.head_dim, args.fraction, seed=0).to(device)
    saved = KVCacheManager._wave, KVCacheManager._place_streams
    if batch_by_batch:           # stream by stream (not all at once), one batch of S pages a wave
        KVCacheManager._place_streams = lambda self, *a: False
        KVCacheManager._wave = lambda self, stored: (min(self.slots_per_chunk, stored.shape[1]), None)
    rows, ids, checked = [], [], None
    try:
        with Probe(cuda) as probe:
            for rep in range(args.reps + 1):               # repetition 0: warm-up (kernel builds)
                if ids:
                    m.free_pages(ids)
                ids = m.alloc_pages(n)
                written = fill(m, ids, pool)
                if cuda:
                    torch.cuda.synchronize()
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                probe.reset()
                t = time.perf_counter()
                left = m.compress_pages(ids)
                if cuda:
                    b.record()
                    torch.cuda.synchronize()
                wall = time.perf_counter() - t
                assert not left, f"{len(left)} pages left open: raise the budget"
                stored = int(m.table.size[:, ids].sum())
                in_codec = probe.host["analyze"] + probe.host["encode"]
                row = {"total_ms": wall * 1e3, "host_ms": (wall - in_codec) * 1e3,
                       "analyze_host_ms": probe.host["analyze"] * 1e3,
                       "encode_host_ms": probe.host["encode"] * 1e3, "stored_bytes": stored,
                       "encode_calls": probe.calls["encode"]}
                if cuda:
                    row.update(total_device_ms=a.elapsed_time(b), analyze_ms=probe.device_ms("analyze"),
                               encode_ms=probe.device_ms("encode"))
                if rep == 1:
                    checked = check(m, ids, pool, {l: written[l] for l in range(L)})
                if rep:
                    rows.append(row)
    finally:
        KVCacheManager._wave, KVCacheManager._place_streams = saved
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    med["GBps"] = (open_total + med["stored_bytes"]) / GB / (med["total_ms"] / 1e3)
    return {"mode": "batch by batch" if batch_by_batch else "waves", "median": med, "reps": rows,
            "open_bytes": open_total, "checked": checked, "slots_per_chunk": m.slots_per_chunk,
            "compressible_fraction": compressible_fraction(pool.cpu())}


def _timed(fn, prof):
    """(fn(), its host seconds), the profiler ``prof`` (or None) on around the call alone."""
    if prof:
        prof.enable()
    t = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t
    if prof:
        prof.disable()
    return out, seconds


def run_small(args) -> dict:
    """The page store's seals of ``n`` pages (each of ``--small``): analysis then placement."""
    import cProfile
    import io
    import pstats
    cuda = torch.cuda.is_available() and not args.cpu
    device = "cuda" if cuda else "cpu"
    layout = PageLayout(args.heads, args.head_dim)
    L, sizes = args.layers, [int(x) for x in args.small.split(",")]
    chunk = args.chunk_pages * layout.open_page_bytes
    m = KVCacheManager(L, layout, 4 * max(sizes) * L * layout.open_page_bytes + 8 * L * chunk, device=device,
                       chunk_bytes=chunk)
    pool = pages_with_fraction(args.pool, args.heads, args.head_dim, args.fraction, seed=0).to(device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = []
    for n in sizes:
        reps, profile, held = [], None, []
        for rep in range(args.reps + 2):                 # 0: warm-up, 1: profiled, the rest timed
            ids = m.alloc_pages(n)
            fill(m, ids, pool)
            m.set_streams(ids, [i % 8 for i in range(n)])   # a decode step's pages: ~8 fill streams
            sync()
            prof = cProfile.Profile() if rep == 1 else None
            job, analyze_s = _timed(lambda: m.analyze_pages(ids), prof)
            sync()                                       # a step later: the analysis has run
            left, place_s = _timed(lambda: m.place_pages(job), prof)
            if prof:
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.profile_top)
                profile = text.getvalue()
            assert not left, f"{len(left)} pages left open: raise the budget"
            held += ids
            if len(held) > 2 * max(sizes):               # free the oldest: chunks empty and come back
                m.free_pages(held[:n])
                held = held[n:]
            if rep >= 2:
                reps.append({"analyze_host_ms": analyze_s * 1e3, "place_host_ms": place_s * 1e3})
        m.free_pages(held)
        med = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
        out.append({"pages": n, "median": med, "reps": reps, "profile": profile})
        print(f"seal of {n:4d} pages: analyze {med['analyze_host_ms']:.3f} ms, place {med['place_host_ms']:.3f} ms "
              "of host (median)", flush=True)
    return {"mode": "small", "rows": out, "slots_per_chunk": m.slots_per_chunk}


def table(result) -> str:
    lines = [f"seal {result['pages']} pages x {result['layers']} layers (H={result['heads']}, "
             f"D={result['head_dim']}), {result['env']['device']}",
             "| mode | total ms | GB/s | analyze ms | host ms | encode ms | encode calls |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        md = r["median"]
        f = lambda k: f"{md[k]:.3f}" if k in md else "-"        # noqa: E731
        lines.append(f"| {r['mode']} | {md['total_ms']:.3f} | {md['GBps']:.0f} | {f('analyze_ms')} | "
                     f"{md['host_ms']:.3f} | {f('encode_ms')} | {md['encode_calls']:.0f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--pages", type=int, default=512, help="pages of the prompt (8K tokens: 512)")
    ap.add_argument("--pool", type=int, default=512, help="distinct synthetic pages")
    ap.add_argument("--chunk-pages", type=int, default=32,
                    help="open pages per chunk, S (32: the engine's 2 MiB chunks at this shape)")
    ap.add_argument("--fraction", type=float, default=0.96, help="compressible block fraction")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--modes", default="waves,batch-by-batch")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU even with a GPU")
    ap.add_argument("--out", default=None, help="folder for seal.json")
    ap.add_argument("--small", default=None,
                    help="comma-separated page counts: the page store's small seals' host time instead (seal_small.json)")
    ap.add_argument("--profile-top", type=int, default=25, help="functions kept of each --small profile")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu
    import triton
    env = {"device": torch.cuda.get_device_name() if cuda else "CPU (torch reference codec)",
           "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "command": "PYTHONPATH=src python benchmarks/seal.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    if args.small:
        result = {"env": env, "layers": args.layers, "heads": args.heads, "head_dim": args.head_dim,
                  "fraction": args.fraction, "reps": args.reps, **run_small(args)}
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "seal_small.json"), "w") as f:
                json.dump(result, f, indent=1)
        return result
    result = {"env": env, "layers": args.layers, "heads": args.heads, "head_dim": args.head_dim,
              "pages": args.pages, "fraction": args.fraction, "reps": args.reps, "rows": []}
    for mode in args.modes.split(","):
        result["rows"].append(run(args, batch_by_batch=mode == "batch-by-batch"))
        if cuda:
            torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "seal.json"), "w") as f:
            json.dump(result, f, indent=1)
    print(table(result))
    return result


if __name__ == "__main__":
    main()
