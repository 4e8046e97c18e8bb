"""Throughput of the Triton page codec (analyze, compress, decompress) on GBs of open KV pages.

Fills an arena with open pages of Llama-3.1-8B shape (8 KV heads x 128) -- a pool of distinct
synthetic pages repeated to the requested size -- and times, with triton.testing.do_bench
(medians, L2 flushed between runs):

* analyze     analyze_open_pages over all pages (reads every page once);
* compress    compress_open_pages (reads every page again, writes the compressed pages);
* a+c         analyze, destinations by a device-side prefix sum, compress: what compressing
              a batch of full pages costs end to end (no host sync);
* decompress  decompress_pages into a [P, 2, 16, H, D] bf16 tensor.

Rates are GB/s (1e9 bytes) of original BF16 pages. Every configuration is checked in the same
run against the torch reference: metadata and sizes of every page, the compressed bytes of
every page, and the decompressed pages. Also measured: a plain device-to-device copy of the
same bytes (the bandwidth ceiling).

    PYTHONPATH=src python benchmarks/codec.py --out benchmarks/results/codec_h200  # on a CUDA GPU
    PYTHONPATH=src python benchmarks/codec.py --check-only --gib 0.001     # CPU smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch

from zipfusion.analysis.synthetic import (compressible_fraction, model_like_pages,
                                          pages_with_fraction, realistic_pages)
from zipfusion.format import PageLayout, analyze_pages, encode_pages_into, page_sizes
from zipfusion.format import triton_codec as tc

GB = 1e9


def make_pool(dataset: str, n: int, H: int, D: int) -> torch.Tensor:
    """``realistic``; ``model`` (a trained model's outlier statistics: format v2 compresses
    every block, v1 leaves ~8 % raw); or a compressible fraction (outlier blocks raw in both)."""
    if dataset == "realistic":
        return realistic_pages(n, H, D, seed=0)
    if dataset == "model":
        return model_like_pages(n, H, D, seed=0)
    return pages_with_fraction(n, H, D, float(dataset), seed=0)


class Bench:
    """One arena with P open pages (the pool repeated) followed by room for the compressed ones."""

    def __init__(self, pool: torch.Tensor, num_pages: int, device: str):
        n, _, _, H, D = pool.shape
        assert num_pages % n == 0
        self.layout = L = PageLayout(H, D)
        self.P, self.n = num_pages, n
        self.src_bytes = num_pages * L.open_page_bytes
        self.arena = torch.empty(self.src_bytes + num_pages * L.max_page_bytes + 4096,
                                 dtype=torch.uint8, device=device)
        pool_bytes = pool.to(device).contiguous().view(-1).view(torch.uint8)
        self.arena[:self.src_bytes].view(num_pages // n, -1).copy_(pool_bytes.expand(num_pages // n, -1))
        self.src = torch.arange(num_pages, dtype=torch.int64, device=device) * L.open_page_bytes
        # reference, computed on the pool: metadata, sizes, the pool's compressed bytes laid out
        # back to back (the compressed region of the arena is that, repeated)
        pool_d = pool.to(device)
        self.ref_base_half = analyze_pages(pool_d).flatten(1).to(torch.uint8)
        self.ref_sizes = page_sizes(pool_d)
        pool_dst = torch.cumsum(self.ref_sizes, 0) - self.ref_sizes
        self.pool_total = int(self.ref_sizes.sum())
        self.ref_bytes = torch.zeros(self.pool_total, dtype=torch.uint8, device=device)
        encode_pages_into(pool_d, self.ref_bytes, pool_dst)
        sizes = self.ref_sizes.repeat(num_pages // n)
        self.compressed_bytes = int(sizes.sum())
        self.dst = self.src_bytes + torch.cumsum(sizes, 0) - sizes
        self.fraction = compressible_fraction(pool)
        self.fraction_v1 = compressible_fraction(pool, version=1)
        self.ratio_v1 = float(page_sizes(pool_d, version=1).sum()) / float(self.ref_sizes.sum())
        self.out = torch.empty((num_pages, 2, 16, H, D), dtype=torch.bfloat16, device=device)

    # -- the operations timed ------------------------------------------------------------------
    def analyze(self, src=None):
        return tc.analyze_open_pages(self.arena, self.src if src is None else src, self.layout,
                                     validate=False)

    def compress(self, base_half):
        tc.compress_open_pages(self.arena, self.src, base_half, self.dst, self.layout, validate=False)

    def analyze_compress(self, validate=False):
        base_half, sizes = tc.analyze_open_pages(self.arena, self.src, self.layout, validate=validate)
        dst = self.src_bytes + torch.cumsum(sizes, 0) - sizes
        tc.compress_open_pages(self.arena, self.src, base_half, dst, self.layout, validate=validate)

    def decompress(self):
        return tc.decompress_pages(self.arena, self.dst, self.layout, out=self.out, validate=False)

    # -- checks ---------------------------------------------------------------------------------
    def clear_compressed(self):
        self.arena[self.src_bytes:].fill_(0xAB)

    def check_analysis(self, base_half, sizes):
        reps = self.P // self.n
        assert torch.equal(base_half.view(reps, self.n, -1), self.ref_base_half.expand(reps, -1, -1)), \
            "analyze: metadata bytes differ from the reference"
        assert torch.equal(sizes.view(reps, self.n), self.ref_sizes.expand(reps, -1)), \
            "analyze: sizes differ from the reference"

    def check_compressed(self):
        reps = self.P // self.n
        region = self.arena[self.src_bytes:self.src_bytes + reps * self.pool_total].view(reps, -1)
        assert bool((region == self.ref_bytes).all()), "compress: bytes differ from the reference"
        assert bool((self.arena[self.src_bytes + reps * self.pool_total:] == 0xAB).all()), \
            "compress: wrote past the compressed pages"

    def check_round_trip(self):
        """Analyze, compress and decompress the whole arena, each checked against the reference;
        returns the analysis (base_half, sizes)."""
        self.clear_compressed()
        base_half, sizes = self.analyze()
        self.check_analysis(base_half, sizes)
        self.compress(base_half)
        self.check_compressed()
        self.out.fill_(float("nan"))
        self.decompress()
        self.check_decompressed()
        return base_half, sizes

    def check_decompressed(self):
        assert torch.equal(self.out.view(-1).view(torch.uint8), self.arena[:self.src_bytes]), \
            "decompress: pages differ from the originals"


def timer(device: str, warmup_ms: int, rep_ms: int):
    if device == "cuda":
        import triton.testing

        def median_ms(fn):
            return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    else:
        def median_ms(fn):            # CPU smoke run: one wall-clock call, not a measurement
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
    return median_ms


def tune(b: Bench, median_ms, warps):
    """Time every kernel at each num_warps, each configuration checked first; set the fastest
    as the module defaults. Returns the table."""
    table = {}
    for w in warps:
        tc.NUM_WARPS.update(analyze=w, compress=w, decompress=w)
        bh, sz = b.check_round_trip()
        table[f"analyze, {w} warps"] = ("analyze", {"warps": w}, median_ms(b.analyze))
        table[f"compress, {w} warps"] = ("compress", {"warps": w}, median_ms(lambda: b.compress(bh)))
        table[f"decompress, {w} warps"] = ("decompress", {"warps": w}, median_ms(b.decompress))
    best = {}
    for kernel, cfg, t in table.values():
        if kernel not in best or t < best[kernel][1]:
            best[kernel] = (cfg, t)
    for kernel, (cfg, _) in best.items():
        tc.NUM_WARPS[kernel] = cfg["warps"]
    return {name: t for name, (_, _, t) in table.items()}


def run_dataset(dataset, args, device, median_ms, b=None):
    if b is None:
        b = Bench(make_pool(dataset, args.pool, args.heads, args.head_dim), args.pages, device)
    row = {"dataset": dataset, "compressible_fraction": b.fraction, "pages": b.P,
           "original_bytes": b.src_bytes, "compressed_bytes": b.compressed_bytes,
           "ratio": b.src_bytes / b.compressed_bytes, "stored_ratio": b.compressed_bytes / b.src_bytes,
           "v1": {"compressible_fraction": b.fraction_v1,
                  "stored_ratio": b.compressed_bytes * b.ratio_v1 / b.src_bytes}}

    # correctness of the whole arena, then timings
    base_half, sizes = b.check_round_trip()
    b.clear_compressed()
    b.analyze_compress()
    b.check_compressed()
    row["checked"] = "metadata, sizes, compressed bytes and decompressed values of every page"

    ms = {}
    ms["analyze"] = median_ms(b.analyze)
    ms["compress"] = median_ms(lambda: b.compress(base_half))
    ms["analyze+compress"] = median_ms(b.analyze_compress)
    ms["decompress"] = median_ms(b.decompress)
    if dataset == "realistic":
        ms["analyze+compress (validate=True)"] = median_ms(lambda: b.analyze_compress(validate=True))
        out_bytes = b.out.view(-1).view(torch.uint8)
        ms["copy (same bytes, device to device)"] = median_ms(lambda: out_bytes.copy_(b.arena[:b.src_bytes]))
    row["median_ms"] = ms
    row["GBps_original"] = {k: b.src_bytes / GB / (v / 1e3) for k, v in ms.items()}
    moved = {"analyze": b.src_bytes, "compress": b.src_bytes + b.compressed_bytes,
             "decompress": b.compressed_bytes + b.src_bytes,
             "copy (same bytes, device to device)": 2 * b.src_bytes}
    row["GBps_moved"] = {k: moved[k] / GB / (ms[k] / 1e3) for k in moved if k in ms}
    return row


def markdown(result) -> str:
    env = result["env"]
    lines = [
        "## Codec kernels (analyze / compress / decompress)", "",
        f"- device: {env['device']}; torch {env['torch']}, triton {env['triton']}, python {env['python']}",
        f"- date: {env['date']}",
        f"- command: `{env['command']}`",
        f"- data: {result['pages']} open pages of {result['heads']} KV heads x {result['head_dim']} "
        f"({result['original_GB']:.2f} GB of BF16), a pool of {result['pool']} distinct synthetic "
        "pages repeated; medians of triton.testing.do_bench (L2 flushed between runs), validate=False "
        "unless stated; every page's metadata, compressed bytes and decompressed values were "
        "checked against the torch reference in the same run.",
        "- GB/s = original BF16 bytes / time.", "",
    ]
    ops = ["analyze", "compress", "analyze+compress", "decompress"]
    header = ("| data | compressible blocks v2 (v1) | stored/raw v2 (v1) | ratio | "
              + " | ".join(ops) + " |")
    lines += [header, "|" + " --- |" * (4 + len(ops))]
    for r in result["rows"]:
        cells = []
        for k in ops:
            if k in r["median_ms"]:
                cells.append(f"{r['GBps_original'][k]:.0f} GB/s ({r['median_ms'][k]:.2f} ms)")
            else:
                cells.append("-")
        name = r["dataset"] if r["dataset"] in ("realistic", "model") \
            else f"{float(r['dataset']):.0%} compressible"
        v1 = r.get("v1", {})
        lines.append(f"| {name} | {r['compressible_fraction']:.1%} ({v1.get('compressible_fraction', float('nan')):.1%}) "
                     f"| {r.get('stored_ratio', float('nan')):.4f} ({v1.get('stored_ratio', float('nan')):.4f}) "
                     f"| {r['ratio']:.3f} | " + " | ".join(cells) + " |")
    real = next((r for r in result["rows"] if r["dataset"] == "realistic"), None)
    if real:
        lines.append("")
        for k in ("copy (same bytes, device to device)", "analyze+compress (validate=True)"):
            if k in real["median_ms"]:
                lines.append(f"- {k}: {real['median_ms'][k]:.2f} ms")
        for k, v in real.get("GBps_moved", {}).items():
            lines.append(f"- bytes moved by {k} (read + written) / time: {v:.0f} GB/s")
    if result.get("tuning_ms"):
        lines.append(f"- configuration used above (fastest in this run's sweep on the realistic data): "
                     f"num_warps {result['config']['num_warps']}")
        lines.append("- sweep (realistic, ms): " + "; ".join(f"{k} {v:.2f}" for k, v in result["tuning_ms"].items()))
    return "\n".join(lines) + "\n"


def plot(result, path):
    from common import pyplot
    plt = pyplot()
    if plt is None:
        return
    rows = result["rows"]
    keys = ["analyze", "compress", "analyze+compress", "decompress"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(keys)
    for i, k in enumerate(keys):
        xs = [j + i * width for j in range(len(rows))]
        ax.bar(xs, [r["GBps_original"].get(k, 0) for r in rows], width, label=k)
    ax.axhline(2000, color="k", ls="--", lw=1, label="goal: compression 2 TB/s")
    copy = next((r["GBps_original"][k] for r in rows for k in r["GBps_original"] if k.startswith("copy")), None)
    if copy:
        ax.axhline(copy, color="gray", ls=":", lw=1, label="plain copy of the pages")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
    ax.set_xticklabels([f"{r['dataset']}\n({r['compressible_fraction']:.0%} blocks)" for r in rows])
    ax.set_ylabel("GB/s of original BF16")
    ax.set_title(f"zipfusion codec, {result['original_GB']:.1f} GB of pages, {result['env']['device']}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=8.0, help="GiB of open pages (default 8)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--pool", type=int, default=1024, help="distinct pages, repeated")
    ap.add_argument("--datasets", default="realistic,model,1.0,0.8,0.5")
    ap.add_argument("--warps", default="2,4", help="num_warps values to sweep (first dataset)")
    ap.add_argument("--warmup-ms", type=int, default=50)
    ap.add_argument("--rep-ms", type=int, default=300)
    ap.add_argument("--check-only", action="store_true", help="CPU smoke run (Triton interpreter)")
    ap.add_argument("--out", default=None, help="folder for codec.json / codec.md / codec.png")
    args = ap.parse_args()

    device = "cuda" if torch.cuda.is_available() and not args.check_only else "cpu"
    if device == "cpu" and not args.check_only:
        sys.exit("no CUDA GPU: run with --check-only for a CPU smoke run")
    layout = PageLayout(args.heads, args.head_dim)
    args.pool = max(1, min(args.pool, int(args.gib * 2**30 // layout.open_page_bytes)))
    args.pages = max(1, int(args.gib * 2**30 // layout.open_page_bytes)) // args.pool * args.pool
    warps = [int(w) for w in args.warps.split(",") if w] if device == "cuda" else []
    median_ms = timer(device, args.warmup_ms, args.rep_ms)

    import triton
    env = {"device": torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter)",
           "torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version(),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "command": "PYTHONPATH=src python benchmarks/codec.py " + " ".join(sys.argv[1:])}
    result = {"env": env, "pages": args.pages, "heads": args.heads, "head_dim": args.head_dim,
              "pool": args.pool, "original_GB": args.pages * layout.open_page_bytes / GB, "rows": []}
    datasets = args.datasets.split(",")
    first = Bench(make_pool(datasets[0], args.pool, args.heads, args.head_dim), args.pages, device)
    if device == "cuda" and warps:
        t = time.time()
        result["tuning_ms"] = tune(first, median_ms, warps)
        print(f"[tuning on {datasets[0]}] {time.time() - t:.1f} s", flush=True)
    result["config"] = {"num_warps": dict(tc.NUM_WARPS)}
    for i, ds in enumerate(datasets):
        t = time.time()
        row = run_dataset(ds, args, device, median_ms, first if i == 0 else None)
        first = None
        result["rows"].append(row)
        if device == "cuda":
            torch.cuda.empty_cache()      # the dataset's arena is gone with run_dataset's frame
        print(f"[{ds}] done in {time.time() - t:.1f} s: "
              + ", ".join(f"{k} {v:.0f}" for k, v in row["GBps_original"].items()), flush=True)
    md = markdown(result)
    print(md)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "codec.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(args.out, "codec.md"), "w") as f:
            f.write(md)
        try:
            plot(result, os.path.join(args.out, "codec.png"))
        except ImportError as e:
            print(f"no plot: {e}")


if __name__ == "__main__":
    main()
