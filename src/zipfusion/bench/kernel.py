"""``zipfusion bench kernel``: decode attention over compressed KV against the uncompressed kernel,
FlashInfer and the FP8 kernels on CUDA, each a CUDA graph of many calls over inputs rotated past
L2. ``--device cpu`` is an interpreter smoke run whose timings mean nothing.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import torch

from ..analysis.synthetic import compressible_fraction, model_like_pages, pages_with_fraction
from ..format import PageLayout, encode_pages_into, page_sizes
from ..format.fp8 import Fp8PageLayout, quantize_e4m3
from ..format.fp8_blocks import encode_fp8_page
from ..kernels import decode_attention, decode_attention_uncompressed
from . import report

PS = 16
REAL_MODEL_FRACTION = 0.92    # a trained model's statistics (model_like_pages; docs/real_model.md)
ROTATE_BYTES = 512 << 20      # rotate input copies until this much data is touched
KERNELS = {"uncompressed": ("run_uncompressed", {}, "open"), "fused": ("run_fused", {}, "compressed"),
           "uncompressed_triton": ("run_uncompressed", {"backend": "triton"}, "open"),
           "fused_triton": ("run_fused", {"backend": "triton"}, "compressed"),
           "fp8": ("run_fp8", {}, "fp8"), "fp8_lossless": ("run_fp8_lossless", {}, "fp8_lossless")}
MODE_KERNELS = {"compressed": "fused", "uncompressed": "uncompressed", "fp8": "fp8",
                "fp8_lossless": "fp8_lossless"}
FLASHINFER_KV = {"flashinfer": torch.bfloat16, "flashinfer_fp8": torch.float8_e4m3fn}  # FlashInfer's: pages' dtype


@dataclasses.dataclass(frozen=True)
class Shape:
    hq: int = 32
    hkv: int = 8
    d: int = 128
    pool: int = 1024

    @property
    def layout(self) -> PageLayout:
        return PageLayout(self.hkv, self.d)


LLAMA = Shape()
SMOKE = Shape(2, 1, 64, pool=8)


def copy_bandwidth(device="cuda", nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second); NaN off the GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return float("nan")
    x = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    ts = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    del x, y
    return 2 * nbytes / statistics.median(ts)


def time_calls(fn, n_sets, reps=11, min_inner=10, device="cuda"):
    """Median seconds per call of fn(i) as a CUDA graph (on the CPU: one call, host clock)."""
    if torch.device(device).type != "cuda":
        t0 = time.perf_counter()
        fn(0)
        return time.perf_counter() - t0, 0.0, "host clock, one call"
    n_inner = max(min_inner, n_sets)
    n_inner = -(-n_inner // n_sets) * n_sets
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(min(3, n_inner)):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(n_inner):
                fn(i)
        run, how = g.replay, "graph"
    except Exception as e:  # fall back to eager launches, and say so
        print(f"  (graph capture failed: {type(e).__name__}: {e}; timing eager launches)", file=sys.stderr)
        torch.cuda.synchronize()

        def run():
            for i in range(n_inner):
                fn(i)
        how = "eager"
    run()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3 / n_inner)
    return statistics.median(ts), (max(ts) - min(ts)), how


class Pool:
    """``shape.pool`` distinct pages with a given compressible fraction, open and encoded."""

    def __init__(self, fraction, seed, shape: Shape = LLAMA, device="cuda"):
        self.shape, self.device = shape, torch.device(device)
        n, layout = shape.pool, shape.layout
        if fraction == REAL_MODEL_FRACTION:
            self.pages = model_like_pages(n, shape.hkv, shape.d, seed=seed).to(self.device)
        else:
            self.pages = pages_with_fraction(n, shape.hkv, shape.d, fraction, seed=seed).to(self.device)
        self.fraction = compressible_fraction(self.pages[:64].cpu())
        self.sizes = page_sizes(self.pages)
        raw = n * layout.open_page_bytes
        self.formats = {"stored_ratio": float(self.sizes.sum()) / raw,
                        "stored_ratio_v1": float(page_sizes(self.pages, version=1).sum()) / raw,
                        "compressible_fraction_v1": compressible_fraction(self.pages[:64].cpu(), 1)}
        self.offsets = torch.cumsum(self.sizes, 0) - self.sizes
        self.buf = torch.empty(int(self.sizes.sum()), dtype=torch.uint8, device=self.device)
        encode_pages_into(self.pages, self.buf, self.offsets)
        self._fp8 = None

    @property
    def fp8_encoded(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The pages as E4M3 (scale 1), encoded in the lossless FP8 block format, and their sizes."""
        if self._fp8 is None:
            blobs = [encode_fp8_page(p) for p in quantize_e4m3(self.pages).cpu()]
            sizes = torch.tensor([b.numel() for b in blobs])
            padded = [torch.nn.functional.pad(b, (0, -b.numel() % 16)).to(self.device) for b in blobs]
            self._fp8 = padded, sizes.to(self.device)
        return self._fp8


