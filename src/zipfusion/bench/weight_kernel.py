"""``zipfusion bench kernel --linear``: linear layers over compressed weights against cuBLAS over
BF16, each case a CUDA graph of many calls (``--device cpu``: an interpreter smoke run).
"""

from __future__ import annotations

import sys

import torch

from ..format.weights import compress_weight
from ..kernels import weight_linear as wl
from . import report
from .kernel import copy_bandwidth, time_calls

SHAPES = {
    "llama-3.1-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                     "down": (4096, 14336), "lm_head": (128256, 4096)},
    "qwen3-32b": {"qkv": (10240, 5120), "o": (5120, 8192), "gate_up": (51200, 5120),
                  "down": (5120, 25600), "lm_head": (151936, 5120)},
}
SMOKE_SHAPES = {"tiny": {"a": (40, 300)}}
M_LIST = [1, 8, 32, 64, 128, 256, 2048, 8192]
SMOKE_M = [1, 20]
ROTATE_BYTES = 512 << 20
STD = 0.02


class LinearCase:
    """``sets`` copies of one Gaussian BF16 weight [N, K], plain and compressed, and a restore buffer."""

    def __init__(self, N, K, device, seed=0):
        g = torch.Generator(device=device).manual_seed(seed)
        w = (torch.randn(N, K, generator=g, device=device) * STD).bfloat16()
        cw = compress_weight(w)
        self.N, self.K, self.device = N, K, torch.device(device)
        self.bf16_bytes, self.comp_bytes = cw.original_nbytes, cw.nbytes
        self.escape_share = cw.num_escapes / (N * K)
        self.sets = max(2, min(16, -(-ROTATE_BYTES // self.comp_bytes))) if self.device.type == "cuda" else 1
        self.w = [w] + [w.clone() for _ in range(self.sets - 1)]
        self.cw = [cw] + [type(cw)(cw.shape, **{k: v.clone() for k, v in cw.tensors().items()})
                          for _ in range(self.sets - 1)]
        self.buf = torch.empty(N, K, dtype=torch.bfloat16, device=device)

    def x(self, M, seed=1):
        g = torch.Generator(device=self.device).manual_seed(seed)
        return torch.randn(M, self.K, generator=g, device=self.device).bfloat16()

    def fns(self, x):
        return {"cublas": lambda i: torch.nn.functional.linear(x, self.w[i % self.sets]),
                "fused": lambda i: wl.fused_linear(x, self.cw[i % self.sets]),
                "weight_linear": lambda i: wl.weight_linear(x, self.cw[i % self.sets]),
                "restore_cublas": lambda i: torch.nn.functional.linear(
                    x, wl.restore_into(self.cw[i % self.sets], self.buf))}

    def traffic(self, kernel, M):
        """Bytes a kernel must move at least: weights read, x read, y written (restore: W written)."""
        io = 2 * M * (self.K + self.N)
        restored = self.comp_bytes + 2 * self.bf16_bytes + io
        return {"cublas": self.bf16_bytes + io, "fused": self.comp_bytes + io,
                "weight_linear": self.comp_bytes + io if M <= wl.FUSED_MAX_M else restored,
                "restore_cublas": restored,
                "restore": self.comp_bytes + self.bf16_bytes}[kernel]


def measure(case: LinearCase, M: int, kernels, device) -> list[dict]:
    x = case.x(M)
    fns = case.fns(x)
    recs, ref = [], None
    for name in kernels:
        if name == "restore":
            fn = lambda i: wl.restore_into(case.cw[i % case.sets], case.buf)  # noqa: E731
        else:
            fn = fns[name]
        out = fn(0)
        if name == "cublas":
            ref = out.float()
        big = M >= 2048  # compute-bound: stable; fewer replays keep the run short
        t, spread, how = time_calls(fn, case.sets, reps=5 if big else 11, min_inner=3 if big else 10, device=device)
        r = dict(kernel=name, M=M, median_ms=t * 1e3, spread_ms=spread * 1e3, timing=how,
                 bytes=case.traffic(name, M))
        r["achieved_GBps"] = r["bytes"] / t / 1e9
        if name == "restore":
            r["bit_identical"] = bool(torch.equal(case.buf.view(torch.int16), case.w[0].view(torch.int16)))
        elif ref is not None and name != "cublas":
            r["rel_err_vs_cublas"] = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        recs.append(r)
    return recs


def plot(result: dict, path: str) -> bool:
    rows = [r for r in result["cases"] if r.get("cublas/fused")]
    return report.speed_bars(
        path, [f"{r['model'][:5]} {r['layer']}\nM{r['M']}" for r in rows],
        {label: [r.get(key) for r in rows] for key, label in (("cublas/fused", "cuBLAS / fused"),
                                                              ("cublas/weight_linear", "cuBLAS / weight_linear"))},
        f"compressed-weight linear layers, {result['meta']['device_name']}", "speed vs cuBLAS BF16 (x)",
        tick_fontsize=5, goal=1.25, annotate=False)


COLUMNS = [("model", "model", "{}"), ("layer", "layer", "{}"), ("N", "N", "{}"), ("K", "K", "{}"),
           ("M", "M", "{}"), ("cublas", "cuBLAS ms", "{:.4f}"), ("fused", "fused ms", "{:.4f}"),
           ("restore_cublas", "restore+cuBLAS ms", "{:.4f}"), ("weight_linear", "weight_linear ms", "{:.4f}"),
           ("cublas/fused", "x fused", "{:.3f}"), ("cublas/weight_linear", "x weight_linear", "{:.3f}"),
           ("fused_GBps", "fused GB/s", "{:.0f}")]


def run(args, device: str) -> int:
    smoke = not device.startswith("cuda")
    if smoke and args.device in (None, "auto"):
        raise ValueError("zipfusion bench kernel --linear needs a CUDA GPU (no GPU is visible); --device cpu runs "
                         "a tiny smoke test through the Triton interpreter, whose timings mean nothing")
    from .kernel import parse_list
    models = [m for m in args.models.split(",") if m]
    if not models or any(m not in SHAPES for m in models):
        raise ValueError(f"--models takes comma-separated of {', '.join(SHAPES)}, got {args.models!r}")
    ms = parse_list(args.ms, int, "--ms", 1)
    table = SHAPES
    if smoke:
        models, table, ms = ["tiny"], SMOKE_SHAPES, SMOKE_M
        print("smoke run on the CPU (Triton interpreter, one tiny shape): the timings mean nothing", file=sys.stderr)
    meta = report.run_meta("kernel", args.argv, device)
    ceiling = copy_bandwidth(device)
    records, cases = [], []
    for model in models:
        for layer, (N, K) in table[model].items():
            case = LinearCase(N, K, device, seed=N + K)
            recs = measure(case, ms[0], ["restore"], device)
            for M in ms:
                kernels = ["cublas", "fused", "weight_linear"] + (["restore_cublas"] if M > 256 or smoke else [])
                recs += measure(case, M, kernels, device)
            row_by_m = {}
            for r in recs:
                r.update(model=model, layer=layer, N=N, K=K, escape_share=case.escape_share,
                         stored_ratio=case.comp_bytes / case.bf16_bytes)
                if r["kernel"] == "restore":
                    continue
                row = row_by_m.setdefault(r["M"], {"model": model, "layer": layer, "N": N, "K": K, "M": r["M"],
                                                   "escape_share": case.escape_share})
                row[r["kernel"]] = r["median_ms"]
                if r["kernel"] == "fused":
                    row["fused_GBps"] = r["achieved_GBps"]
            for row in row_by_m.values():
                for k in ("fused", "weight_linear", "restore_cublas"):
                    row[f"cublas/{k}"] = row["cublas"] / row[k] if row.get(k) else None
                cases.append(row)
            records += recs
            print(f"{model} {layer} [{N}x{K}] escapes {case.escape_share:.2e}: "
                  + ", ".join(f"M{r['M']} x{r['cublas/fused']:.2f}" for r in row_by_m.values()),
                  file=sys.stderr, flush=True)
            del case
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    result = {"meta": meta, "config": {"models": models, "ms": ms, "std": STD, "smoke": smoke,
                                       "fused_max_m": wl.FUSED_MAX_M, "copy_ceiling_GBps": ceiling / 1e9,
                                       "configs": {str(k): v for k, v in wl.CONFIGS.items()}},
              "records": records, "cases": cases}
    print(report.save(result, args.out, plot))
    print(report.text_table(cases, COLUMNS))
    print("x fused / x weight_linear: cuBLAS's time / ours (above 1: ours is faster)")
    return 0
