#!/usr/bin/env python3
"""Where the time of one engine decode step goes (GPU): Llama-3.1-8B shape, random weights,
8K contexts of synthetic KV, compressed as the engine does.

Each piece of the step is captured alone in a CUDA graph over all 32 layers (so weights come
from HBM as in the real step, not from L2) and timed; the sum is set against the replay of
the whole step's graph, and the host's part of a step (inputs, copies, sampling, the sync) is
timed apart. Prints one table (ms per step, bytes, TB/s) and writes it as JSON. Public APIs
only: the runner's decode inputs, the cache's store (rope + K/V store), the decode kernels.

    python3 benchmarks/profile_engine.py --batch 32 --out DIR
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from common import copy_bandwidth, replay_seconds  # noqa: E402
from engine import fill_requests, weight_bytes  # noqa: E402  (benchmarks/engine.py)

from zipfusion.analysis.synthetic import compressible_fraction, realistic_pages  # noqa: E402
from zipfusion.attention.backend import AttentionBackend  # noqa: E402
from zipfusion.memory.kv_cache import ArenaKVCache  # noqa: E402
from zipfusion.engine.runner import ModelRunner  # noqa: E402
from zipfusion.engine.sampling import Sampler  # noqa: E402
from zipfusion.models import build_model, resolve_model  # noqa: E402
from zipfusion.models.merged_ops import rmsnorm, silu_and_mul  # noqa: E402


def graph_ms(fn, reps=10):
    """Median ms of one call of ``fn`` captured in a CUDA graph (after two warm-up calls)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return statistics.median(replay_seconds(g, reps)) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--kv-gb", type=float, default=40.0)
    ap.add_argument("--uncompressed", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    model = build_model(resolve_model("llama-3.1-8b-random"), dtype=torch.bfloat16, device=dev)
    cfg = model.config
    L, H, Hq, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim
    pool = realistic_pages(512, H, D, seed=1)
    frac = compressible_fraction(pool)
    cache = ArenaKVCache(L, H, D, int(args.kv_gb * 2**30), dev, kv_compression=not args.uncompressed)
    reqs = fill_requests(cache, args.ctx, pool.to(dev), args.batch, not args.uncompressed)
    B = len(reqs)
    compressed = not args.uncompressed
    attention = AttentionBackend(cache, "kernel", kv_compression=compressed, num_qo_heads=Hq, sm_scale=D ** -0.5)
    runner = ModelRunner(model, attention, max_model_len=args.ctx + 16, max_num_seqs=B)
    runner.capture_cuda_graphs(sizes=[B])
    b = {k: v.to(dev) for k, v in runner.decode_inputs(reqs, B).items()}
    layers = model.model.layers
    x = torch.randn(B, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
    r = torch.randn_like(x)
    qkv = torch.randn(B, Hq + 2 * H, D, device=dev, dtype=torch.bfloat16)
    q_, k_, v_ = qkv.split([Hq, H, H], dim=1)
    gu = torch.randn(B, 2 * cfg.intermediate_size, device=dev, dtype=torch.bfloat16)
    act = torch.randn(B, cfg.intermediate_size, device=dev, dtype=torch.bfloat16)
    q = torch.randn(B, Hq, D, device=dev, dtype=torch.bfloat16)
    o = torch.randn(B, Hq * D, device=dev, dtype=torch.bfloat16)
    cos, sin = model.rotary.cos_sin(b["positions"])
    hidden = torch.randn(B, cfg.hidden_size, device=dev, dtype=torch.bfloat16)

    def per_layer(f):
        return lambda: [f(i, lay) for i, lay in enumerate(layers)]

    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    kv_read = sum(cache.stats()["layers"][i]["compressed_bytes"] for i in range(L)) if not args.uncompressed \
        else L * B * (args.ctx // 16) * cache.layout.open_page_bytes
    parts = {   # name -> (fn, bytes that must move per step)
        "qkv_proj": (per_layer(lambda i, m: m.self_attn.qkv_proj(x)),
                     sum(nbytes(m.self_attn.qkv_proj.weight) for m in layers)),
        "o_proj": (per_layer(lambda i, m: m.self_attn.o_proj(o)), sum(nbytes(m.self_attn.o_proj.weight) for m in layers)),
        "gate_up_proj": (per_layer(lambda i, m: m.mlp.gate_up_proj(x)),
                         sum(nbytes(m.mlp.gate_up_proj.weight) for m in layers)),
        "down_proj": (per_layer(lambda i, m: m.mlp.down_proj(act)), sum(nbytes(m.mlp.down_proj.weight) for m in layers)),
        "lm_head": (lambda: model.compute_logits(hidden), nbytes(model.lm_head_weight)),
        "attention": (per_layer(lambda i, m: cache_attention(cache, i, q, b, attention.sm_scale, None, None)),
                      kv_read),
        "rope_store": (per_layer(lambda i, m: cache.store(i, q_, k_, v_, cos, sin, b["page_ids"], b["slots"],
                                                          want_kv=False)), 0),
        "add_rmsnorm x2": (per_layer(lambda i, m: (rmsnorm(x, m.input_layernorm.weight, 1e-5, r),
                                                   rmsnorm(x, m.post_attention_layernorm.weight, 1e-5, r))), 0),
        "silu_mul": (per_layer(lambda i, m: silu_and_mul(gu)), 0),
        "embed+rope tables": (lambda: (model.model.embed_tokens(b["input_ids"]),
                                       model.rotary.cos_sin(b["positions"])), 0),
    }
    rows = []
    for name, (fn, by) in parts.items():
        ms = graph_ms(fn)
        rows.append(dict(part=name, ms=ms, bytes=by, tbps=by / ms / 1e9 if by else None,
                         of_copy_bw=by / (ms / 1e3) / bw if by else None))
    total_parts = sum(r_["ms"] for r_ in rows)
    blas = {}                                   # the same GEMMs through the other BLAS front end
    default = torch.backends.cuda.preferred_blas_library()
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        blas[lib] = {n: graph_ms(parts[n][0]) for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")}
    torch.backends.cuda.preferred_blas_library(default)
    attn = _attention_sweep(cache, q, b, attention.sm_scale)

    # the whole step: graph replay alone, and what one engine step adds on the host
    sampler = Sampler(dev)
    host_inputs = []                            # (into fresh buffers; the step reuses pinned ones)
    for _ in range(20):
        t0 = time.perf_counter()
        runner.decode_inputs(reqs, B)
        host_inputs.append(time.perf_counter() - t0)
    whole = {}                                  # the whole step's graph, per BLAS front end
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        run = ModelRunner(model, attention, max_model_len=args.ctx + 16, max_num_seqs=B)
        run.capture_cuda_graphs(sizes=[B])
        whole[lib] = _step_times(run, sampler, reqs)
        del run
    torch.backends.cuda.preferred_blas_library(default)
    replay, step = whole["cublas"]                 # torch's default front end
    wb = weight_bytes(model, B)
    roof = (wb + kv_read) / bw * 1e3
    info = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, batch=B, ctx=args.ctx,
                compressed=not args.uncompressed, compressible_fraction=frac, copy_bandwidth=bw,
                parts=rows, blas=blas, attention_variants=attn, sum_parts_ms=total_parts, replay_ms=replay,
                whole_step=whole, step_ms=step, host_inputs_ms=statistics.median(host_inputs) * 1e3,
                roofline_ms=roof, weight_bytes=wb, kv_bytes=kv_read)
    print(f"batch {B}, ctx {args.ctx}, compressed {not args.uncompressed}, compressible blocks {frac:.1%}, "
          f"copy bw {bw / 1e12:.2f} TB/s")
    print(f"{'part':20s} {'ms/step':>8s} {'GB':>7s} {'of bw':>6s}")
    for r_ in rows:
        e = f"{r_['of_copy_bw']:.0%}" if r_["of_copy_bw"] else ""
        print(f"{r_['part']:20s} {r_['ms']:8.3f} {r_['bytes'] / 1e9:7.2f} {e:>6s}")
    for lib, t in blas.items():
        print(f"{lib:20s} " + ", ".join(f"{n} {v:.3f}" for n, v in t.items()))
    for r_ in attn:
        print(f"attention splits {r_['splits']:2d} stages {r_['stages']}: {r_['ms']:.3f} ms")
    print(f"{'sum of parts':20s} {total_parts:8.3f}")
    print(f"{'graph replay':20s} {replay:8.3f}   (gaps = replay - sum: {replay - total_parts:.3f})")
    print(f"{'engine step':20s} {step:8.3f}   (host inputs {info['host_inputs_ms']:.3f})")
    for lib, (rp, st) in whole.items():
        print(f"whole step, {lib:9s} replay {rp:.3f} ms ({roof / rp:.1%} of roofline), "
              f"step {st:.3f} ms ({roof / st:.1%})")
    print(f"{'roofline':20s} {roof:8.3f}   step/roofline {roof / step:.1%}, "
          f"replay/roofline {roof / replay:.1%}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = f"profile_engine_b{B}{'_uncompressed' if args.uncompressed else ''}.json"
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(info, f, indent=1)


def _attention_sweep(cache, q, b, sm_scale):
    """Decode attention over all layers for split counts x stages (the kernel's knobs)."""
    rows = []
    for S in (3, 4, 5, 6, 8, 12):
        for stages in (3, 4) if not cache.kv_compression else (4, 6):
            ms = graph_ms(lambda: [cache_attention(cache, i, q, b, sm_scale, S, stages)
                                   for i in range(cache.num_layers)])
            rows.append(dict(splits=S, stages=stages, ms=ms))
    return rows


def cache_attention(cache, layer, q, b, sm_scale, splits, stages):
    from zipfusion.kernels import decode_attention, decode_attention_uncompressed
    kernel = decode_attention if cache.kv_compression else decode_attention_uncompressed
    return kernel(q, cache.arena, cache.page_loc[layer], b["block_table"], b["context_lens"],
                  cache.layout, sm_scale, validate=False, num_splits=splits, stages=stages)


def _step_times(runner, sampler, reqs, reps=15):
    """(graph replay ms, engine step ms): medians; the step = inputs + replay + sampling + sync."""
    params, gens = [r.params for r in reqs], [None] * len(reqs)
    for _ in range(3):
        sampler(runner.decode(reqs), params, gens).tolist()      # fills the graph's static inputs
    step = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        sampler(runner.decode(reqs), params, gens).tolist()
        step.append(time.perf_counter() - t0)
    replay = statistics.median(replay_seconds(runner.graphs[min(runner.graphs)], reps)) * 1e3
    return replay, statistics.median(step) * 1e3


if __name__ == "__main__":
    main()
