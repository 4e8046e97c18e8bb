"""The K split (run from the repository root: PYTHONPATH=src python3 scripts/gpu/weights_split.py) of the Hopper weight kernel: cuBLAS / ours per split on Llama-8B shapes (wave quantization)."""
import json, os, sys, time
import torch
sys.path.insert(0, "scripts/gpu")
from zipfusion.bench.weight_kernel import LinearCase
from zipfusion.kernels import weight_linear as wl
from weights_tune import timed
OUT = os.environ.get("OUT", ".")
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 14336), "gate_up": (28672, 4096)}
recs, t0 = [], time.time()
for name, (N, K) in SHAPES.items():
    case = LinearCase(N, K, "cuda", seed=N + K)
    for M in (1, 8, 32, 64):
        if time.time() - t0 > float(os.environ.get("BUDGET_S", 100)):
            break
        x = case.x(M)
        cub = timed(lambda i: torch.nn.functional.linear(x, case.w[i % case.sets]), case.sets)
        d = wl.plan(M, N, K, wl._sm_count(0), hopper=True)
        row = dict(shape=name, M=M, cublas=cub, default_split=d["split"], ms={})
        for s in sorted({1, 2, 3, 4, 5, 6, 8, 11, 16} | {d["split"]}):
            if name == "gate_up" and s > 4:
                continue
            t = timed(lambda i: wl.fused_linear(x, case.cw[i % case.sets], split=s), case.sets)
            row["ms"][s] = t
        recs.append(row)
        best = min((k for k in row["ms"] if row["ms"][k]), key=lambda k: row["ms"][k])
        print(f"{name:8s} M={M:3d} cublas/ours default(split {d['split']}) {cub / row['ms'][d['split']]:.2f}  best split {best} "
              f"{cub / row['ms'][best]:.2f} | " + " ".join(f"{k}:{cub / v:.2f}" for k, v in row["ms"].items() if v), flush=True)
    del case; torch.cuda.empty_cache()
json.dump(recs, open(f"{OUT}/split_sweep.json", "w"), indent=1)
