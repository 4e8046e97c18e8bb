"""Rounds 2-3 of the fused weight-format linear kernel (kernels/weight_linear.py): the plan's configs
(CONFIGS) against candidate tile configs on Llama-3.1-8B shapes at M = 1, 8, 32, 64, 128, beside
cuBLAS in the same process. Writes $OUT/weights_round2.json; prints the table last.

    PYTHONPATH=src python3 scripts/gpu/weights_round2.py [--precompile-only | --no-precompile]
"""

import json
import os
import sys
import time

import torch

from zipfusion.bench.weight_kernel import LinearCase
from zipfusion.kernels import weight_linear as wl
from weights_tune import timed      # noqa: E402 - this folder's sweep: the same timing

OUT = os.environ.get("OUT", ".")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = {"gate_up": (28672, 4096), "o": (4096, 4096), "down": (4096, 14336), "qkv": (6144, 4096)}
if DEV == "cpu":                                          # a dry run of this script (interpreter)
    SHAPES, MS = {"gate_up": (48, 256), "o": (32, 128)}, (1, 32)
BUDGET_S = float(os.environ.get("BUDGET_S", 170))          # timing stops here (the table still prints)
MS = (1, 8, 32, 64, 128)
# candidates per M bucket: name -> override of plan()'s config. Round 3: the Hopper kernel in Gluon
# (kernels/weight_gemm_sm90.py; BK 128; per_sm: programs per SM of the K split; split=1: none).
# Round 2 (bulk tensor copies, escapes per dot, 128-row tiles) timed the list of commit 497360c.
G = dict(sm90=True, BK=128, BN=64, warps=4, stages=3, per_sm=2)
CANDIDATES = {
    16: {"g64s4": dict(G, stages=4), "g64s4p4": dict(G, stages=4, per_sm=4), "g64s1": dict(G, split=1),
         "g64s2": dict(G, stages=2), "g128w8": dict(G, BN=128, warps=8, per_sm=1)},
    64: {"g64s3": dict(G), "g64s2": dict(G, stages=2), "g64s3p1": dict(G, per_sm=1), "g64s1": dict(G, split=1),
         "g128w8": dict(G, BN=128, warps=8, per_sm=1)},
}
CANDIDATES[32] = CANDIDATES[64]
CANDIDATES[128] = {k: v for k, v in CANDIDATES[64].items() if k != "g128w8"}   # over the shared memory


def _compile(jobs):
    """Worker: run each (N, M, override) once so the kernel lands in Triton's disk cache."""
    from zipfusion.format.weights import compress_weight
    n = 0
    for N, M, kw in jobs:
        w = (torch.randn(N, 4096, device="cuda") * 0.02).bfloat16()
        cw = compress_weight(w)
        x = torch.randn(M, 4096, device="cuda").bfloat16()
        for split in (1, 2):
            try:
                wl.fused_linear(x, cw, split=split, **kw)
                n += 1
            except Exception as e:  # noqa: BLE001 - reported again when timed
                print(f"    precompile failed {kw}: {type(e).__name__}: {str(e)[:100]}", file=sys.stderr)
    torch.cuda.synchronize()
    return n


def precompile(workers=14):
    import multiprocessing as mp
    jobs = [(N, M, kw) for M in (1, 32, 64, 128) for N in (4096, 28672)
            for kw in [{}] + list(CANDIDATES[wl._bucket(M)].values())]
    t = time.time()
    with mp.get_context("spawn").Pool(workers) as pool:
        n = sum(pool.map(_compile, [jobs[i::workers] for i in range(workers)]))
    print(f"precompiled {n} launches in {time.time() - t:.0f} s", flush=True)


def main():
    if DEV == "cuda" and "--no-precompile" not in sys.argv:
        precompile()
    if "--precompile-only" in sys.argv:
        return
    recs, t0 = [], time.time()
    for name, (N, K) in SHAPES.items():
        case = LinearCase(N, K, DEV, seed=N + K)
        for M in MS:
            if time.time() - t0 > BUDGET_S:
                print(f"budget spent: {name} M={M} and after not timed", flush=True)
                break
            x = case.x(M)
            ref = x.double() @ case.w[0].double().T
            row = dict(shape=name, N=N, K=K, M=M)
            row["cublas"] = timed(lambda i: torch.nn.functional.linear(x, case.w[i % case.sets]), case.sets)
            for cname, kw in [("default", {})] + list(CANDIDATES[wl._bucket(M)].items()):
                t = timed(lambda i: wl.fused_linear(x, case.cw[i % case.sets], **kw), case.sets)
                err = None
                if t is not None:
                    y = wl.fused_linear(x, case.cw[0], **kw).double()
                    err = ((y - ref).norm() / ref.norm()).item()
                counters = int(wl._counters(x.device).count_nonzero())     # each launch leaves them 0
                if counters:
                    print(f"    {name} M={M} {cname}: {counters} split-K counters left nonzero", flush=True)
                    wl._counters(x.device).zero_()
                recs.append(dict(row, kernel=cname, cfg=kw, ms=t, cublas_ms=row["cublas"], rel_err=err,
                                 counters_left=counters))
                row[cname] = t
            best = min((k for k in row if k not in ("shape", "N", "K", "M", "cublas") and row[k]),
                       key=lambda k: row[k])
            print(f"{name:8s} M={M:4d} cublas {row['cublas']:.4f} default {row['default'] or float('nan'):.4f} "
                  f"best {best} {row[best]:.4f} ({time.time() - t0:.0f} s)", flush=True)
            json.dump(recs, open(f"{OUT}/weights_round2.json", "w"), indent=1)
        del case
        if DEV == "cuda":
            torch.cuda.empty_cache()
    print("\nshape      M  cublas  default x_cub | best candidate (exact)   ms     x_cub rel_err | g64s1   g128w8")
    for name in SHAPES:
        for M in MS:
            rs = {r["kernel"]: r for r in recs if r["shape"] == name and r["M"] == M and r["ms"]}
            d = rs.get("default")
            if d is None:
                continue
            b = min(rs.values(), key=lambda r: r["ms"])
            m4 = [rs[k]["ms"] if k in rs else float("nan") for k in ("g64s1", "g128w8")]
            print(f"{name:8s} {M:4d} {d['cublas_ms']:.4f}  {d['ms']:.4f}  {d['cublas_ms'] / d['ms']:.2f} | "
                  f"{b['kernel']:18s} {b['ms']:.4f}  {b['cublas_ms'] / b['ms']:.2f}  {b['rel_err']:.1e} | "
                  f"{m4[0]:.4f} {m4[1]:.4f}")


if __name__ == "__main__":
    main()
