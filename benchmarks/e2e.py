#!/usr/bin/env python3
"""The write-up's experiment end to end (issue 13): KV methods inside our engine, one command.

Llama-3.1-8B shape (random weights), BF16, a KV budget of 52 GiB for every method, 8192-token
prompts, 256 generated tokens, as many requests as fit. Methods (record key ``method``):

* ``fused``                   compressed KV, our fused decode kernel;
* ``uncompressed-twin``       uncompressed KV, our twin kernel (same arithmetic);
* ``uncompressed-flashinfer`` uncompressed KV, FlashInfer's paged decode (the SGLang baseline);
* ``unfused``                 our format, Triton decompress into a one-layer workspace, then the twin;
* ``nvcomp-ans`` / ``nvcomp-bitcomp``  decompress-then-attend with nvCOMP: a *composite* (see
  benchmarks/e2e_methods.py): measured ratio and decode speed, the engine's uncompressed step at
  the batch that fits, plus the decompression of the batch's KV of every layer.

Compressibility points: ``model`` (the model's own prefill KV, through the public API: an ``LLMEngine``
on the worker's weights (common.engine_on), ``add_request``, ``step``; whole-run and decode throughput) and prompt pages filled with KV at
exact compressible fractions (decode-only steps at the largest batch that fits, through
benchmarks/engine.py's ``decode_bench``: requests filled straight into the arena, compressed
as the engine does, then engine decode steps = CUDA-graph replay + sampling + sync).
Uncompressed methods do not depend on the data: one synthetic measurement serves every fraction
(``data_independent: true``). Every speed number carries its compressible fraction. Whole runs
(long generation among them) are benchmarks/workloads.py's, whose harness runs the ``model`` point.

Each engine method runs in its own process (``--worker METHOD``).

    python3 benchmarks/e2e.py --out DIR                  # H200 (scripts/gpu/e2e_gpu.sh)
    python3 benchmarks/e2e.py --smoke --out DIR          # CPU, demo model, tiny: checks the script
Writes DIR/e2e.json ({"meta", "records"}), DIR/e2e.md, DIR/e2e.png.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "src"))

ENGINE_METHODS = ("fused", "uncompressed-flashinfer", "uncompressed-twin", "unfused")
NVCOMP_METHODS = ("nvcomp-ans", "nvcomp-bitcomp")
METHODS = ENGINE_METHODS + NVCOMP_METHODS
ENGINE_KW = {"fused": dict(kv_compression=True), "uncompressed-twin": dict(kv_compression=False),
             "uncompressed-flashinfer": dict(kv_compression=False, attention_backend="flashinfer"),
             "unfused": dict(kv_compression=True)}
FRACTIONS = (1.0, 0.92, 0.85, 0.78, 0.60)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ worker
def burst(model, method: str, args) -> dict:
    """The write-up's workload through the public API, run by benchmarks/workloads.py's harness
    (warm-up, every request at once, the step loop, the numbers); the model's own KV. Decode tok/s
    the write-up's way (:func:`writeup_tokens_s`)."""
    import torch
    from workloads import random_prompts, run_requests, summarize, warm_up
    from common import engine_on
    from engine import weight_bytes
    prompt, max_len = args.prompt, args.prompt + args.max_tokens + 16
    eng = engine_on(args.model, model, device=args.device, kv_memory_gb=args.kv_gb,
                    max_model_len=max_len, max_num_seqs=args.max_num_seqs, **ENGINE_KW[method])
    prompts = random_prompts([prompt] * args.requests, eng.model_config.vocab_size, args.seed)
    warm_up(eng, max_len)
    probe = {}

    def on_step(eng, res):                   # the first pure decode step: all admitted are in
        if not probe and res.prefill_tokens == 0:
            probe.update(_probe(eng, prompt, method == "uncompressed-twin" and args.nvcomp))
    base = eng.cache.stats()
    reqs, steps, wall = run_requests(eng, prompts, [args.max_tokens] * len(prompts), on_step=on_step,
                                     label=f"[{method}]")
    rec = {"scenario": "burst", "mode": method, **summarize(eng, reqs, steps, wall, base)}
    if probe:
        rec["compressible_fraction"] = probe["compressible_fraction"]
    writeup_tokens_s(rec)
    rec["weight_bytes"] = weight_bytes(model, rec["peak_batch"])
    dec = [x for x in steps if x.prefill_tokens == 0]
    rec["seal_s_per_decode_step"] = sum(x.seal_s for x in dec) / max(1, len(dec))
    del eng, reqs, steps
    _free(torch)
    if probe and probe.get("pages") is not None:
        from e2e_methods import nvcomp_measure
        rec["model_kv_sample"] = nvcomp_measure(probe.pop("pages"))
    return rec


