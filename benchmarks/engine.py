#!/usr/bin/env python3
"""Engine decode-step benchmark (GPU): Llama-3.1-8B shape, random weights, 8K context.

For batch 1, 32 and the largest batch that fits the KV memory, with the KV cache compressed
and uncompressed, time one engine decode step (host inputs + CUDA-graph replay of the whole
model, fused decode attention over the arena + sampling + the device sync the engine does)
and compare with the roofline: (weight bytes + KV bytes) / measured copy bandwidth.

The 8K contexts are filled directly with synthetic KV of realistic statistics
(zipfusion.analysis.synthetic.realistic_pages; its compressible-block fraction is reported),
written into the arena's open pages and compressed by the memory manager exactly as the
engine does when pages fill; no prefill is timed. A GPU exactness check runs first: the
engine generates with compression on and off (and eager) and the token ids and logits must
be identical.

    python3 benchmarks/engine.py --out DIR            # on the H200
    python3 benchmarks/engine.py --smoke              # CPU: tiny shapes, checks the script runs
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from common import copy_bandwidth, engine_on, on_weights_of, pyplot, replay_seconds  # noqa: E402  (benchmarks/common.py)

from zipfusion.analysis.synthetic import compressible_fraction, realistic_pages  # noqa: E402
from zipfusion.engine import SamplingParams  # noqa: E402
from zipfusion.attention.backend import AttentionBackend  # noqa: E402
from zipfusion.memory.kv_cache import ArenaKVCache  # noqa: E402
from zipfusion.format.layout import open_bf16_index  # noqa: E402
from zipfusion.engine.request import PAGE_TOKENS, Request  # noqa: E402
from zipfusion.engine.runner import ModelRunner  # noqa: E402
from zipfusion.engine.sampling import Sampler  # noqa: E402
from zipfusion.testing import run_to_completion  # noqa: E402
from zipfusion.models import build_model, resolve_model  # noqa: E402


def log(*a):
    print(*a, flush=True)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def exactness(model_name, dev, prebuilt=None, lengths=(700, 100, 333), max_tokens=24, kv_gb=4.0,
               max_model_len=2048):
    g = torch.Generator().manual_seed(0)
    runs = {}
    for name, kw in (("compressed", dict(kv_compression=True)), ("uncompressed", dict(kv_compression=False)),
                     ("compressed-eager", dict(kv_compression=True, enforce_eager=True))):
        eng = engine_on(model_name, prebuilt, device=str(dev), dtype="bfloat16", kv_memory_gb=kv_gb, max_num_seqs=8,
                        max_num_batched_tokens=512, max_model_len=max_model_len, **kw)
        vocab = eng.model_config.vocab_size
        g.manual_seed(0)
        prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
        reqs = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
                for p in prompts]
        run_to_completion(eng, reqs, keep_logits=True)
        runs[name] = (reqs, eng.peak_kv_stats, eng.graph_buckets)
        del eng
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    on, off, eager = runs["compressed"][0], runs["uncompressed"][0], runs["compressed-eager"][0]
    same_tokens = all(a.output_ids == b.output_ids for a, b in zip(on, off))
    same_logits = all(torch.equal(x, y) for a, b in zip(on, off) for x, y in zip(a.logits, b.logits))
    graph_eq_eager = all(torch.equal(x, y) for a, b in zip(on, eager) for x, y in zip(a.logits, b.logits))
    st = runs["compressed"][1]
    return dict(model=model_name, prompts=list(lengths), max_tokens=max_tokens, identical_tokens=same_tokens,
                identical_logits=same_logits, graph_equals_eager_logits=graph_eq_eager,
                graph_buckets=runs["compressed"][2], stored_pages_at_peak=st["stored_pages"],
                stored_ratio=st["stored_ratio"], tokens_first=on[0].output_ids[:8])


# ---------------------------------------------------------------------------------------------
# Decode-step timing at long context
# ---------------------------------------------------------------------------------------------
def fill_requests(cache, ctx, pool, max_requests, compress):
    """Allocate requests of ``ctx`` tokens (+1 page for the token being decoded), write pool
    pages into every layer, compress the full ones; stop when the next would not fit."""
    L = cache.num_layers
    n_full = ctx // PAGE_TOKENS
    per_req = n_full + 1
    P = pool.shape[0]
    elems = pool[0].numel()
    arena16 = cache.arena.view(torch.bfloat16)
    ar = torch.arange(elems, device=cache.device)
    reqs = []
    while len(reqs) < max_requests and cache.capacity_new_pages() >= per_req + 1:
        i = len(reqs)
        ids = cache.alloc(per_req)
        full = torch.tensor(ids[:n_full], device=cache.device)
        for layer in range(L):
            base = open_bf16_index(cache.page_loc[layer, full])
            src = (torch.arange(n_full, device=cache.device) + i * 7 + layer * 13) % P   # vary pages
            arena16[(base[:, None] + ar[None, :]).reshape(-1)] = pool[src].reshape(-1)
        if compress:
            left = cache.manager.compress_pages(ids[:n_full])
            if left:                             # compressed space ran out: this one does not fit
                cache.free(ids)
                break
        r = Request(i, [1] * ctx, SamplingParams(temperature=0))
        r.output_ids = [2]
        r.pages, r.num_computed, r.num_sealed_pages = ids, ctx, n_full
        reqs.append(r)
    return reqs


def time_steps(runner, sampler, reqs, steps, dev):
    params, gens = [r.params for r in reqs], [None] * len(reqs)
    for _ in range(3):
        sampler(runner.decode(reqs), params, gens).tolist()
    full, replay = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        sampler(runner.decode(reqs), params, gens).tolist()      # what one engine step does
        full.append(time.perf_counter() - t0)
    if runner.graphs and dev.type == "cuda":
        bucket = min(b for b in runner.graphs if b >= len(reqs))
        replay = replay_seconds(runner.graphs[bucket], steps)
    return statistics.median(full), (statistics.median(replay) if replay else float("nan"))


def weight_bytes(model, batch):
    """Bytes a decode step must read: every weight once, but only ``batch`` embedding rows."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.model.embed_tokens.weight
    if model.lm_head is not None:
        total -= emb.numel() * emb.element_size()
        total += batch * emb.shape[1] * emb.element_size()
    return total


