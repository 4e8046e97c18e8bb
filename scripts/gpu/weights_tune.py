"""Tuning sweep of the fused weight-format linear kernel (kernels/weight_linear.py) on the GPU:
operand variants (natural / permuted word order, swapped dot) x tile configs per M bucket, the
no-restore and plain-BF16 modes (what the restore costs; what the same kernel does on BF16),
cuBLAS alongside, restore + cuBLAS and the restore kernel's bandwidth at large M.
Writes $OUT/weights_tune.json; prints the best config per (shape, M) last.

    PYTHONPATH=src python3 scripts/gpu/weights_tune.py [--quick] [--precompile-only | --no-precompile]
"""

import itertools
import json
import os
import sys
import time

import torch

from zipfusion.bench.kernel import copy_bandwidth, time_calls
from zipfusion.bench.weight_kernel import LinearCase
from zipfusion.kernels import weight_linear as wl

OUT = os.environ.get("OUT", ".")
DEV = "cuda" if torch.cuda.is_available() else "cpu"      # cpu: a dry run of this script (interpreter)
SHAPES = {"o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)} if DEV == "cuda" else \
    {"o": (32, 256), "gate_up": (48, 256), "down": (16, 384)}
# (BN, BK, warps, stages) per M bucket; the ones whose shared memory fits (checked by compiling for sm_90)
TILES = {16: [(64, 128, 4, 3), (64, 256, 4, 4), (128, 128, 8, 3), (128, 256, 8, 3), (32, 256, 4, 4)],
         32: [(64, 128, 4, 3), (64, 256, 4, 4), (128, 128, 8, 3), (128, 256, 8, 3), (32, 256, 4, 4)],
         64: [(64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 8, 3), (32, 256, 4, 4)],
         128: [(64, 128, 4, 3), (128, 128, 8, 3), (64, 128, 8, 4)]}
BIG_TILES = [(128, 128, 8, 3), (64, 128, 8, 4)]


def configs(M):
    """16: both word orders x both dot orientations; 64 and 128: both orientations; 32: swapped."""
    bm = wl._bucket(M)
    for (bn, bk, w, s) in TILES[bm]:
        for nat, swap in itertools.product((True, False) if bm == 16 else (True,),
                                           (True,) if bm == 32 else (True, False)):
            yield dict(BN=bn, BK=bk, warps=w, stages=s, natural=nat, swap=swap)


def _compile(jobs):
    """Worker: run each (N, M, kwargs) once on a small weight of N rows, so the kernel lands in
    Triton's disk cache (N decides the config's width class)."""
    from zipfusion.format.weights import compress_weight
    weights = {}
    n = 0
    for N, M, kw in jobs:
        if N not in weights:
            w = (torch.randn(N, 1024, device="cuda") * 0.02).bfloat16()
            weights[N] = w, compress_weight(w)
        w, cw = weights[N]
        x = torch.randn(M, 1024, device="cuda").bfloat16()
        for split, reduce in ((1, 2), (2, 1), (2, 2)):
            try:
                wl.fused_linear(x, cw, split=split, reduce=reduce, plain=w if kw.get("mode") == 2 else None, **kw)
                n += 1
            except Exception as e:  # noqa: BLE001 - reported again when timed
                print(f"    precompile failed {kw}: {type(e).__name__}: {str(e)[:100]}", file=sys.stderr)
    torch.cuda.synchronize()
    return n


def precompile(variants=False, workers=14):
    """Every variant the sweep (or ``variants``: restore_variants) times, compiled by ``workers``
    processes at once (the timing run then loads them from the cache)."""
    import multiprocessing as mp
    if variants:
        jobs = [(N, M, dict(mode=mode)) for N in (256, 20000) for M in (1, 32, 64, 128) for mode in (0, 1, 2, 3)]
    else:
        jobs = [(256, M, cfg) for M in (1, 32, 64, 128) for cfg in configs(M)]
        jobs += [(256, 128, dict(BN=bn, BK=bk, warps=w, stages=s, natural=True, swap=False, BM=128))
                 for bn, bk, w, s in BIG_TILES]
    chunks = [jobs[i::workers] for i in range(workers)]
    t = time.time()
    with mp.get_context("spawn").Pool(workers) as pool:
        n = sum(pool.map(_compile, chunks))
    print(f"precompiled {n} variants in {time.time() - t:.0f} s", flush=True)


def timed(fn, sets):
    try:
        fn(0)
        if DEV == "cuda":
            torch.cuda.synchronize()
        t, spread, how = time_calls(fn, sets, device=DEV)
        return t * 1e3
    except Exception as e:  # noqa: BLE001 - a config that does not compile or fit: recorded
        print(f"    failed: {type(e).__name__}: {str(e)[:160]}", file=sys.stderr)
        if DEV == "cuda":
            torch.cuda.synchronize()
        return None


def restore_variants():
    """The tuned kernel (plan's config) with its restore whole (mode 0), without the d = 0 test
    (mode 3, the KV format's restore), skipped (mode 1), and on plain BF16 (mode 2), vs cuBLAS."""
    recs = []
    print("\nshape     M  cublas_ms  fused  no-d0-test  no-restore  plain-bf16   (ms; x cuBLAS of fused)")
    for name in ("o", "gate_up"):
        N, K = SHAPES[name]
        case = LinearCase(N, K, DEV, seed=N + K)
        for M in (1, 16, 64, 128):
            x = case.x(M)
            t_cub = timed(lambda i: torch.nn.functional.linear(x, case.w[i % case.sets]), case.sets)
            ts = {}
            for mode in (0, 3, 1, 2):
                ts[mode] = timed(lambda i: wl.fused_linear(x, case.cw[i % case.sets], mode=mode,
                                                           plain=case.w[i % case.sets] if mode == 2 else None),
                                 case.sets)
                recs.append(dict(shape=name, N=N, K=K, M=M, kernel=f"plan_mode{mode}", ms=ts[mode], cublas_ms=t_cub))
            print(f"{name:8s} {M:4d} {t_cub:9.4f} {ts[0]:8.4f} {ts[3]:8.4f} {ts[1]:8.4f} {ts[2]:8.4f}   "
                  f"x{t_cub / ts[0]:.3f}", flush=True)
        x = case.x(1)                                     # M = 1: does the split (the last wave) matter?
        line = f"{name} M=1 by split:"
        for split in (1, 2, 4, 8, 16):
            t = timed(lambda i: wl.fused_linear(x, case.cw[i % case.sets], split=split), case.sets)
            recs.append(dict(shape=name, N=N, K=K, M=1, kernel="plan_split", split=split, ms=t))
            line += f" {split}: {t if t else float('nan'):.4f}"
        print(line, flush=True)
        del case
    json.dump(recs, open(f"{OUT}/weights_restore_variants.json", "w"), indent=1)


def main():
    if "--restore-variants" in sys.argv:
        if DEV == "cuda" and "--no-precompile" not in sys.argv:
            precompile(variants=True)
        return None if "--precompile-only" in sys.argv else restore_variants()
    quick = "--quick" in sys.argv
    recs = []
    t_start = time.time()
    if DEV == "cuda" and "--no-precompile" not in sys.argv:
        precompile()
    if "--precompile-only" in sys.argv:
        return
    ceiling = copy_bandwidth(DEV)
    print(f"copy ceiling {ceiling / 1e9:.0f} GB/s", flush=True)
    for name, (N, K) in SHAPES.items():
        case = LinearCase(N, K, DEV, seed=N + K)
        print(f"{name} [{N}x{K}] escapes {case.escape_share:.2e} stored {case.comp_bytes / case.bf16_bytes:.4f} "
              f"sets {case.sets}", flush=True)
        for M in (1, 16, 32, 64, 128, 256):
            if quick and M not in (1, 64, 256):
                continue
            x = case.x(M)
            ref = torch.nn.functional.linear(x, case.w[0]).float()
            t_cub = timed(lambda i: torch.nn.functional.linear(x, case.w[i % case.sets]), case.sets)
            recs.append(dict(shape=name, N=N, K=K, M=M, kernel="cublas", ms=t_cub))
            best = None
            for cfg in itertools.islice(configs(M), None if DEV == "cuda" else 2):
                sms = wl._sm_count(0) if DEV == "cuda" else 4
                auto = wl.plan(M, N, case.cw[0].padded_k, sms, **cfg)["split"]
                for split, reduce in sorted({(1, 2), (auto, 2), (2 * auto, 2), (max(2, auto), 1)}):
                    kw = dict(cfg, split=split, reduce=reduce)
                    t = timed(lambda i: wl.fused_linear(x, case.cw[i % case.sets], **kw), case.sets)
                    err = None
                    if t is not None:
                        y = wl.fused_linear(x, case.cw[0], **kw).float()
                        err = ((y - ref).norm() / ref.norm()).item()
                    r = dict(shape=name, N=N, K=K, M=M, kernel="fused", ms=t, cfg=kw,
                             split=wl.plan(M, N, case.cw[0].padded_k, sms, **kw)["split"], rel_err=err, x_cublas=(t_cub / t if t and t_cub else None),
                             GBps=(case.comp_bytes / (t / 1e3) / 1e9 if t else None))
                    recs.append(r)
                    if t and (best is None or t < best["ms"]):
                        best = r
            if best:
                default = {}                             # the plan's choice
                for mode in (0, 1, 2):
                    t = timed(lambda i: wl.fused_linear(x, case.cw[i % case.sets], mode=mode,
                                                        plain=case.w[i % case.sets] if mode == 2 else None,
                                                        **default), case.sets)
                    recs.append(dict(shape=name, N=N, K=K, M=M, kernel=f"default_mode{mode}", ms=t, cfg=default,
                                     x_cublas=(t_cub / t if t and t_cub else None)))
                print(f"  M={M:4d} cublas {t_cub:.4f} ms  best fused {best['ms']:.4f} ms x{best['x_cublas']:.3f} "
                      f"{best['GBps']:.0f} GB/s err {best['rel_err']:.1e} {best['cfg']} split {best['split']} | "
                      + " ".join(f"{r['kernel']} {r['ms']:.4f}" for r in recs[-3:] if r["ms"]), flush=True)
            json.dump(recs, open(f"{OUT}/weights_tune.json", "w"), indent=1)
        # large M: cuBLAS vs restore + cuBLAS vs the fused kernel, and the restore's bandwidth
        if name in ("o", "gate_up"):
            t = timed(lambda i: wl.restore_into(case.cw[i % case.sets], case.buf), case.sets)
            recs.append(dict(shape=name, N=N, K=K, M=0, kernel="restore", ms=t,
                             GBps=(case.comp_bytes + case.bf16_bytes) / (t / 1e3) / 1e9))
            print(f"  restore {t:.4f} ms {(case.comp_bytes + case.bf16_bytes) / (t / 1e3) / 1e9:.0f} GB/s", flush=True)
            for M in (() if quick else (512, 2048, 8192)):
                x = case.x(M)
                t_cub = timed(lambda i: torch.nn.functional.linear(x, case.w[i % case.sets]), case.sets)
                t_rc = timed(lambda i: torch.nn.functional.linear(x, wl.restore_into(case.cw[i % case.sets], case.buf)),
                             case.sets)
                line = f"  M={M:5d} cublas {t_cub:.4f} restore+cublas {t_rc:.4f} (x{t_cub / t_rc:.3f})"
                recs.append(dict(shape=name, N=N, K=K, M=M, kernel="cublas", ms=t_cub))
                recs.append(dict(shape=name, N=N, K=K, M=M, kernel="restore_cublas", ms=t_rc, x_cublas=t_cub / t_rc))
                for bn, bk, w, s in BIG_TILES:
                    kw = dict(BN=bn, BK=bk, warps=w, stages=s, natural=True, swap=False, BM=128)
                    t = timed(lambda i: wl.fused_linear(x, case.cw[i % case.sets], **kw), case.sets)
                    recs.append(dict(shape=name, N=N, K=K, M=M, kernel="fused", ms=t, cfg=kw,
                                     x_cublas=(t_cub / t if t else None)))
                    line += f" fused{bn}/{w}w {t if t else float('nan'):.4f}"
                if name == "gate_up" and DEV == "cuda":           # the restore beside a GEMM on a second stream
                    side, buf2 = torch.cuda.Stream(), torch.empty_like(case.buf)

                    def both(i):
                        cur = torch.cuda.current_stream()
                        side.wait_stream(cur)
                        with torch.cuda.stream(side):
                            wl.restore_into(case.cw[(i + 1) % case.sets], buf2)
                        y = torch.nn.functional.linear(x, case.w[i % case.sets])
                        cur.wait_stream(side)
                        return y
                    t_ov = timed(both, case.sets)
                    recs.append(dict(shape=name, N=N, K=K, M=M, kernel="cublas_with_side_restore", ms=t_ov,
                                     x_cublas=(t_cub / t_ov if t_ov else None)))
                    line += f" cublas||restore {t_ov if t_ov else float('nan'):.4f}"
                print(line, flush=True)
        json.dump(recs, open(f"{OUT}/weights_tune.json", "w"), indent=1)
        del case
        if DEV == "cuda":
            torch.cuda.empty_cache()
        print(f"  ({time.time() - t_start:.0f} s)", flush=True)
    json.dump(recs, open(f"{OUT}/weights_tune.json", "w"), indent=1)
    print("\nshape     M  cublas_ms fused_ms  x_cublas  default: fused no-restore plain-bf16  best cfg")
    for name in SHAPES:
        for M in (1, 16, 32, 64, 128, 256):
            rs = [r for r in recs if r["shape"] == name and r["M"] == M]
            fused = [r for r in rs if r["kernel"] == "fused" and r["ms"]]
            if not fused:
                continue
            b = min(fused, key=lambda r: r["ms"])
            cub = next(r["ms"] for r in rs if r["kernel"] == "cublas")
            m0, m1, m2 = (next((r["ms"] for r in rs if r["kernel"] == f"default_mode{i}" and r["ms"]), float("nan"))
                          for i in range(3))
            c = b["cfg"]
            print(f"{name:8s} {M:4d} {cub:9.4f} {b['ms']:8.4f} {cub / b['ms']:8.3f} {m0:8.4f} {m1:8.4f} {m2:8.4f}   "
                  f"BN{c['BN']} BK{c['BK']} w{c['warps']} s{c['stages']} nat{int(c['natural'])} "
                  f"swap{int(c['swap'])} split{b['split']} reduce{c.get('reduce')}")


if __name__ == "__main__":
    main()
