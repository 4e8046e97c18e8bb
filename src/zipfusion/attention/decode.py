"""Decode attention: each decode row attends to its request's pages through one route object
(our kernel, the FP8 kernels, torch or FlashInfer), prepared once a step and called once a layer.
"""

from __future__ import annotations

import torch

from ..format import PAGE_TOKENS
from ..format.layout import open_loc

DETERMINISTIC_SPLIT_PAGES = 64


class KernelDecode:
    """The paged decode kernel over the arena: fused (``compressed``) or uncompressed."""

    graph_safe = True

    def __init__(self, cache, sm_scale: float, *, compressed: bool, deterministic: bool = False,
                 check_pages: bool = False):
        self.cache, self.sm_scale, self.compressed, self.check_pages = cache, sm_scale, compressed, check_pages
        self.split = {"split_pages": DETERMINISTIC_SPLIT_PAGES} if deterministic else {}

    def prepare(self, context_lens, block_table, graph: bool = False) -> None:
        """Nothing to plan on the host."""

    def __call__(self, layer: int, q: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor,
                 **packed) -> torch.Tensor:
        """``packed``: the kernel's ``spans``/``slot_heads``, or ``window``/``softcap``."""
        from ..kernels import decode_attention, decode_attention_uncompressed
        c = self.cache
        if self.check_pages:
            from ..kernels.decode_attention import check_ids_async
            check_ids_async(c.arena, c.page_loc[layer], block_table, context_lens, c.layout,
                            None if self.compressed else "decode_attention_uncompressed")
        kernel = decode_attention if self.compressed else decode_attention_uncompressed
        # the engine builds valid tables: no checks, no host syncs
        return kernel(q, c.arena, c.page_loc[layer], block_table, context_lens, c.layout, self.sm_scale,
                      validate=False, **self.split, **packed)

    def over_open_copy(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       context_lens: torch.Tensor) -> torch.Tensor:
        """Rows q [n, Hq, D] of one request over an open copy k, v of its pages: the uncompressed
        kernel on the copy gives the fused kernel's bits, and the prefix is restored once."""
        from ..kernels import decode_attention_uncompressed
        c = self.cache
        P, H, D = k.shape[0] // PAGE_TOKENS, c.num_kv_heads, c.head_dim
        copy = torch.stack([k.view(P, PAGE_TOKENS, H, D), v.view(P, PAGE_TOKENS, H, D)], dim=1)
        arena = copy.view(-1).view(torch.uint8)
        loc = open_loc(torch.arange(P, dtype=torch.int64, device=q.device) * c.layout.open_page_bytes)
        table = torch.arange(P, dtype=torch.int32, device=q.device).expand(q.shape[0], P)
        return decode_attention_uncompressed(q, arena, loc, table, context_lens, c.layout, self.sm_scale,
                                     validate=False, **self.split)


class Fp8KernelDecode(KernelDecode):
    """The Triton FP8 kernels over E4M3 pages in place: lossless with ``kv_compression``, else
    open (the same bits on open pages); :class:`KernelDecode`'s split rule."""

    def __init__(self, cache, sm_scale: float, *, deterministic: bool = False, check_pages: bool = False):
        super().__init__(cache, sm_scale, compressed=cache.kv_compression, deterministic=deterministic,
                         check_pages=check_pages)

    def __call__(self, layer: int, q: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor,
                 **packed) -> torch.Tensor:
        if packed:
            raise ValueError("packed decode does not read FP8 pages")
        if self.compressed:
            from ..kernels.fp8_lossless_attention import decode_attention_fp8_lossless as kernel
        else:
            from ..kernels.fp8_attention import decode_attention_fp8 as kernel
        c = self.cache
        if self.check_pages:
            from ..kernels.decode_attention import check_ids_async
            check_ids_async(c.arena, c.page_loc[layer], block_table, context_lens, c.layout,
                            None if self.compressed else "decode_attention_fp8")
        return kernel(q, c.arena, c.page_loc[layer], block_table, context_lens, c.layout, self.sm_scale,
                      k_scale=c.k_scale, v_scale=c.v_scale, validate=False, **self.split)

    def over_open_copy(self, q, k, v, context_lens):
        raise NotImplementedError("FP8 rows attend over the pages themselves: no open copy")