class Case:
    """B requests of ctx tokens: open caches and compressed arenas."""

    def __init__(self, pool: Pool, B, ctx, seed=0):
        self.B, self.ctx, self.shape, dev = B, ctx, pool.shape, pool.device
        self.layout = layout = pool.shape.layout
        npr = -(-ctx // PS)
        P = B * npr
        reps = -(-P // pool.shape.pool)
        idx = torch.arange(P, device=dev) % pool.shape.pool
        self.open_bytes = P * layout.open_page_bytes
        self.sets = max(1, min(64, -(-ROTATE_BYTES // self.open_bytes))) if dev.type == "cuda" else 1
# open caches: FlashInfer's NHD paged layout
        self.kv = pool.pages[idx].unsqueeze(0).repeat(self.sets, 1, 1, 1, 1, 1)
        self.loc_o = torch.arange(P, device=dev, dtype=torch.int64) * layout.open_page_bytes | 1
        arena = pool.buf.repeat(reps)
        sizes = pool.sizes[idx]
        self.loc_c = torch.cumsum(sizes, 0) - sizes
        self.comp_bytes = int(sizes.sum())
        arena = arena[:self.comp_bytes]
        self.arena_c = arena.unsqueeze(0).repeat(self.sets, 1)
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.bt = torch.randperm(P, generator=g).view(B, npr).to(torch.int32).to(dev)
        self.lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
        self.q = torch.randn(B, self.shape.hq, self.shape.d, generator=g).to(torch.bfloat16).to(dev)
        self.out = torch.empty_like(self.q)
        self.P = P
        self.idx = idx
        self.pool = pool
        self._kv8 = None
        self._fp8l = None

    @property
    def kv8(self) -> torch.Tensor:
        """The open caches as E4M3 (scale 1), made once."""
        if self._kv8 is None:
            self._kv8 = quantize_e4m3(self.kv)
        return self._kv8

    def traffic(self, kind: str) -> tuple[int, int]:
        """(bytes read, bytes written) of a kernel reading ``kind`` pages."""
        if kind == "fp8_lossless":
            return int(self.fp8l[2]), 0
        return {"open": (self.open_bytes, 0), "compressed": (self.comp_bytes, 0), "fp8": (self.open_bytes // 2, 0),
                "unfused": (self.comp_bytes + self.open_bytes, self.open_bytes)}[kind]

    @property
    def fp8l(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The E4M3 pages encoded in the lossless FP8 block format: (arenas, locations, bytes)."""
        if self._fp8l is None:
            blobs, sizes = self.pool.fp8_encoded
            lengths = torch.tensor([b.numel() for b in blobs], device=self.q.device)[self.idx]
            loc = torch.cumsum(lengths, 0) - lengths
            arena = torch.cat(blobs).repeat(-(-self.P // len(blobs)))[:int(lengths.sum())]
            self._fp8l = arena.unsqueeze(0).repeat(self.sets, 1), loc, int(sizes[self.idx].sum())
        return self._fp8l


    def arena_o(self, i):
        return self.kv[i % self.sets].view(-1).view(torch.uint8)

    def run_uncompressed(self, i, **kw):
        return decode_attention_uncompressed(self.q, self.arena_o(i), self.loc_o, self.bt, self.lens,
                                     self.layout, self.shape.d ** -0.5, self.out, validate=False, **kw)

    def run_fused(self, i, **kw):
        return decode_attention(self.q, self.arena_c[i % self.sets], self.loc_c, self.bt,
                                self.lens, self.layout, self.shape.d ** -0.5, self.out, validate=False, **kw)

    def run_fp8(self, i, **kw):
        from ..kernels.fp8_attention import decode_attention_fp8
        layout = Fp8PageLayout(self.shape.hkv, self.shape.d)
        loc = self.loc_o // 2 | 1
        return decode_attention_fp8(self.q, self.kv8[i % self.sets].view(-1), loc, self.bt, self.lens, layout,
                                    self.shape.d ** -0.5, self.out, validate=False, **kw)

    def run_fp8_lossless(self, i, **kw):
        from ..kernels.fp8_lossless_attention import decode_attention_fp8_lossless
        layout = Fp8PageLayout(self.shape.hkv, self.shape.d)
        arenas, loc, _ = self.fp8l
        return decode_attention_fp8_lossless(self.q, arenas[i % self.sets], loc, self.bt, self.lens, layout,
                                             self.shape.d ** -0.5, self.out, validate=False, **kw)


class FlashInfer:
    def __init__(self, device="cuda"):
        import flashinfer
        self.fi = flashinfer
        self.version = flashinfer.__version__
        self.ws = torch.empty(256 << 20, dtype=torch.uint8, device=device)

    def prepare(self, case: Case, kv_dtype: torch.dtype = torch.bfloat16):
        """FlashInfer's decode of ``case`` over its BF16 pages, or its E4M3 pages (scale 1)."""
        dev = case.q.device
        w = self.fi.BatchDecodeWithPagedKVCacheWrapper(self.ws, "NHD", use_tensor_cores=True, backend="fa2")
        npr = case.bt.shape[1]
        indptr = torch.arange(case.B + 1, device=dev, dtype=torch.int32) * npr
        last = torch.full((case.B,), case.ctx - (npr - 1) * PS, dtype=torch.int32, device=dev)
        w.plan(indptr, case.bt.flatten().contiguous(), last, case.shape.hq, case.shape.hkv, case.shape.d, PS,
               pos_encoding_mode="NONE", q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
        out = torch.empty_like(case.q)
        kv = case.kv if kv_dtype == torch.bfloat16 else case.kv8.view(kv_dtype)

        def run(i):
            return w.run(case.q, kv[i % case.sets], out=out)
        return run


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def measure_case(case: Case, fi: FlashInfer | None, kernels, cfg, ceiling, table=KERNELS,
                 fi_modes=("flashinfer",)):
    """Times and checks one case; returns records (errors against FlashInfer's BF16 output)."""
    recs = []
    outs = {}
    ref = None
    device = case.q.device
    for mode in fi_modes if fi is not None else ():
        try:
            run = fi.prepare(case, FLASHINFER_KV[mode])
            o = run(0).clone()
        except Exception as e:  # a FlashInfer build without this dtype: said, not fatal
            print(f"  {mode}: could not run ({type(e).__name__}: {str(e)[:200]}); left out", file=sys.stderr)
            continue
        t, spread, how = time_calls(run, case.sets, device=device)
        r = dict(kernel=mode, median_ms=t * 1e3, spread_ms=spread * 1e3, timing=how,
                 bytes_read=case.traffic("open" if mode == "flashinfer" else "fp8")[0])
        if mode == "flashinfer":
            ref = o
        elif ref is not None:
            r["rel_err_vs_flashinfer"] = rel(o, ref)
        recs.append(r)
    for name in kernels:
        method, fixed, kind = table[name]
        fn = getattr(case, method)
        kw = dict(fixed) if fixed else dict(cfg)
        o = fn(0, **kw).clone()
        outs[name] = o
        t, spread, how = time_calls(lambda i: fn(i, **kw), case.sets, device=device)
        read, written = case.traffic(kind)
        r = dict(kernel=name, median_ms=t * 1e3, spread_ms=spread * 1e3, bytes_read=read, timing=how)
        if written:
            r["bytes_written"] = written
        if ref is not None:
            r["rel_err_vs_flashinfer"] = rel(o, ref)
        recs.append(r)
    for un, fu in (("uncompressed", "fused"), ("uncompressed_triton", "fused_triton")):
        if un in outs and fu in outs:
            same = bool(torch.equal(outs[un], outs[fu]))
            for r in recs:
                if r["kernel"] == fu:
                    r["bit_identical_to_uncompressed"] = same
    if "fp8" in outs and "uncompressed" in outs:
        next(r for r in recs if r["kernel"] == "fp8")["rel_err_vs_uncompressed"] = rel(outs["fp8"], outs["uncompressed"])
    for r in recs:
        if r["kernel"] == "fp8_lossless":
            r["fp8_lossless_stored_ratio"] = r["bytes_read"] / case.traffic("fp8")[0]
            if "fp8" in outs:
                r["bit_identical_to_fp8"] = bool(torch.equal(outs["fp8"], outs["fp8_lossless"]))
    fi_ms = next((r["median_ms"] for r in recs if r["kernel"] == "flashinfer"), None)
    for r in recs:
        r.update(batch=case.B, context=case.ctx)
        moved = r["bytes_read"] + r.get("bytes_written", 0)
        r["achieved_GBps"] = moved / (r["median_ms"] / 1e3) / 1e9
        r["fraction_of_copy_ceiling"] = r["achieved_GBps"] * 1e9 / ceiling
        if fi_ms:
            r["speedup_vs_flashinfer"] = fi_ms / r["median_ms"]
    return recs


def fmt(recs):
    lines = []
    for r in recs:
        lines.append(f"{r['kernel']:>12} B={r['batch']:<3} ctx={r['context']:<6} "
                     f"f={r['compressible_fraction']:.2f} {r['median_ms']:8.4f} ms "
                     f"(±{r['spread_ms']:.4f}) {r['achieved_GBps']:7.0f} GB/s "
                     f"x{r.get('speedup_vs_flashinfer', float('nan')):.3f} "
                     f"{r.get('variant', '')} "
                     f"{'bitEQ' if r.get('bit_identical_to_uncompressed') else ''}"
                     f"{'BIT-MISMATCH' if r.get('bit_identical_to_uncompressed') is False else ''} "
                     f"err={r.get('rel_err_vs_flashinfer', float('nan')):.2g}")
    return "\n".join(lines)


def summary(records):
    lines = ["", "| kernel | batch | context | compressible | median ms | GB/s | x FlashInfer |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        lines.append(f"| {r['kernel']} {r.get('variant', '')} | {r['batch']} | {r['context']} | "
                     f"{r['compressible_fraction']:.2f} | {r['median_ms']:.4f} | "
                     f"{r['achieved_GBps']:.0f} | {r.get('speedup_vs_flashinfer', float('nan')):.3f} |")
    return "\n".join(lines)


def parse_list(text: str, kind, flag: str, low: float, high: float = float("inf")) -> list:
    try:
        out = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or not all(low <= x <= high for x in out):
        raise ValueError(f"{flag} takes comma-separated values in [{low:g}, {high:g}], got {text!r}")
    return out


def cases_table(records: list[dict]) -> list[dict]:
    """One row per (fraction, batch, context): each kernel's ms and the speed ratios."""
    by = {}
    for r in records:
        key = (r["compressible_fraction_nominal"], r["batch"], r["context"])
        row = by.setdefault(key, {"fraction": key[0], "batch": key[1], "context": key[2],
                                  "stored_ratio": r["stored_ratio"]})
        row[r["kernel"]] = r["median_ms"]
        if "fp8_lossless_stored_ratio" in r:
            row["fp8_lossless_stored_ratio"] = r["fp8_lossless_stored_ratio"]
    rows = list(by.values())
    for row in rows:
        fused = row.get("fused")
        for other, name in (("uncompressed", "compressed/uncompressed"), ("flashinfer", "compressed/flashinfer")):
            row[name] = row[other] / fused if fused and row.get(other) else None
        fp8, fi8 = row.get("fp8"), row.get("flashinfer_fp8")
        row["fp8/flashinfer_fp8"] = fi8 / fp8 if fp8 and fi8 else None
        fp8l = row.get("fp8_lossless")
        row["fp8_lossless/fp8"] = fp8 / fp8l if fp8 and fp8l else None
    return rows


COLUMNS = [("fraction", "compressible", "{:.2f}"), ("batch", "batch", "{}"), ("context", "context", "{}"),
           ("stored_ratio", "stored ratio", "{:.3f}"), ("fused", "compressed ms", "{:.4f}"),
           ("uncompressed", "uncompressed ms", "{:.4f}"), ("flashinfer", "flashinfer ms", "{:.4f}"),
           ("compressed/uncompressed", "x uncompressed", "{:.3f}"), ("compressed/flashinfer", "x flashinfer", "{:.3f}")]
FP8_COLUMNS = [("fp8", "fp8 ms", "{:.4f}"), ("flashinfer_fp8", "flashinfer fp8 ms", "{:.4f}"),
               ("fp8/flashinfer_fp8", "fp8 x flashinfer fp8", "{:.3f}"),
               ("fp8_lossless_stored_ratio", "fp8 lossless stored / fp8", "{:.3f}"),
               ("fp8_lossless", "fp8 lossless ms", "{:.4f}"), ("fp8_lossless/fp8", "fp8 lossless x fp8", "{:.3f}")]


def plot(result: dict, path: str) -> bool:
    rows = result["cases"]
    return report.speed_bars(
        path, [f"{r['fraction']:.0%}\nB{r['batch']} {r['context']}" for r in rows],
        {f"{name} (speed)": [r.get(name) for r in rows] for name in ("compressed/uncompressed", "compressed/flashinfer")},
        f"zipfusion bench kernel, {result['meta']['device_name']}", "speed of the compressed kernel (x)")


def run(args, modes: list[str], device: str) -> int:
    smoke = not device.startswith("cuda")
    if smoke and args.device in (None, "auto"):
        raise ValueError("zipfusion bench kernel needs a CUDA GPU (no GPU is visible); --device cpu runs a tiny "
                         "smoke test through the Triton interpreter, whose timings mean nothing")
    fractions = parse_list(args.fractions, float, "--fractions", 0.0, 1.0)
    batches = parse_list(args.batches, int, "--batches", 1)
    contexts = parse_list(args.contexts, int, "--contexts", 1)
    heads = parse_list(args.heads, int, "--heads", 1)
    if len(heads) != 2 or heads[0] % heads[1]:
        raise ValueError(f"--heads must be QUERY,KV with KV dividing QUERY, got {args.heads!r}")
    shape = dataclasses.replace(SMOKE if smoke else LLAMA, **({"d": args.head_dim} if args.head_dim else {}),
                                **({} if smoke else dict(hq=heads[0], hkv=heads[1])))
    if smoke:
        batches, contexts = [1], [32]
        print("smoke run on the CPU (Triton interpreter, 2 query heads, 1 KV head, one tiny case): the "
              "timings mean nothing", file=sys.stderr)
    kernels = [MODE_KERNELS[m] for m in modes if m not in FLASHINFER_KV]
    fi_modes = [m for m in modes if m in FLASHINFER_KV]
    meta = report.run_meta("kernel", args.argv, device)
    info = {"shape": dataclasses.asdict(shape), "page_tokens": PS}
    fi = None
    if fi_modes:
        from . import flashinfer_skip_reason
        why = flashinfer_skip_reason(device)
        if why:
            info["flashinfer_skipped"] = why
            print(f"flashinfer: skipped ({why})", file=sys.stderr)
        else:
            fi = FlashInfer(device)
            info["flashinfer"] = fi.version
    if device.startswith("cuda"):
        info["sms"] = torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    ceiling = copy_bandwidth(device)
    info["copy_ceiling_GBps"] = ceiling / 1e9
    records = []
    pools = {}
    cases = [(f, B, c) for f in fractions for B in batches for c in contexts]
    for n, (f, B, ctx) in enumerate(cases):
        if f not in pools:
            pools[f] = Pool(f, seed=int(f * 100) + 1, shape=shape, device=device)
        case = Case(pools[f], B, ctx, seed=B * 7 + ctx)
        recs = measure_case(case, fi, kernels, {}, ceiling, fi_modes=fi_modes)
        for r in recs:
            r.update(compressible_fraction=pools[f].fraction, compressible_fraction_nominal=f, **pools[f].formats)
        print(f"[{n + 1}/{len(cases)}] fraction {f:g}, batch {B}, context {ctx}: "
              + ", ".join(f"{r['kernel']} {r['median_ms']:.4f} ms" for r in recs), file=sys.stderr, flush=True)
        records += recs
        del case
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    result = {"meta": meta, "config": {"modes": modes, "fractions": fractions, "batches": batches,
                                       "contexts": contexts, "smoke": smoke, **info},
              "records": records, "cases": cases_table(records)}
    print(report.save(result, args.out, plot))
    fp8 = any(m in modes for m in ("fp8", "fp8_lossless", "flashinfer_fp8"))
    print(report.text_table(result["cases"], COLUMNS + (FP8_COLUMNS if fp8 else [])))
    print("x uncompressed / x flashinfer: the other kernel's time / the compressed kernel's (above 1: compressed "
          "is faster)")
    return 0
