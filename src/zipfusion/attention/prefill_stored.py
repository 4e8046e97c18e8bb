"""Prefill over stored pages: a chunk continuing its request (or, deterministic, every chunk)
attends to its request's pages, as decode rows (:class:`RowsPrefill`) or restored and attended
densely (:class:`GatherPrefill`). A chunk's route depends only on its length and the backend.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import PREFILL_SPLIT_GRAIN, PREFILL_SPLIT_MIN_TOKENS
from ..format import PAGE_TOKENS
from ..memory.copy import to_device
from .prefill_open import CUDNN_BUCKET, attend_lse, cudnn_takes, masked_attention, prefill_attention

# chunks of at most this many tokens attend as decode rows
ROWS_MAX_TOKENS = 16


def page_reader(cache, kernels: bool, compressed: bool):
    """``read(layer, pages, n) -> K, V [n, H, D]``: a request's first n tokens restored from its
    pages (``kernels``: ``gather_kv`` over the arena; else the cache's torch reader)."""
    if cache.kv_dtype == "fp8":
        return lambda layer, pages, n: cache.read_tokens(layer, pages, n)
    if not kernels:
        return lambda layer, pages, n: cache.read_tokens(layer, pages.tolist(), n)

    def read(layer, pages, n):
        from ..kernels.prefill_attention import gather_kv
        return gather_kv(cache.arena, cache.page_loc[layer], pages, n, cache.layout, compressed=compressed)
    return read


class RowsPrefill:
    """Each token of a chunk as a decode row over its request's pages; with ``read``, chunks
    longer than ROWS_MAX_TOKENS run over an open copy of the pages, restored once a layer."""

    def __init__(self, decode, read=None):
        self.decode, self.read = decode, read

    def plan(self, chunks, device) -> list[tuple]:
        """Host work once a step: each chunk's rows, pages and per-token context lengths."""
        plan = []
        for off, ch in chunks:
            pages = to_device(torch.tensor(ch.used_pages, dtype=torch.int32), device)
            lens = torch.arange(ch.start + 1, ch.start + ch.length + 1, dtype=torch.int32, device=device)
            copy = self.read is not None and ch.length > ROWS_MAX_TOKENS
            plan.append((slice(off, off + ch.length), pages if copy else pages.expand(ch.length, len(pages)),
                         lens, copy))
        return plan

    def run(self, layer: int, q, k, v, out: torch.Tensor, plan: list[tuple]) -> None:
        for rows, pages, lens, copy in plan:
            if copy:
                kc, vc = self.read(layer, pages, pages.numel() * PAGE_TOKENS)
                out[rows] = self.decode.over_open_copy(q[rows], kc, vc, lens)
            else:
                out[rows] = self.decode(layer, q[rows], pages, lens)

    def warm_up(self, q, kv) -> None:
        """No cuDNN graphs to build."""


class GatherPrefill:
    """Chunks over their pages restored by ``read``, then dense attention; with ``rows``, chunks
    of ROWS_MAX_TOKENS tokens or fewer attend as decode rows instead."""

    def __init__(self, read, sm_scale: float, rows: RowsPrefill | None = None,
                 split_min_tokens: int = PREFILL_SPLIT_MIN_TOKENS, split_grain: int = PREFILL_SPLIT_GRAIN):
        self.read, self.sm_scale, self.rows = read, sm_scale, rows
        self.split_min_tokens, self.split_grain = split_min_tokens, split_grain

    def plan(self, chunks, device):
        """Host work once a step: the short chunks' decode rows, the others' VarlenBatch."""
        short, gathered = [], []
        for off, ch in chunks:
            (short if self.rows is not None and ch.length <= ROWS_MAX_TOKENS else gathered).append((off, ch))
        return (self.rows.plan(short, device) if short else None,
                VarlenBatch.of(gathered, device) if gathered else None)

    def run(self, layer: int, q, k, v, out: torch.Tensor, plan) -> None:
        rows, vb = plan
        if rows is not None:
            self.rows.run(layer, q, k, v, out, rows)
        if vb is not None:
            kg, vg = vb.keys(lambda pages, n: self.read(layer, pages, n))
            out[vb.rows] = varlen_prefill(q[vb.rows], kg.to(q.dtype), vg.to(q.dtype), vb, self.sm_scale,
                                          self.split_min_tokens, self.split_grain)

    def warm_up(self, q: torch.Tensor, kv: torch.Tensor) -> None:
        """Build cuDNN's graph of a split chunk's prefix call (CUDA only)."""
        g = self.split_grain
        attend_lse(q[:CUDNN_BUCKET], kv[:g], kv[:g], False, self.sm_scale)


@dataclass
class VarlenBatch:
    """A step's restored chunks as one variable-length attention; the chunks' distinct pages are
    restored once per layer and ``token_index`` picks each chunk's keys out of them."""
    rows: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    pages: torch.Tensor          # int32 [U]: the distinct pages
    token_index: torch.Tensor    # int64 [cu_k[-1]]: key j is token token_index[j] of the restore
    spans: list[tuple[int, int, int, int]]   # per chunk (q from, q to, k from, k to), on the host

    @classmethod
    def of(cls, chunks, device) -> "VarlenBatch":
        rows, cu_q, cu_k = [], [0], [0]
        for off, ch in chunks:
            rows.append(torch.arange(off, off + ch.length))
            cu_q.append(cu_q[-1] + ch.length)
            cu_k.append(cu_k[-1] + ch.start + ch.length)
        pages = torch.tensor([p for _, ch in chunks for p in ch.used_pages], dtype=torch.int64)
        uniq, inverse = torch.unique(pages, return_inverse=True)
        index, at = [], 0
        for _, ch in chunks:
            n, used = ch.start + ch.length, len(ch.used_pages)
            t = torch.arange(n)
            index.append(inverse[at:at + used][t // PAGE_TOKENS] * PAGE_TOKENS + t % PAGE_TOKENS)
            at += used
        cu = to_device(torch.tensor([cu_q, cu_k], dtype=torch.int32), device)
        return cls(to_device(torch.cat(rows), device), cu[0], cu[1], max(ch.length for _, ch in chunks),
                   max(ch.start + ch.length for _, ch in chunks), to_device(uniq.to(torch.int32), device),
                   to_device(torch.cat(index), device), list(zip(cu_q, cu_q[1:], cu_k, cu_k[1:])))

    def keys(self, read) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [cu_k[-1], H, D]; ``read(pages, n)``: the first n tokens of those pages restored."""
        k, v = read(self.pages, self.pages.numel() * PAGE_TOKENS)
        return k[self.token_index], v[self.token_index]


@functools.cache
def _varlen_options():
    """torch's varlen FlashAttention, its causal keyword and whether it takes GQA; None without it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return varlen_attn, causal, "enable_gqa" in params


def varlen_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vb: VarlenBatch, scale: float,
                   split_min_tokens: int = PREFILL_SPLIT_MIN_TOKENS,
                   split_grain: int = PREFILL_SPLIT_GRAIN) -> torch.Tensor:
    """Bottom-right causal attention of several chunks at once (GQA): one varlen FlashAttention
    call on CUDA, ``split_prefill`` per chunk where all are long, SDPA per chunk on the CPU."""
    if cudnn_takes(q) and min(q1 - q0 for q0, q1, _, _ in vb.spans) >= split_min_tokens:
        return torch.cat([split_prefill(q[q0:q1], k[k0:k1], v[k0:k1], scale, split_grain)
                          for q0, q1, k0, k1 in vb.spans])
    if not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16) or _varlen_options() is None:
        return torch.cat([prefill_attention(q[q0:q1], k[k0:k1], v[k0:k1], (k1 - k0) - (q1 - q0), scale)
                          for q0, q1, k0, k1 in vb.spans])
    attn, causal, takes_gqa = _varlen_options()
    kw = {"scale": scale, **causal}
    if takes_gqa:
        kw["enable_gqa"] = q.shape[1] != k.shape[1]
    elif q.shape[1] != k.shape[1]:
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return attn(q, k, v, vb.cu_q, vb.cu_k, vb.max_q, vb.max_k, **kw)


def window_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
                   window: int) -> torch.Tensor:
    """``masked_attention`` with a sliding window: varlen FlashAttention's (window - 1, 0) window
    on CUDA, else masked_attention."""
    opts = _varlen_options()
    if not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16) or opts is None \
            or "window_size" not in opts[1]:
        return masked_attention(q, k, v, start, scale, window)
    attn, _, takes_gqa = opts
    n, L = q.shape[0], k.shape[0]
    if not takes_gqa and q.shape[1] != k.shape[1]:
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    cu = torch.tensor([[0, n], [0, L]], dtype=torch.int32).to(q.device, non_blocking=True)
    kw = {"enable_gqa": q.shape[1] != k.shape[1]} if takes_gqa else {}
    return attn(q, k, v, cu[0], cu[1], n, L, scale=scale, window_size=(window - 1, 0), **kw)


