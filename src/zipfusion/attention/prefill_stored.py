"""Prefill over stored pages: a chunk attends causally to its request's pages, which hold its
prefix -- open or compressed -- and, once the step's ``store`` ran, its own K/V. This is how a
continuation attends (``start > 0``: a later chunk of a long prompt, a prompt behind a
prefix-cache hit, a recompute after preemption), and, in deterministic mode, every chunk.

Two route objects; :class:`~.attention.AttentionBackend` picks one when it is built:

* :class:`RowsPrefill` (deterministic mode): each token as a decode row of the decode route,
  with its own context length, so that it attends exactly as it would in a decode step
  (the kernel's fixed split, decode.py): its sums run in the same order whether it
  was computed in a prompt chunk of any size, a recompute after preemption, or a decode step.
  With compressed pages and the kernel, a chunk of more than ``ROWS_MAX_TOKENS`` tokens runs
  its rows over an open copy of the request's pages, restored once a layer
  (:meth:`~.decode.KernelDecode.over_open_copy`: the same bits), so that thousands of
  rows re-reading one prefix do not restore it thousands of times.
* :class:`GatherPrefill` (otherwise): restore the request's pages into one contiguous K/V
  (:func:`page_reader`: the kernels' restore routine, one launch, linear in the prefix), then
  dense attention: on CUDA every such chunk of the step in one variable-length FlashAttention
  call (:func:`varlen_prefill`: bottom-right causal, GQA without repeating K/V heads), elsewhere
  SDPA per chunk. Prefix-cache hits land here: many short chunks over long cached prefixes.
  When every such chunk is long (``split_min_tokens``: the 8K chunks of a long prompt), each
  runs as :func:`split_prefill` instead: cuDNN over its prefix (rounded down to ``split_grain``
  keys, so that its graphs are few) and over the rest and itself, merged by log-sum-exp (faster
  than FlashAttention's bottom-right causal kernel as measured: docs/benchmarks.md). With our kernels, a chunk
  of ``ROWS_MAX_TOKENS`` tokens or fewer attends as decode rows instead (split-KV, pages read in
  place, compressed blocks restored in registers): the tails a token budget cuts off (the mixed
  steps of a burst end almost every prompt with one).

A chunk's route depends only on its length and the backend, so compressed and uncompressed runs
of one schedule take the same routes and give the same bits. (The paged prefill kernel,
kernels/prefill_attention.py, reads pages in place too; it is not a route: it measured several times
slower than FlashAttention, docs/benchmarks.md.)
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

# chunks of at most this many tokens attend as decode rows (see the module docstring)
ROWS_MAX_TOKENS = 16


def page_reader(cache, kernels: bool, compressed: bool):
    """``read(layer, pages, n) -> K, V [n, H, D]``: a request's first n tokens restored from its
    pages (int32 ``pages`` on the cache's device). ``kernels``: the kernels' restore over the
    arena (``gather_kv``); otherwise the cache reads them (torch, any cache; FP8 pages dequantized
    from the device tensor itself, no host sync)."""
    if cache.kv_dtype == "fp8":
        return lambda layer, pages, n: cache.read_tokens(layer, pages, n)
    if not kernels:
        return lambda layer, pages, n: cache.read_tokens(layer, pages.tolist(), n)

    def read(layer, pages, n):
        from ..kernels.prefill_attention import gather_kv
        return gather_kv(cache.arena, cache.page_loc[layer], pages, n, cache.layout, compressed=compressed)
    return read


class RowsPrefill:
    """Each token of a chunk as a decode row of ``decode`` over its request's pages.
    ``read``, given: chunks longer than ROWS_MAX_TOKENS run over an open copy of the pages that
    ``read`` restores (``decode`` is then a KernelDecode)."""

    def __init__(self, decode, read=None):
        self.decode, self.read = decode, read

    def plan(self, chunks, device) -> list[tuple]:
        """Host work once a step, from (offset in the step's rows, chunk) pairs: each chunk's
        rows, its pages (a block table row per token, or the pages of its open copy) and each
        token's context length."""
        plan = []
        for off, ch in chunks:
            pages = to_device(torch.tensor(ch.used_pages, dtype=torch.int32), device)    # pinned: no wait
            lens = torch.arange(ch.start + 1, ch.start + ch.length + 1, dtype=torch.int32, device=device)
            copy = self.read is not None and ch.length > ROWS_MAX_TOKENS
            plan.append((slice(off, off + ch.length), pages if copy else pages.expand(ch.length, len(pages)),
                         lens, copy))
        return plan

    def run(self, layer: int, q, k, v, out: torch.Tensor, plan: list[tuple]) -> None:
        for rows, pages, lens, copy in plan:
            if copy:
                kc, vc = self.read(layer, pages, pages.numel() * PAGE_TOKENS)     # whole pages, as stored
                out[rows] = self.decode.over_open_copy(q[rows], kc, vc, lens)
            else:
                out[rows] = self.decode(layer, q[rows], pages, lens)

    def warm_up(self, q, kv) -> None:
        """No cuDNN graphs to build."""


class GatherPrefill:
    """Chunks over their request's pages restored by ``read`` (:func:`page_reader`), then dense
    attention; ``rows``, given: chunks of ROWS_MAX_TOKENS tokens or fewer attend as its decode
    rows instead. ``split_min_tokens``: on CUDA, a step whose restored chunks are all at least
    this long attends chunk by chunk with :func:`split_prefill`, its prefix part rounded down to
    a multiple of ``split_grain`` keys."""

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
        if vb is not None:                      # every restored chunk in one call
            kg, vg = vb.keys(lambda pages, n: self.read(layer, pages, n))
            out[vb.rows] = varlen_prefill(q[vb.rows], kg.to(q.dtype), vg.to(q.dtype), vb, self.sm_scale,
                                          self.split_min_tokens, self.split_grain)

    def warm_up(self, q: torch.Tensor, kv: torch.Tensor) -> None:
        """Build cuDNN's graph of a split chunk's prefix call (zero q [>= CUDNN_BUCKET, Hq, D] and
        kv [>= split_grain, H, D]; CUDA only); graphs of longer prefixes are built when met."""
        g = self.split_grain
        attend_lse(q[:CUDNN_BUCKET], kv[:g], kv[:g], False, self.sm_scale)


@dataclass
class VarlenBatch:
    """A step's restored chunks as one variable-length attention: their rows in the step's q,
    cumulative query / key lengths (keys: each request's prefix and chunk), and where each key
    comes from: the chunks' distinct pages are restored once per layer (requests behind one cached
    prefix share its pages) and ``token_index`` picks every chunk's keys out of them, in order."""
    rows: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    pages: torch.Tensor          # int32 [U]: the distinct pages
    token_index: torch.Tensor    # int64 [cu_k[-1]]: key j of the batch is token token_index[j] of the restore
    spans: list[tuple[int, int, int, int]]   # per chunk (q from, q to, k from, k to), on the host

    @classmethod
    def of(cls, chunks, device) -> "VarlenBatch":
        """The batch of (offset in the step's rows, chunk) pairs (host work, once a step)."""
        rows, cu_q, cu_k = [], [0], [0]
        for off, ch in chunks:
            rows.append(torch.arange(off, off + ch.length))
            cu_q.append(cu_q[-1] + ch.length)
            cu_k.append(cu_k[-1] + ch.start + ch.length)
        pages = torch.tensor([p for _, ch in chunks for p in ch.used_pages], dtype=torch.int64)
        uniq, inverse = torch.unique(pages, return_inverse=True)
        index, at = [], 0
        for _, ch in chunks:           # token t of a chunk's keys: slot t % 16 of its page t // 16
            n, used = ch.start + ch.length, len(ch.used_pages)
            t = torch.arange(n)
            index.append(inverse[at:at + used][t // PAGE_TOKENS] * PAGE_TOKENS + t % PAGE_TOKENS)
            at += used
        cu = to_device(torch.tensor([cu_q, cu_k], dtype=torch.int32), device)  # pinned: no wait for the GPU
        return cls(to_device(torch.cat(rows), device), cu[0], cu[1], max(ch.length for _, ch in chunks),
                   max(ch.start + ch.length for _, ch in chunks), to_device(uniq.to(torch.int32), device),
                   to_device(torch.cat(index), device), list(zip(cu_q, cu_q[1:], cu_k, cu_k[1:])))

    def keys(self, read) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [cu_k[-1], H, D]; ``read(pages, n)``: the first n tokens of those pages restored."""
        k, v = read(self.pages, self.pages.numel() * PAGE_TOKENS)
        return k[self.token_index], v[self.token_index]


@functools.cache
def _varlen_options():
    """torch's variable-length FlashAttention (``torch.nn.attention.varlen``, torch >= 2.9) and
    how this torch says "causal" and whether it takes GQA (asked once); None without it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}  # a (left, right) window
    return varlen_attn, causal, "enable_gqa" in params


def varlen_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vb: VarlenBatch, scale: float,
                   split_min_tokens: int = PREFILL_SPLIT_MIN_TOKENS,
                   split_grain: int = PREFILL_SPLIT_GRAIN) -> torch.Tensor:
    """Causal attention of several chunks at once: chunk j's queries (rows cu_q[j]..cu_q[j+1]) are
    the last tokens of its keys (cu_k[j]..cu_k[j+1]); query i of a chunk of n sees the keys up to
    its own position (bottom-right causal). K/V heads are shared by query-head groups (GQA).
    One varlen FlashAttention call on CUDA, or split_prefill chunk by chunk where every chunk has
    ``split_min_tokens`` or more; elsewhere (the CPU) SDPA chunk by chunk."""
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
    """:func:`~.prefill_open.masked_attention` with a sliding window, no soft-capping: on CUDA
    (bf16, fp16) torch's variable-length FlashAttention with its (window - 1, 0) window, which
    aligns a chunk after a prefix bottom-right (query i at position start + i sees keys
    start + i - window < j <= start + i); elsewhere (and without it) masked_attention."""
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
    """Causal attention of a long continuation chunk, q [n, Hq, D] (the last n of the keys
    k, v [L, H, D], after a prefix of P = L - n), as two attentions over disjoint keys merged by
    their log-sum-exps. With P' = P rounded down to a multiple of ``grain`` and r = P - P':

        a: the chunk over keys 0..P'-1: every query sees all of them (no mask);
        b: the chunk over keys P'..L-1, top-left causal, its queries behind r zero rows: row
           r + i of that call sees keys P'..P+i, which is what query i must see past P';
        softmax over a ∪ b:  o = o_a · e^(lse_a - lse) + o_b · e^(lse_b - lse),
                             lse = log(e^lse_a + e^lse_b).

    Neither part needs the bottom-right mask that only FlashAttention's kernels take, so
    both run on cuDNN's, the faster (docs/benchmarks.md).
    cuDNN builds a graph per shape (:func:`attend_lse`): part b's depends on the bucket of r + n
    alone, part a's on n's bucket and P', a multiple of ``grain`` (default PREFILL_SPLIT_GRAIN
    on CUDA, 1 elsewhere), so a run meets a few shapes however its chunks fall. The r <= grain - 1
    zero rows cost at most r²/2 extra score entries; with P < grain part a is empty and part b
    is the whole answer. The merge is fp32, on [n, Hq, D]: a small fraction of the attention's
    cost."""
    n, L = q.shape[0], k.shape[0]
    grain = grain or (PREFILL_SPLIT_GRAIN if cudnn_takes(q) else 1)
    P = L - n
    Pa, r = P // grain * grain, P % grain
    qb = F.pad(q, (0, 0, 0, 0, r, 0)) if r else q                    # r zero rows in front
    o_b, lse_b = attend_lse(qb, k[Pa:], v[Pa:], True, scale)
    o_b, lse_b = o_b[r:], lse_b[r:]
    if Pa == 0:
        return o_b.to(q.dtype)
    o_a, lse_a = attend_lse(q, k[:Pa], v[:Pa], False, scale)
    lse = torch.logaddexp(lse_a, lse_b)
    o = o_a.float() * torch.exp(lse_a - lse)[..., None] + o_b.float() * torch.exp(lse_b - lse)[..., None]
    return o.to(q.dtype)
