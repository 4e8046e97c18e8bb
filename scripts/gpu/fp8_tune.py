"""The FP8 decode kernels' launch choices on this GPU (issue 47; ``--kernel fp8_lossless``: the kernel
over pages in the lossless FP8 block format): tile pages x warps x pipeline
stages, timed as `zipfusion bench kernel` times (a CUDA graph of many calls over rotated inputs,
median), beside the BF16 Triton kernel over the same values' open pages at its defaults. Every
variant's output is checked bit-equal to the default's (the tile and the splits fix the sums'
order, so only configs with the same tile are compared). Prints one line a variant, a table last.
    PYTHONPATH=src python3 scripts/gpu/fp8_tune.py [--out fp8_tune.json]
"""
import argparse
import itertools
import json
import sys

import torch

from zipfusion.bench.kernel import Case, Pool, time_calls

ap = argparse.ArgumentParser()
ap.add_argument("--out", default=None)
ap.add_argument("--cases", default="32x8192,64x8192")
ap.add_argument("--kernel", default="fp8", choices=("fp8", "fp8_lossless"))
ap.add_argument("--tiles", default="2,4,8")
args = ap.parse_args()
pool = Pool(1.0, seed=101)
rows = []
for spec in args.cases.split(","):
    B, ctx = map(int, spec.split("x"))
    case = Case(pool, B, ctx, seed=B * 7 + ctx)
    base = {}
    for name, fn in (("bf16_triton", lambda i, **kw: case.run_uncompressed(i, backend="triton", **kw)),
                     ("fp8", case.run_fp8)):
        t, _, _ = time_calls(fn, case.sets)
        rows.append(dict(batch=B, context=ctx, kernel=name, tile_pages=None, num_warps=None, num_stages=None,
                         ms=t * 1e3))
        base[name] = t
        print(f"B{B} ctx{ctx} {name} default {t * 1e3:.4f} ms", file=sys.stderr, flush=True)
    ref = {}
    if args.kernel == "fp8_lossless":
        t, _, _ = time_calls(case.run_fp8_lossless, case.sets)
        rows.append(dict(batch=B, context=ctx, kernel="fp8_lossless", tile_pages=None, num_warps=None,
                         num_stages=None, ms=t * 1e3))
        print(f"B{B} ctx{ctx} fp8_lossless default {t * 1e3:.4f} ms", file=sys.stderr, flush=True)
    run = getattr(case, f"run_{args.kernel}")
    for tp, w, st in itertools.product(map(int, args.tiles.split(",")), (4, 8), (1, 2)):
        kw = dict(tile_pages=tp, num_warps=w, num_stages=st)
        try:
            o = run(0, **kw).clone()
            same = bool(torch.equal(o, ref.setdefault(tp, o)))
            t, _, _ = time_calls(lambda i: run(i, **kw), case.sets)
        except Exception as e:  # noqa: BLE001 - a config that does not compile (shared memory): noted
            print(f"B{B} ctx{ctx} {args.kernel} {kw}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
            continue
        rows.append(dict(batch=B, context=ctx, kernel=args.kernel, **kw, ms=t * 1e3, same_bits_as_tile=same,
                         x_default=base["fp8"] / t))
        print(f"B{B} ctx{ctx} {args.kernel} {kw} {t * 1e3:.4f} ms x{base['fp8'] / t:.2f} same={same}",
              file=sys.stderr, flush=True)
    del case
    torch.cuda.empty_cache()
if args.out:
    json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(args.out, "w"), indent=1)
print("| batch | context | kernel | tile | warps | stages | ms | x fp8 default |\n|---|---|---|---|---|---|---|---|")
for B in sorted({r["batch"] for r in rows}):
    rs = [r for r in rows if r["batch"] == B]
    best = sorted((r for r in rs if r["tile_pages"]), key=lambda r: r["ms"])[:3]
    for r in [r for r in rs if not r["tile_pages"]] + best:
        print(f"| {r['batch']} | {r['context']} | {r['kernel']} | {r['tile_pages']} | {r['num_warps']} | "
              f"{r['num_stages']} | {r['ms']:.4f} | {r.get('x_default', 1.0):.2f} |")