def split_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  grain: int | None = None) -> torch.Tensor:
    """Causal attention of a continuation chunk q [n, Hq, D] over keys k, v [L, H, D] as two
    attentions merged by log-sum-exp: a) all keys before P' (the prefix rounded down to
    ``grain``), unmasked; b) the rest, top-left causal behind r = P - P' zero query rows. Neither
    needs a bottom-right mask, so both run on cuDNN, whose graphs (per shape) stay few."""
    n, L = q.shape[0], k.shape[0]
    grain = grain or (PREFILL_SPLIT_GRAIN if cudnn_takes(q) else 1)
    P = L - n
    Pa, r = P // grain * grain, P % grain
    qb = F.pad(q, (0, 0, 0, 0, r, 0)) if r else q
    o_b, lse_b = attend_lse(qb, k[Pa:], v[Pa:], True, scale)
    o_b, lse_b = o_b[r:], lse_b[r:]
    if Pa == 0:
        return o_b.to(q.dtype)
    o_a, lse_a = attend_lse(q, k[:Pa], v[:Pa], False, scale)
    lse = torch.logaddexp(lse_a, lse_b)
    o = o_a.float() * torch.exp(lse_a - lse)[..., None] + o_b.float() * torch.exp(lse_b - lse)[..., None]
    return o.to(q.dtype)
