"""The KV methods of benchmarks/e2e.py that are baselines, not engine features.

* ``unfused``: our format, decompressed into a one-layer BF16 workspace with the Triton codec,
  then the uncompressed kernel (benchmarks/unfused.py), inside the engine's decode step
  (CUDA graphs included): :class:`UnfusedBackend`, whose plans are made once the requests are
  filled.
* ``nvcomp-ans`` / ``nvcomp-bitcomp``: decompress-then-attend with NVIDIA nvCOMP's Python API,
  measured as an honest *composite*: the ratio and decode speed of the codec on the same KV
  pages, the engine's uncompressed step time at the batch that fits at that ratio, and the
  decompression of every layer's KV of that batch added to each step.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import torch

from zipfusion.attention.backend import AttentionBackend

# (label, Codec options): the data-type options tried for each nvCOMP algorithm; the best ratio counts
NVCOMP_VARIANTS = {
    "nvcomp-ans": [("ANS <f2", dict(algorithm="ANS", data_type="<f2")),
                   ("ANS |u1", dict(algorithm="ANS", data_type="|u1"))],
    "nvcomp-bitcomp": [("Bitcomp <u2", dict(algorithm="Bitcomp", data_type="<u2")),
                       ("Bitcomp <f2", dict(algorithm="Bitcomp", data_type="<f2"))],
}


def unfused_kv_gb(kv_gb: float, num_layers: int, compressible_fraction: float) -> float:
    """KV budget left for stored pages when one layer's pages, decompressed, must also fit in
    ``kv_gb``: stored/open ratio r ~ (f·768 + (1-f)·1024) / 1024 (the format's block sizes), so
    the workspace is kv_gb / (L·r) of the stored KV's share."""
    r = (compressible_fraction * 768 + (1 - compressible_fraction) * 1024) / 1024
    return kv_gb / (1 + 1 / (num_layers * r))


class UnfusedDecode:
    """A decode route (attention/decode.py) that decompresses, then runs the uncompressed
    kernel: one plan per layer over the pages in the cache at the first call (the requests are
    filled and the CUDA graphs' scratch page taken by then), all sharing one workspace (the
    batch's pages of one layer)."""

    graph_safe = True

    def __init__(self, cache, sm_scale: float):
        self.cache, self.sm_scale, self.plans = cache, sm_scale, None

    def prepare(self, context_lens, block_table, graph: bool = False) -> None:
        """Nothing to plan a step."""

    def _plan(self) -> list:
        from unfused import plan_unfused
        cache, plans, scratch = self.cache, [], None
        for layer in range(cache.num_layers):          # each plan's own workspace is dropped at once
            p = plan_unfused(cache.arena, cache.page_loc[layer], cache.layout)
            if scratch is None:
                scratch = p.scratch
            elif p.scratch.shape[0] > scratch.shape[0]:
                raise ValueError("layers hold different page counts; the unfused workspace is one layer's")
            plans.append(dataclasses.replace(p, scratch=scratch[:p.scratch.shape[0]]))
        return plans

    def __call__(self, layer, q, block_table, context_lens):
        from unfused import decode_attention_unfused
        self.plans = self.plans or self._plan()
        c = self.cache
        return decode_attention_unfused(q, c.arena, c.page_loc[layer], block_table, context_lens, c.layout,
                                        self.sm_scale, plan=self.plans[layer], validate=False)


class UnfusedBackend(AttentionBackend):
    """The engine's attention with :class:`UnfusedDecode` as its decode route."""

    def __init__(self, cache, *args, **kwargs):
        super().__init__(cache, *args, **kwargs)
        self.decode = UnfusedDecode(cache, self.sm_scale)


def nvcomp_measure(pages: torch.Tensor, reps: int = 5) -> dict:
    """Ratio (compressed / raw bytes) and decode speed (raw bytes out / s) of each nvCOMP variant
    on ``pages`` (bf16, CUDA); {method: {variant, ratio, decode_Bps, encode_Bps}} (best ratio)."""
    from nvidia import nvcomp
    raw = pages.contiguous().view(torch.uint8).view(-1)
    out = {}
    for method, variants in NVCOMP_VARIANTS.items():
        best = None
        for label, opts in variants:
            try:
                codec = nvcomp.Codec(**opts)
                arr = nvcomp.as_array(raw)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                enc = codec.encode(arr)
                torch.cuda.synchronize()
                enc_s = time.perf_counter() - t0
                codec.decode(enc)                                  # warm-up
                ts = []
                for _ in range(reps):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    dec = codec.decode(enc)
                    torch.cuda.synchronize()
                    ts.append(time.perf_counter() - t0)
                same = torch.equal(torch.as_tensor(dec, device=raw.device).view(torch.uint8).view(-1), raw)
                rec = dict(variant=label, ratio=enc.buffer_size / raw.numel(), lossless=same,
                           decode_Bps=raw.numel() / statistics.median(ts), encode_Bps=raw.numel() / enc_s)
            except Exception as exc:                     # a variant the library refuses: reported
                rec = dict(variant=label, error=f"{type(exc).__name__}: {exc}"[:300])
            if "ratio" in rec and (best is None or rec["ratio"] < best["ratio"]):
                best = rec
            out.setdefault(method + "_tried", []).append(rec)
        out[method] = best
    return out


def composite_batch(budget_bytes: float, open_bytes_per_request: float, open_page_bytes_all_layers: float,
                    num_layers: int, ratio: float) -> int:
    """Requests that fit a decompress-then-attend method: each holds its full pages compressed
    (``ratio`` x their open bytes) plus its open last page, and one layer's decompressed
    workspace (1/L of its open bytes) must fit beside them."""
    per = open_bytes_per_request * (ratio + 1 / num_layers) + open_page_bytes_all_layers
    return max(0, int(budget_bytes // per))


def composite_step(uncompressed_step_s: float, batch: int, open_bytes_per_request: float,
                   decode_Bps: float) -> float:
    """One decode step: the uncompressed step at this batch plus decompressing every layer's KV
    of the batch (serially before each layer's attention: no overlap assumed)."""
    if batch <= 0 or not decode_Bps or math.isnan(decode_Bps):
        return float("nan")
    return uncompressed_step_s + batch * open_bytes_per_request / decode_Bps