def decode_bench(model, dev, ctx, kv_gb, batches, steps, max_batch, compress, pool, deterministic=False,
                 cache_kw=None, attention=AttentionBackend):
    """``cache_kw``: {"attention": backend kind} ("auto" by default); ``attention``: the backend
    class (benchmarks/e2e.py: one with the unfused baseline as its decode route)."""
    cfg = model.config
    L, H, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    cache = ArenaKVCache(L, H, D, int(kv_gb * 2**30), dev, kv_compression=compress)
    backend = attention(cache, (cache_kw or {}).get("attention", "auto"), kv_compression=compress,
                        deterministic=deterministic, num_qo_heads=cfg.num_attention_heads,
                        sm_scale=cfg.head_dim ** -0.5)
    model = on_weights_of(model, deterministic)         # the same weights, this mode's arithmetic
    t0 = time.perf_counter()
    reqs = fill_requests(cache, ctx, pool, max_batch, compress)
    fill_s = time.perf_counter() - t0
    n_max = len(reqs)
    st = cache.stats()
    stored = sum(l["compressed_bytes"] for l in st["layers"])         # full pages of all requests
    open_page = cache.layout.open_page_bytes
    kv_full_per_req = stored / n_max if compress else (ctx // PAGE_TOKENS) * L * open_page
    sizes = sorted({b for b in batches if b <= n_max} | {n_max})
    runner = ModelRunner(model, backend, max_model_len=ctx + PAGE_TOKENS, max_num_seqs=max(sizes),
                         use_cuda_graphs=dev.type == "cuda")
    t0 = time.perf_counter()
    runner.capture_cuda_graphs(sizes=sizes)
    capture_s = time.perf_counter() - t0
    sampler = Sampler(dev)
    rows = []
    for b in sizes:
        step, replay = time_steps(runner, sampler, reqs[:b], steps, dev)
        # K/V read per request: its full pages as stored + the tokens of its open page
        kv = b * (kv_full_per_req + L * 2 * H * D * 2 * ((ctx % PAGE_TOKENS) + 1))
        wb = weight_bytes(model, b)
        rows.append(dict(batch=b, step_s=step, replay_s=replay, weight_bytes=wb, kv_bytes=kv))
        log(f"  compress={compress} deterministic={deterministic} batch={b}: step {step * 1e3:.2f} ms, "
            f"replay {replay * 1e3:.2f} ms")
    info = dict(compress=compress, deterministic=deterministic, max_batch=n_max, fill_s=fill_s, capture_s=capture_s,
                stored_ratio=st["stored_ratio"], kv_bytes_per_request=kv_full_per_req, rows=rows)
    del runner, cache, reqs, model
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return info


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b-random")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--kv-gb", type=float, default=80.0)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--skip-exactness", action="store_true")
    ap.add_argument("--modes", default="compressed,uncompressed",
                    help="comma list of compressed, uncompressed, compressed-deterministic, uncompressed-deterministic")
    ap.add_argument("--smoke", action="store_true", help="CPU, demo model, tiny sizes: checks the script")
    args = ap.parse_args()
    if args.smoke:
        dev = torch.device("cpu")
        args.model, args.ctx, args.kv_gb, args.batches, args.max_batch, args.steps = "demo", 64, 0.02, "1,2", 3, 2
    else:
        dev = torch.device("cuda")
    torch.manual_seed(0)
    info = dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                torch=torch.__version__, triton=__import__("triton").__version__,
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                command="python3 " + " ".join(sys.argv), model=args.model, ctx=args.ctx, kv_gb=args.kv_gb)
    bw = copy_bandwidth(dev)
    info["copy_bandwidth_Bps"] = bw
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    t0 = time.perf_counter()
    model = build_model(resolve_model(args.model), dtype=torch.bfloat16, device=dev)
    sync(dev)
    log(f"model {args.model} built in {time.perf_counter() - t0:.1f} s")
    if not args.skip_exactness:
        try:                                 # a failure here is reported, and the timing still runs
            t0 = time.perf_counter()
            ex = exactness(args.model, dev, prebuilt=model,
                           lengths=(40, 7, 23) if args.smoke else (600, 60, 250),
                           max_tokens=6 if args.smoke else 16, kv_gb=0.02 if args.smoke else 4.0,
                           max_model_len=256 if args.smoke else 2048)
            ex["seconds"] = time.perf_counter() - t0
            info["exactness"] = ex
            log(f"exactness: {ex}")
            if dev.type == "cuda":
                ex2 = exactness("demo", dev, lengths=(200, 9, 64), max_tokens=32, kv_gb=0.1)
                info["exactness_demo"] = ex2
                log(f"exactness demo: {ex2}")
        except Exception:
            info["exactness_error"] = traceback.format_exc()
            log(info["exactness_error"])
            gc.collect()
        write(info, args.out, smoke=args.smoke)
    cfg = model.config
    pool = realistic_pages(512 if not args.smoke else 8, cfg.num_key_value_heads, cfg.head_dim, seed=1)
    info["compressible_fraction"] = compressible_fraction(pool)
    pool = pool.to(dev)
    batches = [int(b) for b in args.batches.split(",")]
    info["runs"] = []
    for mode in args.modes.split(","):      # results written after each run (a timeout keeps them)
        c, det = mode.startswith("compressed"), mode.endswith("deterministic")
        t0 = time.perf_counter()
        run = decode_bench(model, dev, args.ctx, args.kv_gb, batches, args.steps, args.max_batch, c, pool, det)
        run["seconds"] = time.perf_counter() - t0
        for r in run["rows"]:
            r["roofline_s"] = (r["weight_bytes"] + r["kv_bytes"]) / bw
            r["efficiency_step"] = r["roofline_s"] / r["step_s"]
            r["efficiency_replay"] = r["roofline_s"] / r["replay_s"]
        info["runs"].append(run)
        write(info, args.out, smoke=args.smoke)