class TorchDecode:
    """Decode attention in torch over pages read back; ``exact``: fp64."""

    graph_safe = False  # reads context lengths on the host

    def __init__(self, cache, sm_scale: float, *, exact: bool = False):
        self.cache, self.sm_scale, self.exact = cache, sm_scale, exact

    def prepare(self, context_lens, block_table, graph: bool = False) -> None:
        """Nothing to plan on the host."""

    def __call__(self, layer: int, q: torch.Tensor, block_table: torch.Tensor,
                 context_lens: torch.Tensor, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        return torch_decode_attention(q, lambda ids: self.cache.read_pages(layer, ids), block_table,
                                      context_lens, self.sm_scale, self.exact, window, softcap)


class MaskedAttention:
    """Layers with a sliding window or soft-capped scores: decode rows through ``route``, prefill
    chunks through ``masked_attention`` over their own K/V or their pages read by ``read`` (or, in
    ``exact`` mode, as decode rows)."""

    def __init__(self, route, sm_scale: float, windows, softcap: float | None, read, num_layers: int,
                 exact: bool = False):
        self.route, self.sm_scale, self.softcap, self.read, self.exact = route, sm_scale, softcap, read, exact
        self.windows = list(windows) or [None] * num_layers
        self.layers = {i for i, w in enumerate(self.windows) if w is not None or softcap is not None}
        self.graph_safe = route.graph_safe

    def decode(self, layer: int, q, block_table, context_lens):
        return self.route(layer, q, block_table, context_lens, window=self.windows[layer], softcap=self.softcap)

    def attend(self, layer: int, q, k, v, step) -> torch.Tensor:
        from .prefill_open import masked_attention
        from .prefill_stored import window_prefill
        out, n = torch.empty_like(q), step.num_decode
        if n:
            out[:n] = self.decode(layer, q[:n], step.block_table, step.context_lens)
        off = n
        for ch in step.chunks:
            rows = slice(off, off + ch.length)
            off += ch.length
            pages = torch.tensor(ch.used_pages, dtype=torch.int32, device=q.device)
            if self.exact:
                lens = torch.arange(ch.start + 1, ch.start + ch.length + 1, dtype=torch.int32, device=q.device)
                out[rows] = self.decode(layer, q[rows], pages.expand(ch.length, len(pages)), lens)
                continue
            kc, vc = (k[rows], v[rows]) if ch.start == 0 else self.read(layer, pages, ch.start + ch.length)
            kc, vc, window = kc.to(q.dtype), vc.to(q.dtype), self.windows[layer]
            out[rows] = (window_prefill(q[rows], kc, vc, ch.start, self.sm_scale, window) if self.softcap is None
                         else masked_attention(q[rows], kc, vc, ch.start, self.sm_scale, window, self.softcap))
        return out


class FlashInferPagedDecode:
    """FlashInfer's paged decode over the open pages in place; one plan a step."""

    graph_safe = True

    def __init__(self, cache, sm_scale: float, num_qo_heads: int):
        from ..kernels.flashinfer_decode import FlashInferDecode
        self.cache, self.sm_scale = cache, sm_scale
        self.kernel = FlashInferDecode(cache.arena, cache.layout, num_qo_heads, cache.manager.chunk_bytes,
                                       fp8_scales=(cache.k_scale, cache.v_scale) if cache.kv_dtype == "fp8" else None)

    def prepare(self, context_lens, block_table, graph: bool = False) -> None:
        self.kernel.prepare(context_lens, block_table, self.sm_scale, graph)

    def __call__(self, layer: int, q: torch.Tensor, block_table: torch.Tensor,
                 context_lens: torch.Tensor) -> torch.Tensor:
        return self.kernel.run(q, self.cache.page_loc[layer])


def torch_decode_attention(q, read_pages, block_table, context_lens, sm_scale, exact: bool = False,
                           window: int | None = None, softcap: float | None = None):
    """Decode attention in fp32 torch (fp64 when ``exact``): q [B, Hq, D] over
    ``read_pages(ids) -> [n, 2, 16, H, D]``, with ``window`` and ``softcap``."""
    ftype = torch.float64 if exact else torch.float32
    B, Hq, D = q.shape
    lens = context_lens.to(torch.int64)
    max_pages = int(-(-int(lens.max()) // PAGE_TOKENS))
    table = block_table[:, :max_pages].to(torch.int64)
    used = torch.arange(max_pages, device=q.device)[None, :] * PAGE_TOKENS < lens[:, None]
    ids = torch.where(used, table, torch.zeros_like(table))
    uniq, inverse = torch.unique(ids[used], return_inverse=True)
    pages = read_pages(uniq)
    H = pages.shape[3]
    slot = torch.zeros_like(ids)
    slot[used] = inverse
    kv = pages[slot]
    k = kv[:, :, 0].reshape(B, max_pages * PAGE_TOKENS, H, D).to(ftype)
    v = kv[:, :, 1].reshape(B, max_pages * PAGE_TOKENS, H, D).to(ftype)
    qg = q.to(ftype).reshape(B, H, Hq // H, D)
    scores = torch.einsum("bhgd,bthd->bhgt", qg, k) * sm_scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    t = torch.arange(max_pages * PAGE_TOKENS, device=q.device)[None, :]
    valid = t < lens[:, None]
    if window is not None:
        valid &= t >= lens[:, None] - window
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    v = v.masked_fill(~valid[:, :, None, None], 0.0)           # unwritten slots may hold NaN bits
    out = torch.einsum("bhgt,bthd->bhgd", scores.softmax(-1), v)
    return out.reshape(B, Hq, D).float().to(q.dtype)
