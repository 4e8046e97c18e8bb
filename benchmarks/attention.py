#!/usr/bin/env python3
"""Decode-attention benchmark: FlashInfer vs our uncompressed, fused and unfused kernels (GPU only).

"uncompressed" (over open pages; once called the twin) and "fused" are the CUDA C++ kernels
(zipfusion/kernels/cuda/decode_attention.cu);
"uncompressed_triton" and "fused_triton" are the Triton kernels (the CPU-checkable reference), timed
with --triton.

Llama-3.1-8B attention (32 query heads, 8 KV heads, head_dim 128), page size 16, KV data with
an exact fraction of compressible blocks (zipfusion.analysis.synthetic.pages_with_fraction;
outlier blocks raw in format v1 and v2), and at "0.92" the real model's outlier statistics
(model_like_pages: v1 compresses ~92 % of blocks, v2 all of them, ~8 % with escapes). Records
carry the stored/raw ratio under v2 and v1 and the v1 fraction side by side.
Every request's pages are scattered (random page ids); all full pages are compressed for the
fused and unfused kernels; the uncompressed kernel and FlashInfer read the same values from open pages.
Inputs are rotated over several copies so that no timed call finds its data in L2. Each
kernel is timed as a CUDA graph of many calls (median over replays). The core (pools, cases,
timing, FlashInfer) is zipfusion.bench.kernel's, which `zipfusion bench kernel` runs for users;
this script adds the development variants: the unfused baseline, tuning, the diagnostic plots.

    python3 benchmarks/attention.py --quick            # batch 32, 8K, fractions 1.0/0.92/0.8/0.5/0.0
    python3 benchmarks/attention.py --tune             # CUDA kernel variants at batch 32, 8K
    python3 benchmarks/attention.py --full --out DIR   # the whole sweep -> DIR/attention.{json,md,png}
    python3 benchmarks/attention.py --quick --define ZF_ESC_KIND   # a build variant of the CUDA kernel
    python3 benchmarks/attention.py --quick --diag copy            # a diagnostic build (wrong outputs)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from common import pyplot  # noqa: E402  (benchmarks/common.py)

from zipfusion.bench import kernel as core  # noqa: E402  (zipfusion bench kernel: the shared core)
from zipfusion.kernels.cuda_attention import set_build_defines  # noqa: E402
from zipfusion.bench.kernel import (REAL_MODEL_FRACTION, FlashInfer, Pool, copy_bandwidth, fmt,  # noqa: E402
                                    summary, time_calls)

from unfused import decode_attention_unfused, plan_unfused  # noqa: E402  (benchmarks/unfused.py)

TUNABLE = ("stages", "num_splits", "tma", "producer")   # knobs of the CUDA kernel
# name -> (Case method, fixed keyword arguments, traffic): the package's kernels and the unfused baseline
KERNELS = {**core.KERNELS, "unfused": ("run_unfused", {}, "unfused")}
DEV = torch.device("cuda")
# diagnostic builds of the producer kernel, for timing only: their outputs are WRONG. "copy" moves
# the compressed pages but never reads them (the memory side alone), "compute" restores and
# multiplies stale slots without moving a byte (the instructions alone); see the kernel source.
DIAG_DEFINES = {"copy": "ZF_DIAG_COPY_ONLY", "compute": "ZF_DIAG_COMPUTE_ONLY"}


class Case(core.Case):
    """The package's case (open caches and compressed arenas) with the unfused baseline:
    decompress every page (Triton), then the uncompressed kernel over the result."""
    plan = None

    def run_unfused(self, i, **kw):
        if self.plan is None:
            self.plan = plan_unfused(self.arena_c[0], self.loc_c, self.layout)
        return decode_attention_unfused(self.q, self.arena_c[i % self.sets], self.loc_c,
                                        self.bt, self.lens, self.layout, self.shape.d ** -0.5, self.out,
                                        plan=self.plan, validate=False, **kw)


def measure_case(case: Case, fi: FlashInfer | None, kernels, cfg, ceiling):
    return core.measure_case(case, fi, kernels, cfg, ceiling, table=KERNELS)


def main():
    ap = argparse.ArgumentParser()
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--quick", action="store_true")
    mode.add_argument("--tune", action="store_true")
    mode.add_argument("--full", action="store_true")
    mode.add_argument("--plot-tune", metavar="JSON",
                      help="draw an attention_tune.json (from --tune) beside it as a PNG")
    mode.add_argument("--plot-diag", metavar="DIR",
                      help="draw DIR/diag/{full,copy,compute} (--quick without --diag, with --diag copy, "
                           "compute) and DIR/splits/{full,copy}_S* as DIR/diag.png")
    mode.add_argument("--auto", action="store_true",
                      help="tune at batch 32 / 8K, pick the fastest fused config, then --full")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--stages", type=int, default=None)
    ap.add_argument("--num-splits", type=int, default=None)
    ap.add_argument("--tma", type=int, choices=[0, 1], default=None)
    ap.add_argument("--producer", type=int, choices=[0, 1], default=None,
                    help="1: the producer-warp kernel (fused and uncompressed), 0: per-warp copies")
    ap.add_argument("--triton", action="store_true", help="also time the Triton kernels")
    ap.add_argument("--define", action="append", default=[], metavar="NAME[=VALUE]",
                    help="build the CUDA kernel with this define (repeatable), e.g. ZF_ESC_KIND: the "
                         "COMPRESSED_ESC page kind (see kernels/cuda/decode_attention.cu)")
    ap.add_argument("--diag", choices=sorted(DIAG_DEFINES),
                    help="time a diagnostic build of the producer kernel (WRONG outputs): copy, its copies "
                         "alone; compute, its instructions alone")
    ap.add_argument("--fractions", default=None,
                    help="compressible fractions of --quick / --tune (default 1,0.92,0.8,0.5,0)")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--contexts", default="2048,8192,32768")
    args = ap.parse_args()
    if args.plot_tune:
        with open(args.plot_tune) as fh:
            plot_tune(json.load(fh), os.path.splitext(args.plot_tune)[0] + ".png")
        return
    if args.plot_diag:
        plot_diag(args.plot_diag)
        return
    defines = args.define + ([DIAG_DEFINES[args.diag]] if args.diag else [])
    if args.diag:
        warnings.warn(f"--diag {args.diag}: the CUDA decode attention kernel is a diagnostic build that gives "
                      "wrong outputs (for timing only)")
    set_build_defines(*defines)
    cfg = dict(stages=args.stages, num_splits=args.num_splits)
    if args.tma is not None:
        cfg["tma"] = bool(args.tma)
    if args.producer is not None:
        cfg["producer"] = bool(args.producer)
    kernels = ["uncompressed", "fused", "unfused"] + (["uncompressed_triton", "fused_triton"] if args.triton else [])
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]

    t_start = time.time()
    props = torch.cuda.get_device_properties(0)
    import triton
    info = dict(device=torch.cuda.get_device_name(0), sms=props.multi_processor_count,
                torch=torch.__version__, triton=triton.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command="python3 " + " ".join(sys.argv), build_defines=defines)
    ceiling = copy_bandwidth(DEV)
    info["copy_ceiling_GBps"] = ceiling / 1e9
    print(f"{info['device']} torch {info['torch']} triton {info['triton']} "
          f"copy ceiling {ceiling / 1e9:.0f} GB/s (read+write)")
    fi = None
    if not args.no_flashinfer:
        t0 = time.time()
        fi = FlashInfer(DEV)
        info["flashinfer"] = fi.version
        print(f"flashinfer {fi.version} import {time.time() - t0:.1f}s")

    fractions = [1.0, REAL_MODEL_FRACTION, 0.8, 0.5, 0.0]
    if args.fractions:
        fractions = [float(x) for x in args.fractions.split(",")]
    pools = {f: Pool(f, seed=int(f * 100) + 1, device=DEV) for f in fractions}
    records = []
    if args.tune or args.auto:
        tune_recs = []
        for f in ([1.0, 0.0] if args.auto else fractions):
            case = Case(pools[f], 32, 8192, seed=1)
            recs = tune_case(case, fi, ceiling)
            for r in recs:
                r["compressible_fraction"] = pools[f].fraction
                r["compressible_fraction_nominal"] = f
            print(fmt(recs), flush=True)
            tune_recs += recs
            del case
            torch.cuda.empty_cache()
        best = min((r for r in tune_recs if r["kernel"] == "fused"
                    and r["compressible_fraction_nominal"] == 1.0), key=lambda r: r["median_ms"])
        cfg = {k: v for k, v in json.loads(best["variant"]).items() if k in TUNABLE}
        info["chosen_config"] = cfg
        print("chosen config", cfg, flush=True)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "attention_tune.json"), "w") as fh:
            json.dump(tune_recs, fh, indent=1)
        plot_tune(tune_recs, os.path.join(args.out, "attention_tune.png"))
    if args.full or args.auto:
        cases = [(f, B, c) for f in (1.0, REAL_MODEL_FRACTION, 0.8, 0.5) for B in batches for c in contexts]
        cases += [(0.0, 32, c) for c in contexts]
    elif args.quick:
        cases = [(f, 32, 8192) for f in fractions]
    else:
        cases = []
    for f, B, ctx in cases:
        case = Case(pools[f], B, ctx, seed=B * 7 + ctx)
        recs = measure_case(case, fi, kernels, cfg, ceiling)
        for r in recs:
            r["compressible_fraction"] = pools[f].fraction
            r["compressible_fraction_nominal"] = f
            r.update(pools[f].formats)
            if r["kernel"] != "flashinfer":
                r["config"] = json.dumps(cfg)
        print(fmt(recs), flush=True)
        records += recs
        del case
        torch.cuda.empty_cache()
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "attention_partial.json"), "w") as fh:
            json.dump(records, fh)
    info["seconds"] = time.time() - t_start
    os.makedirs(args.out, exist_ok=True)
    full = args.full or args.auto
    name = "attention" if full else ("attention_tune" if args.tune else "attention_quick")
    if records:
        with open(os.path.join(args.out, name + ".json"), "w") as fh:
            json.dump(records, fh, indent=1)
    with open(os.path.join(args.out, name + "_info.json"), "w") as fh:
        json.dump(info, fh, indent=1)
    if full:
        write_md(records, info, os.path.join(args.out, "attention.md"))
        plot(records, os.path.join(args.out, "attention.png"))
    if records:
        print(summary(records))


def tune_case(case, fi, ceiling):
    """Variants of the CUDA fused and uncompressed kernels at one case: cp.async depth x split-KV."""
    recs = measure_case(case, fi, [], {}, ceiling) if fi is not None else []
    # (the full grid of the per-warp kernel, tma x stages 3/4/6 x splits 1/4/8, is in
    # benchmarks/results/attention_tune.json of 2026-12-02, in git history)
    # the producer-warp kernel (2026-12-05) against each kernel's per-warp default
    variants = [dict(stages=4, tma=True, producer=False), dict(stages=3, tma=False, producer=False),
                dict(producer=True), dict(producer=True, num_splits=4),
                dict(producer=True, num_splits=8), dict(stages=4, tma=True, num_splits=8, producer=False)]
    fi_ms = recs[0]["median_ms"] if recs else None
    for name in ("uncompressed", "fused"):
        for v in variants:
            fn = getattr(case, "run_" + name)
            t, spread, how = time_calls(lambda i: fn(i, **v), case.sets)
            nbytes = case.open_bytes if name == "uncompressed" else case.comp_bytes
            r = dict(kernel=name, variant=json.dumps(v), median_ms=t * 1e3,
                     spread_ms=spread * 1e3, bytes_read=nbytes, batch=case.B,
                     context=case.ctx, timing=how)
            r["achieved_GBps"] = nbytes / t / 1e9
            if fi_ms:
                r["speedup_vs_flashinfer"] = fi_ms / r["median_ms"]
            recs.append(r)
    return recs


def write_md(records, info, path):
    by = {}
    for r in records:
        by.setdefault((r["compressible_fraction_nominal"], r["batch"], r["context"]), {})[r["kernel"]] = r
    lines = [
        "# Decode attention: fused (compressed KV) vs FlashInfer, uncompressed and unfused",
        "",
        f"Device: {info['device']} ({info['sms']} SMs); torch {info['torch']}, triton "
        f"{info['triton']}, FlashInfer {info.get('flashinfer', 'n/a')} "
        "(BatchDecodeWithPagedKVCacheWrapper, use_tensor_cores=True, fa2); "
        f"date {info['date']}.",
        f"Command: `{info['command']}`. Copy ceiling (device-to-device copy, read+write): "
        f"{info['copy_ceiling_GBps']:.0f} GB/s. Kernel config: "
        + (f"picked by the same run's tuning at batch 32 / 8K / 100%: `{info['chosen_config']}`."
           if info.get("chosen_config") else
           "the defaults of zipfusion.kernels.cuda_attention (fused: 4 half-page stages and "
           "bulk copies (TMA); uncompressed: 3 stages and cp.async; split-KV heuristic)."),
        "",
        "uncompressed and fused are the CUDA C++ kernels (kernels/cuda/decode_attention.cu); unfused = "
        "Triton decompress + uncompressed. "
        "Llama-3.1-8B attention: 32 query heads, 8 KV heads, head_dim 128, page size 16, "
        "bf16; every request has the same context, pages scattered in random order; all pages "
        "compressed for fused/unfused. Each time is the median per call over 11 replays of a "
        "CUDA graph of >= 10 calls rotating over copies of the inputs (>= 512 MB touched, "
        "so L2 does not hold them). GB/s = bytes read (+ written, unfused) / time. "
        "Compressible = measured fraction of 512-value blocks that compress.",
        "",
        "| compressible | batch | context | FlashInfer ms | uncompressed ms | fused ms | unfused ms | "
        "fused GB/s | fused x FI | uncompressed x FI | fused x uncompressed | unfused x FI | bit-identical |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key in sorted(by, key=lambda k: (-k[0], k[1], k[2])):
        k = by[key]
        fi, tw, fu, un = (k.get(n) for n in ("flashinfer", "uncompressed", "fused", "unfused"))
        ms = lambda r: f"{r['median_ms']:.4f}" if r else "-"  # noqa: E731
        lines.append(
            f"| {fu['compressible_fraction']:.2f} | {key[1]} | {key[2]} | {ms(fi)} | {ms(tw)} | "
            f"{ms(fu)} | {ms(un)} | {fu['achieved_GBps']:.0f} | "
            f"{fu.get('speedup_vs_flashinfer', math.nan):.3f} | "
            f"{tw.get('speedup_vs_flashinfer', math.nan):.3f} | "
            f"{tw['median_ms'] / fu['median_ms']:.3f} | "
            f"{un.get('speedup_vs_flashinfer', math.nan):.3f} | "
            f"{fu.get('bit_identical_to_uncompressed')} |")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")


def plot_tune(records, path):
    """--tune: each variant's speedup over FlashInfer at each fraction, fused and uncompressed."""
    plt = pyplot()
    if plt is None:
        return
    fracs = sorted({r["compressible_fraction_nominal"] for r in records}, reverse=True)
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8), sharey=True)
    for ax, name in zip(axes, ("fused", "uncompressed")):
        variants = list(dict.fromkeys(r["variant"] for r in records if r["kernel"] == name))
        w = 0.8 / max(1, len(variants))
        for j, v in enumerate(variants):
            ys = [next((r.get("speedup_vs_flashinfer", 0) for r in records if r["kernel"] == name
                        and r.get("variant") == v and r["compressible_fraction_nominal"] == f), 0)
                  for f in fracs]
            label = ", ".join(f"{k}={x}" for k, x in json.loads(v).items())
            ax.bar([i + (j - (len(variants) - 1) / 2) * w for i in range(len(fracs))], ys, width=w,
                   label=label)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(fracs)))
        ax.set_xticklabels([("real model" if f == REAL_MODEL_FRACTION else f"{f:.0%}") for f in fracs])
        ax.set_title(f"{name}: batch 32 x 8K, x FlashInfer (higher is faster)")
        ax.set_ylim(0.6, None)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_diag(root):
    """What bounds the producer kernel (`--diag` runs): left, the fused
    kernel, its copies alone and its instructions alone, x FlashInfer at each fraction; right, the
    kernel and its copies alone over the split count at 100 %."""
    plt = pyplot()
    if plt is None:
        return

    def fused(path):
        with open(path) as fh:
            return [r for r in json.load(fh) if r["kernel"] == "fused"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.6))
    parts = {"kernel": "full", "copies alone": "copy", "instructions alone": "compute"}
    for j, (label, d) in enumerate(parts.items()):
        rs = fused(os.path.join(root, "diag", d, "attention_quick.json"))
        xs, ys = [i + (j - 1) * 0.27 for i in range(len(rs))], [r["speedup_vs_flashinfer"] for r in rs]
        a.bar(xs, ys, width=0.27, label=label)
        for x, y in zip(xs, ys):
            a.text(x, y, f"{y:.2f}", ha="center", va="bottom", fontsize=7)
        ticks = [("real model" if r["compressible_fraction_nominal"] == REAL_MODEL_FRACTION
                  else f"{r['compressible_fraction_nominal']:.0%}") for r in rs]
    a.axhline(1.0, color="k", lw=0.8)
    a.set_xticks(range(len(ticks)))
    a.set_xticklabels(ticks)
    a.set_ylim(0.8, None)
    a.set_ylabel("x FlashInfer (higher is faster)")
    a.set_title("producer kernel, batch 32 x 8K: which side bounds it")
    a.legend()
    for d, label in (("full", "kernel"), ("copy", "copies alone")):
        pts = sorted((int(name.rsplit("_S", 1)[1]), fused(os.path.join(root, "splits", name, "attention_quick.json"))[0])
                     for name in os.listdir(os.path.join(root, "splits")) if name.startswith(d + "_S"))
        b.plot([S for S, _ in pts], [r["speedup_vs_flashinfer"] for _, r in pts], "o-", label=label)
    b.axhline(1 / fused(os.path.join(root, "diag", "full", "attention_quick.json"))[0]["stored_ratio"],
              color="gray", ls="--", lw=0.8, label="bytes ratio (FI rate on compressed bytes)")
    b.set_xscale("log", base=2)
    b.set_xticks([S for S, _ in pts], [str(S) for S, _ in pts])
    b.set_xlabel("splits per (request, KV head)")
    b.set_ylabel("x FlashInfer")
    b.set_title("100 % compressible, over the split count")
    b.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(root, "diag.png"), dpi=110)


def plot(records, path):
    plt = pyplot()
    if plt is None:
        return
    fracs = sorted({r["compressible_fraction_nominal"] for r in records}, reverse=True)
    fig, axes = plt.subplots(1, len(fracs), figsize=(6 * len(fracs), 4.5), sharey=True)
    axes = [axes] if len(fracs) == 1 else axes
    for ax, f in zip(axes, fracs):
        rs = [r for r in records if r["compressible_fraction_nominal"] == f]
        keys = sorted({(r["batch"], r["context"]) for r in rs})
        x = range(len(keys))
        for j, name in enumerate(["uncompressed", "fused", "unfused"]):
            ys = [next((r.get("speedup_vs_flashinfer", 0) for r in rs if r["kernel"] == name
                        and (r["batch"], r["context"]) == k), 0) for k in keys]
            ax.bar([i + (j - 1) * 0.27 for i in x], ys, width=0.27, label=name)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(list(x))
        ax.set_xticklabels([f"B{b}\n{c // 1024}K" for b, c in keys], fontsize=8)
        ax.set_title(f"{f:.0%} of blocks compressible" + (" (real model: SmolLM2)" if f == REAL_MODEL_FRACTION else ""))
        ax.set_ylabel("speedup vs FlashInfer (tensor cores)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