def write(info, out, smoke=False):
    os.makedirs(out, exist_ok=True)
    name = "engine_smoke" if smoke else "engine"
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(info, f, indent=1, default=str)
    lines = [f"## Engine decode step ({info['model']}, {info['ctx']} context)", "",
             f"Device: {info['device']}; torch {info['torch']}, triton {info['triton']}; {info['date']}.",
             f"Command: `{info['command']}`. Copy bandwidth (read + write) {info['copy_bandwidth_Bps'] / 1e12:.2f} TB/s.",
             f"KV: synthetic realistic pages, compressible-block fraction {info.get('compressible_fraction', float('nan')):.1%}; "
             f"KV memory {info['kv_gb']} GiB.", "",
             "Step = host inputs + CUDA-graph replay + sampling + sync (one engine decode step); replay = the "
             "graph alone. Roofline = (weights + KV bytes read) / copy bandwidth. Medians.", "",
             "| KV | batch | step ms | replay ms | roofline ms | step / roofline | replay / roofline | KV GB read |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for run in info.get("runs", []):
        kind = ("compressed" if run["compress"] else "uncompressed") + (" deterministic" if run.get("deterministic") else "")
        for r in run["rows"]:
            lines.append(f"| {kind} | {r['batch']} | {r['step_s'] * 1e3:.2f} | {r['replay_s'] * 1e3:.2f} | "
                         f"{r['roofline_s'] * 1e3:.2f} | {r['efficiency_step']:.1%} | {r['efficiency_replay']:.1%} | "
                         f"{r['kv_bytes'] / 1e9:.1f} |")
    lines.append("")
    for run in info.get("runs", []):
        kind = "compressed" if run["compress"] else "uncompressed"
        lines.append(f"- {kind}: {run['max_batch']} requests of {info['ctx']} tokens fit "
                     f"(stored/open ratio of full pages {run['stored_ratio']:.3f}).")
    for key in ("exactness", "exactness_demo"):
        if key in info:
            ex = info[key]
            lines.append(f"- {key} ({ex['model']}, prompts {ex['prompts']}, {ex['max_tokens']} tokens): identical "
                         f"tokens {ex['identical_tokens']}, identical logits {ex['identical_logits']}, graph == "
                         f"eager logits {ex['graph_equals_eager_logits']}, stored pages at peak "
                         f"{ex['stored_pages_at_peak']}.")
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plt = pyplot()
    try:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for run in info.get("runs", []):
            xs = [r["batch"] for r in run["rows"]]
            ax.plot(xs, [100 * r["efficiency_step"] for r in run["rows"]], "o-",
                    label=("compressed" if run["compress"] else "uncompressed") + " (step)")
        ax.axhline(85, color="gray", ls="--", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.set_ylabel("% of roofline")
        ax.set_title(f"decode step, {info['model']}, {info['ctx']} ctx")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out, f"{name}.png"), dpi=120)
    except Exception as e:                        # no matplotlib, or nothing to plot (CPU smoke run)
        log(f"(no plot: {e})")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