def _probe(eng, prompt: int, sample: bool) -> dict:
    """At the first pure decode step: the compressible fraction of the stored pages, and (for
    nvCOMP) a copy of one running request's prompt pages in every layer (the model's own KV)."""
    import torch
    fracs = [x["compressible_fraction"] for x in eng.cache.stats().get("layers", [])
             if x["compressible_fraction"] == x["compressible_fraction"]]
    out = {"compressible_fraction": statistics.mean(fracs) if fracs else float("nan"), "pages": None}
    if sample and eng.scheduler.running:
        ids = eng.scheduler.running[0].pages[:prompt // 16]
        out["pages"] = torch.cat([eng.cache.read_pages(layer, ids) for layer in range(eng.cache.num_layers)])
    return out


def _free(torch):
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synthetic(model, method: str, args, fraction: float, batches, max_batch=None, kv_gb=None) -> dict:
    """Decode-only steps at the largest batch (and ``batches``), prompt pages at ``fraction``."""
    import torch
    from engine import decode_bench
    from e2e_methods import UnfusedBackend, unfused_kv_gb
    from zipfusion.attention.backend import AttentionBackend
    from zipfusion.analysis.synthetic import compressible_fraction, pages_with_fraction
    cfg = model.config
    H, D, L = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
    pool = pages_with_fraction(args.pool_pages, H, D, fraction, seed=1)
    measured = compressible_fraction(pool)
    compress = ENGINE_KW[method]["kv_compression"]
    cache_kw, attention, budget = None, AttentionBackend, kv_gb or args.kv_gb
    if method == "uncompressed-flashinfer":
        cache_kw = dict(attention="flashinfer")
    dev = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    if method == "unfused":
        budget, attention = unfused_kv_gb(budget, L, fraction), UnfusedBackend
        if dev.type == "cpu":       # Triton kernels run in the interpreter there: one request is plenty
            max_batch = 1
    info = decode_bench(model, dev, args.prompt, budget, list(batches), args.steps, max_batch or args.max_num_seqs,
                        compress, pool.to(dev), cache_kw=cache_kw, attention=attention)
    info.update(fraction=fraction, compressible_fraction=measured, kv_gb_for_pages=budget)
    _free(torch)
    return info


def writeup_tokens_s(rec: dict) -> None:
    """Decode throughput the write-up's way: decode-only steps at the peak batch (benchmarks/workloads.py's median
    over steps with >= 90 % of the peak's rows; steps that seal pages count: sealing generated pages
    is part of steady decoding here, where the write-up compressed only prompts)."""
    rec["decode_tok_s_writeup"] = rec["decode_tok_s_at_peak_batch"]
    rec["decode_step_s_at_peak"] = rec["peak_batch"] / rec["decode_tok_s_at_peak_batch"]


def worker(args) -> dict:
    import torch
    from zipfusion.models import build_model, resolve_model
    from common import copy_bandwidth
    method = args.worker
    dev = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    t0 = time.perf_counter()
    model = build_model(resolve_model(args.model), dtype=torch.bfloat16, device=dev, seed=args.seed)
    out = {"method": method, "build_s": time.perf_counter() - t0, "copy_bandwidth_Bps": copy_bandwidth(dev),
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "synthetic": []}
    batches = [int(b) for b in args.batches.split(",")]
    if method != "unfused" and "model" in args.points:
        log(f"[{method}] burst: {args.requests} x ({args.prompt} + {args.max_tokens})")
        out["burst"] = burst(model, method, args)
    fractions = [float(f) for f in args.fractions.split(",")] if args.fractions and "synthetic" in args.points else []
    if method.startswith("uncompressed") and "synthetic" in args.points:
        fractions = fractions[:1] or [0.85]                     # data-independent: one point
    elif method == "unfused" and "synthetic" in args.points:
        fractions = [float(f) for f in args.unfused_fractions.split(",")]
    sweep_at = min(fractions, key=lambda f: abs(f - 0.85)) if fractions else None   # throughput vs batch here
    for f in fractions:
        log(f"[{method}] synthetic KV at {f:.0%} compressible")
        out["synthetic"].append(synthetic(model, method, args, f, batches if f == sweep_at else []))
    if method == "uncompressed-twin" and args.nvcomp:
        out["nvcomp"] = nvcomp_points(model, args, out)
    return out


def nvcomp_points(model, args, twin_out: dict) -> dict:
    """nvCOMP ratio/speed per compressibility point and the twin's step at each batch that fits."""
    import torch
    from e2e_methods import NVCOMP_VARIANTS, composite_batch, nvcomp_measure
    from zipfusion.analysis.synthetic import pages_with_fraction
    from zipfusion.format import PageLayout
    cfg = model.config
    H, D, L = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
    ob = PageLayout(H, D).open_page_bytes
    n_full = args.prompt // 16
    per_req = n_full * L * ob
    sample_pages = max(1, (args.nvcomp_sample_mb << 20) // ob)
    points = {}
    dev = next(model.parameters()).device
    for f in [float(x) for x in args.fractions.split(",")]:
        pool = pages_with_fraction(args.pool_pages, H, D, f, seed=1).to(dev)
        reps = -(-sample_pages // pool.shape[0])
        points[f"{f:g}"] = nvcomp_measure(pool.repeat(reps, 1, 1, 1, 1)[:sample_pages])
        del pool
    if "burst" in twin_out and "model_kv_sample" in twin_out["burst"]:
        points["model"] = twin_out["burst"]["model_kv_sample"]
    need = set()
    for p in points.values():
        for m in NVCOMP_VARIANTS:
            if p.get(m):
                p[m]["max_batch"] = composite_batch(args.kv_gb * 2**30, per_req, L * ob, L, p[m]["ratio"])
                need.add(p[m]["max_batch"])
    need.discard(0)
    timing = None
    if need:          # the twin's step at those batches: an arena just large enough (not the budget)
        gb = max(need) * (per_req + 2 * L * ob) / 2**30 * 1.05 + 0.1
        timing = synthetic(model, "uncompressed-twin", args, 0.85, sorted(need), max_batch=max(need), kv_gb=gb)
    return {"points": points, "twin_timing": timing, "open_bytes_per_request": per_req}


# ------------------------------------------------------------------------------ driver
def run_worker(args, method: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", method] + args.passthrough
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                           timeout=args.worker_timeout)
    except subprocess.TimeoutExpired as exc:
        return {"method": method, "error": f"worker timed out after {args.worker_timeout} s: "
                                           f"{(exc.stdout or '')[-500:]}"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        return {"method": method, "error": f"worker exit {p.returncode}: {p.stdout[-1500:]}"}
    rec = json.loads(lines[-1][len("RESULT "):])
    rec["process_s"] = time.perf_counter() - t0
    return rec


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--smoke", action="store_true", help="CPU: demo model, tiny sizes, fused/twin/unfused")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--methods", default=",".join(ENGINE_METHODS), help="engine methods to run (nvCOMP rides "
                    "on uncompressed-twin)")
    ap.add_argument("--model", default="llama-3.1-8b-random")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--kv-gb", type=float, default=52.0)
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--requests", type=int, default=72, help="burst size (more than fit: the peak is the max batch)")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--points", default="model,synthetic", help="model (a burst through the engine), synthetic "
                    "(exact fractions)")
    ap.add_argument("--fractions", default=",".join(f"{f:g}" for f in FRACTIONS))
    ap.add_argument("--unfused-fractions", default="0.85")
    ap.add_argument("--batches", default="1,8,16,32", help="extra batch sizes timed (throughput vs batch)")
    ap.add_argument("--steps", type=int, default=10, help="timed decode steps per batch size")
    ap.add_argument("--pool-pages", type=int, default=512)
    ap.add_argument("--nvcomp", type=int, default=1, help="1: measure nvCOMP in the uncompressed-twin worker")
    ap.add_argument("--nvcomp-sample-mb", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", metavar="E2E_JSON", help="keep the methods that finished in this earlier "
                    "e2e.json (same options) and run only the others")
    ap.add_argument("--worker-timeout", type=float, default=600.0, help="seconds per method process")
    args = ap.parse_args(argv)
    if args.smoke:                      # tiny sizes, wherever the command line left the default
        smoke = dict(model="demo", device="cpu", kv_gb=0.02, prompt=64, max_tokens=6, requests=4, max_num_seqs=8,
                     fractions="1,0.6", unfused_fractions="0.85", batches="1", steps=2, pool_pages=8, nvcomp=0,
                     methods="fused,uncompressed-twin,unfused")
        for k, v in smoke.items():
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
    keep = ("model", "device", "kv_gb", "prompt", "max_tokens", "requests", "max_num_seqs", "points", "fractions",
            "unfused_fractions", "batches", "steps", "pool_pages", "nvcomp", "nvcomp_sample_mb", "seed")
    args.passthrough = [x for k in keep for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
    return args


def main(argv=None):
    args = parse(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(args), default=float), flush=True)
        return
    from tqdm import tqdm
    from e2e_report import assemble, write_outputs
    os.makedirs(args.out, exist_ok=True)
    methods = [m for m in args.methods.split(",") if m]
    bad = sorted(set(methods) - set(ENGINE_METHODS))
    if bad:
        raise SystemExit(f"--methods: unknown {bad}; choose from {list(ENGINE_METHODS)}")
    raw, t0 = {}, time.perf_counter()
    if args.resume:                     # methods that finished in an earlier run of the same command
        done = json.load(open(args.resume))["raw"]
        raw = {m: r for m, r in done.items() if m in methods and "error" not in r}
    def save() -> str:                  # after each method, so that a timeout keeps what finished
        meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "command": "python3 benchmarks/e2e.py " + " ".join(sys.argv[1:] if argv is None else argv),
                "model": args.model, "kv_budget_gb": args.kv_gb, "prompt": args.prompt,
                "max_tokens": args.max_tokens, "requests": args.requests, "fractions": args.fractions,
                "smoke": args.smoke, "seconds": time.perf_counter() - t0, "methods_done": list(raw),
                "points": args.points,
                "device": next((r.get("device") for r in raw.values() if r.get("device")), "?")}
        return write_outputs({"meta": meta, "records": assemble(raw, args), "raw": raw}, args.out)

    for m in tqdm([m for m in methods if m not in raw], desc="e2e methods", unit="process"):
        raw[m] = run_worker(args, m)
        if "error" in raw[m]:
            log(f"[{m}] FAILED: {raw[m]['error']}")
        save()
    print(save())


if __name__ == "__main__":
    main()
