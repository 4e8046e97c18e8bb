"""The engine's attention: one backend object, made once from the EngineConfig, planned once per
step and run per layer (FlashInfer's plan/run shape). It is the only reader of
``attention_backend``, ``kv_compression`` (which kernel twin reads the pages) and
``deterministic`` for attention; the KV cache (kv_cache.py) only holds memory.

A step's tokens are flattened as ``[decode rows | prefill chunk 1 | prefill chunk 2 ...]``:
each decode row is one request's newest token, each chunk a run of one request's prompt (or
recomputed) tokens. :meth:`AttentionBackend.plan` turns that into a :class:`PagedKVCacheStep`, the
engine's implementation of the model's :class:`~zipfusion.models.llama.KVCacheStep`:

* ``store``: rope and K/V of every token written into its page slot (one call per layer), so a
  chunk's own K/V are in its pages before it attends;
* ``attend``: decode rows run the paged decode kernel over their pages (compressed or open;
  FlashInfer's, or torch's, as configured); a prefill chunk attends causally to its request's
  pages:

  - a whole prompt (``start == 0``) on its fresh K/V: nothing to read back. On the GPU cuDNN's
    attention, its queries and keys padded to a multiple of ``CUDNN_BUCKET`` (cuDNN builds a
    graph for every new shape, ~45 ms: a workload's prompt lengths would each pay one; the
    engine builds the buckets' graphs when it starts, ``warm_up_prefill``); elsewhere SDPA;
  - a continuation (``start > 0``: a later chunk of a long prompt) over its request's pages,
    which already hold its prefix, by one of three routes (:meth:`AttentionBackend.route`):

    * ``"rows"``: each token as a decode row of the decode kernel, with its own context length
      (split-KV, pages read in place, compressed blocks restored in registers). For the tails a
      token budget cuts off (``ROWS_MAX_TOKENS`` tokens or fewer: the mixed steps of a burst
      end almost every prompt with one), and for every chunk in deterministic mode;
    * ``"paged"``: the paged prefill kernel (kernels/prefill_attention.py: query tiles x paged
      K/V, one launch for all such chunks, planned once per step). On the GPU it is not chosen
      yet: measured on the H200 it runs at 67-97 TFLOP/s against FlashAttention's ~340, and a
      short chunk gives it too few programs (docs/benchmarks.md); the CPU's kernel backend
      uses it for every longer continuation, so it stays exercised and tested;
    * ``"gather"``: restore the request's pages into one contiguous K/V (``gather_kv``: the
      kernels' restore routine, one launch, linear in the prefix), then attention: on CUDA every
      such chunk of the step in one variable-length FlashAttention call (``varlen_prefill``:
      bottom-right causal, GQA without repeating K/V heads), elsewhere SDPA per chunk. Prefix-cache
      hits land here: many short chunks over long cached prefixes. When every such chunk is long
      (``SPLIT_MIN_TOKENS``: the 8K chunks of a long prompt), each runs as ``split_prefill``
      instead: cuDNN over its prefix (rounded down to ``SPLIT_PREFIX_GRAIN`` keys, so that its
      graphs are few) and over the rest and itself, merged by log-sum-exp (1.6x faster than
      FlashAttention's bottom-right causal kernel on an H200).

    The route depends only on the chunk's length, the backend and the device, so compressed and
    uncompressed runs of one schedule take the same routes and give the same bits.

Deterministic mode: a prefill token attends exactly as it would as a decode row (the decode
kernel over its request's pages with its own context length, a fixed split of
``DETERMINISTIC_SPLIT_PAGES``), so its sums run in the same order whether it was computed in a
prompt chunk of any size, a recompute after preemption, or a decode step. With compressed pages a
long chunk's rows run the *twin* over an open copy of the request's pages (restored once per
layer by ``gather_kv``): the twin gives the fused kernel's bits (the same arithmetic after the
restore), and thousands of rows re-reading one prefix no longer restore it thousands of times.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from ..format import PAGE_TOKENS
from ..format.layout import open_loc
from ..memory.copy import to_device
from ..models.llama import KVCacheStep
from .packing import PackedPlan, plan_packed, rows_per_request

# SDPA kernels for a whole prompt on CUDA, fastest first (cuDNN: 0.90 ms per Llama-8B layer at
# 8192 tokens on an H200, FlashAttention 1.71 ms; docs/benchmarks.md); math only as a last resort
CUDA_SDPA = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
             SDPBackend.MATH]
# deterministic mode: the attention kernels split every request's KV into runs of this many
# pages, whatever the batch (a split count chosen from the batch would order the sums differently)
DETERMINISTIC_SPLIT_PAGES = 64
# continuation chunks of at most this many tokens attend as decode rows (see the module docstring)
ROWS_MAX_TOKENS = 16
# on CUDA, steps whose "gather" chunks are all at least this long attend chunk by chunk with
# split_prefill (cuDNN) instead of one varlen FlashAttention call (ZIPFUSION_SPLIT_MIN_TOKENS
# overrides it; a huge value turns the split off)
SPLIT_MIN_TOKENS = int(os.environ.get("ZIPFUSION_SPLIT_MIN_TOKENS", 1024))
# cuDNN attention pads its queries (causal: and keys) to a multiple of this many rows, so that a
# run builds a few graphs, not one per prompt length (see _attend_lse)
CUDNN_BUCKET = 512
# split_prefill's prefix part covers the prefix rounded down to a multiple of this many keys (the
# rest joins the chunk's causal part), so its cuDNN graphs depend on few prefix lengths
# (ZIPFUSION_SPLIT_PREFIX_GRAIN overrides it; 1: the whole prefix, one graph per prefix length)
SPLIT_PREFIX_GRAIN = int(os.environ.get("ZIPFUSION_SPLIT_PREFIX_GRAIN", 2048))


@dataclass
class ChunkView:
    """A prefill chunk as attention sees it: ``length`` tokens at positions ``start..``, the
    request's pages (its first ``start`` tokens are already in them)."""
    start: int
    length: int
    pages: list[int]

    @property
    def used_pages(self) -> list[int]:
        """The pages holding the chunk's request up to its last token."""
        return self.pages[:-(-(self.start + self.length) // PAGE_TOKENS)]


class AttentionBackend:
    """Decode and prefill attention over a KV cache, as the engine's config says.

    ``kind``: "kernel" (our kernels: CUDA C++ / Triton decode, the paged prefill kernel; on CPU
    tensors through the Triton interpreter, slowly), "torch" (fp32/fp64 torch over read pages),
    "flashinfer" (FlashInfer's paged decode over open pages) or "auto" (kernel on CUDA, torch
    on the CPU). ``kv_compression``: the cache compresses full pages (the fused kernels read them;
    otherwise the uncompressed twins, bit-identical on open pages).
    """

    def __init__(self, cache, kind: str = "auto", *, kv_compression: bool, deterministic: bool = False,
                 num_qo_heads: int, sm_scale: float, packed: bool = False):
        cuda = cache.device.type == "cuda"
        arena = getattr(cache, "arena", None)
        self.check_kind(kind, cache.device, cache.dtype)
        self.kind = ("kernel" if cuda and arena is not None else "torch") if kind == "auto" else kind
        self.cache, self.kv_compression, self.deterministic = cache, kv_compression, deterministic
        self.sm_scale, self.num_qo_heads = sm_scale, num_qo_heads
        # deterministic: a fixed split of every request's pages, whatever the batch
        self._split = {"split_pages": DETERMINISTIC_SPLIT_PAGES} if deterministic else {}
        # decode rows behind one shared prefix share the decode kernel's restores of its pages
        # (packing.py); not batch-invariant
        self.packed = packed and self.kind == "kernel" and not deterministic
        self._packed: PackedPlan | None = None             # this step's, from prepare_decode
        self._packed_buffers: PackedPlan | None = None    # packed CUDA graphs' inputs (packed_graph_buffers)
        # ZIPFUSION_CHECK_PAGES=1: every decode call first asserts its pages on the device
        # (kernels/decode_attention.py: check_ids_async), to turn a bad location into an error
        self.check_pages = os.environ.get("ZIPFUSION_CHECK_PAGES") == "1"
        self._flashinfer = None
        if self.kind == "flashinfer":
            from ..kernels.flashinfer_decode import FlashInferDecode
            self._flashinfer = FlashInferDecode(arena, cache.layout, num_qo_heads, cache.manager.chunk_bytes)

    @staticmethod
    def check_kind(kind: str, device: torch.device, dtype: torch.dtype) -> None:
        """The rules of a backend kind that need the resolved device and dtype (the EngineConfig
        checks those between options); the engine asks before it builds the model."""
        if kind in ("kernel", "flashinfer") and dtype != torch.bfloat16:
            raise ValueError(f"attention_backend={kind!r} reads bfloat16 pages; dtype {dtype} runs with "
                             "attention_backend='torch' (or 'auto')")
        if kind == "flashinfer" and device.type != "cuda":
            raise ValueError(f"attention_backend='flashinfer' runs on CUDA only, the KV cache is on {device}")

    @property
    def graph_safe(self) -> bool:
        """Whether a decode step can be captured as a CUDA graph (torch attention reads the
        context lengths on the host: dynamic shapes)."""
        return self.kind != "torch"

    @classmethod
    def from_config(cls, config, cache, model_config, tp_size: int = 1) -> "AttentionBackend":
        """The engine's backend (``tp_size``: this rank holds 1/tp_size of the heads)."""
        return cls(cache, config.attention_backend, kv_compression=cache.kv_compression,
                   deterministic=config.deterministic, num_qo_heads=model_config.num_attention_heads // tp_size,
                   sm_scale=1.0 / math.sqrt(model_config.head_dim), packed=config.packed_decode)

    def warm_up_prefill(self, max_tokens: int) -> None:
        """Build cuDNN's prefill graphs before the first request (CUDA, bf16/fp16): a whole
        prompt's causal call for every bucket up to ``max_tokens`` tokens, and one prefix call of
        a split chunk. torch builds a graph per new shape, ~45 ms each on an H200 and 0.5-0.8 s for
        the first of a kind (benchmarks/results/prefill_h200/cudnn_graph_builds.txt), which
        the first requests would otherwise wait for; graphs of longer prefixes are built when first
        met."""
        c = self.cache
        if not _cudnn(torch.empty(0, dtype=c.dtype, device=c.device)):
            return
        q = torch.zeros(-(-max_tokens // CUDNN_BUCKET) * CUDNN_BUCKET, self.num_qo_heads, c.head_dim,
                        dtype=c.dtype, device=c.device)
        kv = torch.zeros(max(q.shape[0], SPLIT_PREFIX_GRAIN), c.num_kv_heads, c.head_dim, dtype=c.dtype,
                         device=c.device)
        for n in range(CUDNN_BUCKET, q.shape[0] + 1, CUDNN_BUCKET):
            _attend_lse(q[:n], kv[:n], kv[:n], True, self.sm_scale)
        _attend_lse(q[:CUDNN_BUCKET], kv[:SPLIT_PREFIX_GRAIN], kv[:SPLIT_PREFIX_GRAIN], False, self.sm_scale)

    # -- per step ---------------------------------------------------------------------------
    def prepare_decode(self, context_lens: torch.Tensor, block_table: torch.Tensor, graph: bool = False) -> str:
        """Host-side set-up of a step's decode rows before the forward (or the CUDA-graph
        replay; ``graph``: the batch is a graph bucket): host ``context_lens`` [B] and
        ``block_table`` [B, W]: FlashInfer's plan, or packed requests over shared prefixes (used
        by the next :meth:`plan`). Returns how the step runs: "graph" (the
        bucket's CUDA graph may replay), "packed" (its packed graph: the packed requests are in
        that graph's buffers) or "eager"."""
        self._packed = None
        if self.packed:
            plan = plan_packed(context_lens, block_table, self.num_qo_heads, self.cache.num_kv_heads)
            if plan is not None:
                bufs = self._packed_buffers
                if graph and bufs is not None and plan.block_table.shape[1] <= bufs.block_table.shape[1]:
                    self._packed = bufs.view(len(context_lens))
                    self._packed.fill(plan)
                    return "packed"
                self._packed = plan.to(self.cache.device)
                return "eager"
        if self._flashinfer is not None:
            self._flashinfer.prepare(context_lens, block_table, self.sm_scale, graph)
        return "graph"

    def packed_graph_buffers(self, max_batch: int, max_pages: int) -> bool:
        """Allocate the packed CUDA graphs' inputs for up to ``max_batch`` rows of up to
        ``max_pages`` pages; returns whether steps here may pack (a packed graph to capture)."""
        R = rows_per_request(self.num_qo_heads, self.cache.num_kv_heads) if self.packed else 0
        if R:
            self._packed_buffers = PackedPlan.empty(max_batch, R, R * max_pages, max_batch,
                                                    device=self.cache.device)
        return bool(R)

    def use_packed_buffers(self, bs: int) -> None:
        """The next :meth:`plan` reads the packed graph buffers' first ``bs`` requests (graph
        capture)."""
        self._packed = self._packed_buffers.view(bs)

    def plan(self, page_ids: torch.Tensor, slots: torch.Tensor, num_decode: int = 0,
             block_table: torch.Tensor | None = None, context_lens: torch.Tensor | None = None,
             chunks: list[ChunkView] = ()) -> "PagedKVCacheStep":
        """The step's :class:`PagedKVCacheStep`: where each token's K/V go (``page_ids``, ``slots`` [T],
        on the device) and what each row attends to."""
        packed, self._packed = self._packed, None            # prepare_decode's, for this step only
        return PagedKVCacheStep(self, page_ids, slots, num_decode, block_table, context_lens, list(chunks),
                                packed if num_decode else None)

    # -- per layer --------------------------------------------------------------------------
    def decode(self, layer: int, q: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor,
               **packed):
        """q [B, Hq, D] -> [B, Hq, D]: each row over its request's pages (``packed``: the kernel's
        ``spans`` and ``slot_heads``, packing.py)."""
        cache = self.cache
        if self._flashinfer is not None:
            return self._flashinfer.run(q, cache.page_loc[layer])
        if self.kind == "kernel":
            from ..kernels import decode_attention, decode_attention_twin
            kernel = decode_attention if self.kv_compression else decode_attention_twin
            if self.check_pages:
                from ..kernels.decode_attention import check_ids_async
                check_ids_async(cache.arena, cache.page_loc[layer], block_table, context_lens, cache.layout,
                                None if self.kv_compression else "decode_attention_twin")
            # the engine builds valid tables; validate=False keeps the call free of host syncs
            return kernel(q, cache.arena, cache.page_loc[layer], block_table, context_lens,
                          cache.layout, self.sm_scale, validate=False, **self._split, **packed)
        return torch_decode_attention(q, lambda ids: cache.read_pages(layer, ids), block_table,
                                      context_lens, self.sm_scale, exact=self.deterministic)

    def paged_prefill(self, layer: int, q: torch.Tensor, plan: Chunks) -> torch.Tensor:
        """The paged prefill kernel over the chunks of ``plan`` (the engine builds valid tables:
        unchecked, no host sync)."""
        from ..kernels.prefill_attention import paged_prefill_attention
        c = self.cache
        return paged_prefill_attention(q, c.arena, c.page_loc[layer], plan.block_table, plan.q_indptr,
                                       plan.q_start, c.layout, self.sm_scale, compressed=self.kv_compression,
                                       plan=plan.work, validate=False)

    def decode_over_open_copy(self, layer: int, q: torch.Tensor, pages: torch.Tensor, context_lens: torch.Tensor):
        """The decode kernel's rows (q [n, Hq, D], each with its context length) over an open copy
        of one request's ``pages``: the twin on restored pages, bit-identical to the fused kernel
        on the pages themselves (see the module docstring)."""
        from ..kernels import decode_attention_twin
        c, P = self.cache, pages.numel()
        k, v = self.read_context(layer, pages, P * PAGE_TOKENS)          # whole pages, as stored
        H, D = c.num_kv_heads, c.head_dim
        copy = torch.stack([k.view(P, PAGE_TOKENS, H, D), v.view(P, PAGE_TOKENS, H, D)], dim=1)
        arena = copy.view(-1).view(torch.uint8)
        loc = open_loc(torch.arange(P, dtype=torch.int64, device=q.device) * c.layout.open_page_bytes)
        table = torch.arange(P, dtype=torch.int32, device=q.device).expand(q.shape[0], P)
        return decode_attention_twin(q, arena, loc, table, context_lens, c.layout, self.sm_scale,
                                     validate=False, **self._split)

    def read_context(self, layer: int, pages: torch.Tensor, num_tokens: int):
        """K, V [num_tokens, H, D] of a request's first tokens, restored from its pages."""
        if self.kind in ("kernel", "flashinfer"):                         # the arena's pages
            from ..kernels.prefill_attention import gather_kv
            c = self.cache
            return gather_kv(c.arena, c.page_loc[layer], pages, num_tokens, c.layout, compressed=self.kv_compression)
        return self.cache.read_tokens(layer, pages.tolist(), num_tokens)

    def route(self, ch: ChunkView) -> str:
        """How a prefill chunk attends: "fresh", "rows", "copy" (rows over an open copy of the
        pages), "paged" or "gather" (module docstring)."""
        if self.deterministic:
            long_compressed = self.kind == "kernel" and self.kv_compression and ch.length > ROWS_MAX_TOKENS
            return "copy" if long_compressed else "rows"
        if ch.start == 0:
            return "fresh"
        if self.kind == "kernel" and ch.length <= ROWS_MAX_TOKENS:
            return "rows"
        if self.kind == "kernel" and self.cache.device.type == "cpu":
            return "paged"
        return "gather"


class PagedKVCacheStep(KVCacheStep):
    """The model's :class:`KVCacheStep` over the engine's paged KV cache for one step, made by
    :meth:`AttentionBackend.plan`."""

    def __init__(self, backend: AttentionBackend, page_ids, slots, num_decode, block_table, context_lens,
                 chunks: list[ChunkView], packed: PackedPlan | None = None):
        self.backend, self.cache = backend, backend.cache
        self.packed = packed
        self.page_ids, self.slots = page_ids, slots
        self.num_decode, self.block_table, self.context_lens = num_decode, block_table, context_lens
        self.chunks = chunks
        device = page_ids.device
        self._routes = [backend.route(ch) for ch in chunks]
        # "rows": the chunk's tokens as decode rows (its request's pages, each token's length)
        self._rows = {i: _decode_rows(ch, device) for i, ch in enumerate(chunks) if self._routes[i] == "rows"}
        self._paged = _paged_chunks(backend, chunks, self._routes, num_decode, device)
        # "copy": the request's pages and each token's context length
        self._pages = {i: (torch.tensor(ch.used_pages, dtype=torch.int32, device=device),
                           torch.arange(ch.start + 1, ch.start + ch.length + 1, dtype=torch.int32, device=device))
                       for i, ch in enumerate(chunks) if self._routes[i] == "copy"}
        self._gather = _varlen_batch(chunks, self._routes, num_decode, device)

    def store(self, layer, q, k, v, cos, sin):
        return self.cache.store(layer, q, k, v, cos, sin, self.page_ids, self.slots, want_kv=bool(self.chunks))

    def decode(self, layer, q):
        """The step's decode rows: packed requests where the backend planned them, else the kernel."""
        if self.packed is not None:
            return self.packed.run(self.backend, layer, q)
        return self.backend.decode(layer, q, self.block_table, self.context_lens)

    def attend(self, layer, q, k, v):
        n, b = self.num_decode, self.backend
        if not self.chunks:
            return self.decode(layer, q)
        out = torch.empty_like(q)
        if n:
            out[:n] = self.decode(layer, q[:n])
        if self._paged is not None:
            out[self._paged.rows] = b.paged_prefill(layer, q[self._paged.rows], self._paged)
        if self._gather is not None:                       # every "gather" chunk in one call
            vb = self._gather                              # (k, v stay this step's fresh K/V)
            kg, vg = vb.keys(lambda pages, n: b.read_context(layer, pages, n))
            out[vb.rows] = varlen_prefill(q[vb.rows], kg.to(q.dtype), vg.to(q.dtype), vb, b.sm_scale)
        off = n
        for i, ch in enumerate(self.chunks):
            sl = slice(off, off + ch.length)
            off += ch.length
            route = self._routes[i]
            if route == "copy":
                out[sl] = b.decode_over_open_copy(layer, q[sl], *self._pages[i])
            elif route == "rows":
                out[sl] = b.decode(layer, q[sl], *self._rows[i])
            elif route == "fresh":
                out[sl] = prefill_attention(q[sl], k[sl], v[sl], 0, b.sm_scale)
        return out


@dataclass
class VarlenBatch:
    """The step's "gather" chunks as one variable-length attention: their rows in the step's q,
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

    def keys(self, read) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [cu_k[-1], H, D]; ``read(pages, n)``: the first n tokens of those pages restored."""
        k, v = read(self.pages, self.pages.numel() * PAGE_TOKENS)
        return k[self.token_index], v[self.token_index]


def _varlen_batch(chunks: list[ChunkView], routes: list[str], num_decode: int, device) -> VarlenBatch | None:
    picked, rows, cu_q, cu_k, off = [], [], [0], [0], num_decode
    for ch, route in zip(chunks, routes):
        if route == "gather":
            picked.append(ch)
            rows.append(torch.arange(off, off + ch.length))
            cu_q.append(cu_q[-1] + ch.length)
            cu_k.append(cu_k[-1] + ch.start + ch.length)
        off += ch.length
    if not picked:
        return None
    pages = torch.tensor([p for ch in picked for p in ch.used_pages], dtype=torch.int64)
    uniq, inverse = torch.unique(pages, return_inverse=True)
    index, at = [], 0
    for ch in picked:                  # token t of a chunk's keys: slot t % 16 of its page t // 16
        n, used = ch.start + ch.length, len(ch.used_pages)
        t = torch.arange(n)
        index.append(inverse[at:at + used][t // PAGE_TOKENS] * PAGE_TOKENS + t % PAGE_TOKENS)
        at += used
    cu = to_device(torch.tensor([cu_q, cu_k], dtype=torch.int32), device)  # pinned: no wait for the GPU
    return VarlenBatch(to_device(torch.cat(rows), device), cu[0], cu[1], max(ch.length for ch in picked),
                       max(ch.start + ch.length for ch in picked), to_device(uniq.to(torch.int32), device),
                       to_device(torch.cat(index), device), list(zip(cu_q, cu_q[1:], cu_k, cu_k[1:])))


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


def varlen_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vb: VarlenBatch, scale: float) -> torch.Tensor:
    """Causal attention of several chunks at once: chunk j's queries (rows cu_q[j]..cu_q[j+1]) are
    the last tokens of its keys (cu_k[j]..cu_k[j+1]); query i of a chunk of n sees the keys up to
    its own position (bottom-right causal). K/V heads are shared by query-head groups (GQA).
    One varlen FlashAttention call on CUDA; elsewhere (the CPU) SDPA chunk by chunk."""
    if _cudnn(q) and min(q1 - q0 for q0, q1, _, _ in vb.spans) >= SPLIT_MIN_TOKENS:
        return torch.cat([split_prefill(q[q0:q1], k[k0:k1], v[k0:k1], scale) for q0, q1, k0, k1 in vb.spans])
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

    Neither part needs the bottom-right mask that only FlashAttention's kernels take (~340
    TFLOP/s on an H200), so both run on cuDNN's (~600 for a whole 8K prompt; docs/benchmarks.md).
    cuDNN builds a graph per shape (``_attend_lse``): part b's depends on the bucket of r + n
    alone, part a's on n's bucket and P', a multiple of ``grain`` (SPLIT_PREFIX_GRAIN on CUDA), so
    a run meets a few shapes however its chunks fall. The r <= grain - 1 zero rows cost at most
    r²/2 extra score entries; with P < grain part a is empty and part b is the whole answer. The
    merge is fp32, on [n, Hq, D]: a small fraction of the attention's cost."""
    n, L = q.shape[0], k.shape[0]
    grain = grain or (SPLIT_PREFIX_GRAIN if _cudnn(q) else 1)
    P = L - n
    Pa, r = P // grain * grain, P % grain
    qb = F.pad(q, (0, 0, 0, 0, r, 0)) if r else q                    # r zero rows in front
    o_b, lse_b = _attend_lse(qb, k[Pa:], v[Pa:], True, scale)
    o_b, lse_b = o_b[r:], lse_b[r:]
    if Pa == 0:
        return o_b.to(q.dtype)
    o_a, lse_a = _attend_lse(q, k[:Pa], v[:Pa], False, scale)
    lse = torch.logaddexp(lse_a, lse_b)
    o = o_a.float() * torch.exp(lse_a - lse)[..., None] + o_b.float() * torch.exp(lse_b - lse)[..., None]
    return o.to(q.dtype)


def _attend_lse(q, k, v, causal: bool, scale: float, bucket: int | None = None):
    """(o [n, Hq, D], lse [n, Hq] fp32) of q over k, v (causal: top-left, k as long as q). CUDA
    (bf16, fp16): cuDNN's SDPA kernel, which returns its log-sum-exp; elsewhere the same in fp32
    torch (tests).

    cuDNN builds an execution graph for every new shape (~45 ms of host time on an H200, ~0.5-0.8 s
    for the first of a kind; docs/benchmarks.md), and a workload's prompts and chunks come in
    every length. So the queries are padded with zero rows up to a multiple of ``bucket`` (default
    CUDNN_BUCKET on CUDA) and the padded rows' outputs dropped; for a causal call the keys are
    padded alike, which changes nothing for a real row: row i sees keys 0..i only, all real. A
    causal graph then depends on the bucket alone; a prefix's (uncausal) on the bucket and the
    prefix's length, which zero keys would change (they add e^0 to every softmax)."""
    n, Hq, _ = q.shape
    bucket = bucket or (CUDNN_BUCKET if _cudnn(q) else 1)
    if n % bucket:
        pad = lambda t: F.pad(t, (0, 0, 0, 0, 0, bucket - n % bucket))  # noqa: E731 - rows at the end
        q, (k, v) = pad(q), ((pad(k), pad(v)) if causal else (k, v))
        o, lse = _attend_lse(q, k, v, causal, scale, bucket)
        return o[:n], lse[:n]
    g, cudnn = Hq // k.shape[1], _cudnn(q)
    if cudnn:
        if g > 1 and not cudnn["gqa"]:
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        qb, kb, vb = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(qb, kb, vb, None, True, 0.0, causal, False,
                                                                    scale=scale)[:2]
        return o[0].transpose(0, 1), lse.reshape(Hq, n).transpose(0, 1).float()
    kf, vf = (t.float().repeat_interleave(g, dim=1) for t in (k, v))
    s = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    if causal:
        s = s.masked_fill(torch.ones(n, k.shape[0], dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)                                     # [Hq, n]
    return torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), vf), lse.transpose(0, 1)


def _cudnn(q: torch.Tensor) -> dict | None:
    """``_cudnn_lse()`` where cuDNN's SDPA takes q (CUDA, bf16 or fp16), else None."""
    return _cudnn_lse() if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) else None


@functools.cache
def _cudnn_lse() -> dict | None:
    """Whether this torch and GPU run cuDNN's SDPA with its log-sum-exp, and with GQA (K/V heads
    fewer than query heads) without repeating them (asked once, on a tiny problem)."""
    if not torch.cuda.is_available():
        return None
    op = torch.ops.aten._scaled_dot_product_cudnn_attention
    x = torch.randn(1, 4, 64, 128, dtype=torch.bfloat16, device="cuda")
    try:
        op(x, x, x, None, True, 0.0, False, False)
    except Exception:                               # noqa: BLE001 - no cuDNN SDPA here: varlen route
        return None
    try:
        op(x, x[:, :2], x[:, :2], None, True, 0.0, False, False)
        return {"gqa": True}
    except Exception:                               # noqa: BLE001
        return {"gqa": False}


def _decode_rows(ch: ChunkView, device) -> tuple[torch.Tensor, torch.Tensor]:
    pages = ch.used_pages
    table = torch.tensor(pages, dtype=torch.int32, device=device).expand(ch.length, len(pages))
    lens = torch.arange(ch.start + 1, ch.start + ch.length + 1, dtype=torch.int32, device=device)
    return table, lens


@dataclass
class Chunks:
    """One launch of the paged prefill kernel, planned once per step for every layer: ``rows``
    picks its query rows from the step's q; one block-table row and start per chunk; the
    kernel's plan (work items)."""
    rows: torch.Tensor
    block_table: torch.Tensor
    q_indptr: torch.Tensor
    q_start: torch.Tensor
    work: object                     # kernels.prefill_attention.PrefillPlan


def make_chunks(rows, pages, rows_per_chunk, starts, num_q_heads: int, num_kv_heads: int, device) -> Chunks:
    """A launch of the paged prefill kernel from host lists: the step's q ``rows`` it reads, each
    chunk's ``pages`` (the block table, zero-padded), row count and start."""
    from ..kernels.prefill_attention import plan_prefill
    table = np.zeros((len(pages), max(len(p) for p in pages)), dtype=np.int32)
    for j, p in enumerate(pages):
        table[j, :len(p)] = p
    indptr = np.concatenate([[0], np.cumsum(rows_per_chunk)]).tolist()
    starts = [int(x) for x in starts]
    work = plan_prefill(indptr, starts, num_q_heads, num_kv_heads, device=device)
    i32 = lambda x: to_device(torch.tensor(x, dtype=torch.int32), device)  # noqa: E731
    return Chunks(to_device(rows, device), to_device(torch.from_numpy(table), device), i32(indptr), i32(starts), work)


def _paged_chunks(backend: AttentionBackend, chunks: list[ChunkView], routes: list[str], num_decode: int,
                  device) -> Chunks | None:
    """The inputs and plan of the paged prefill kernel for the chunks routed to it (host work:
    the step's only launch set-up; every layer reuses it)."""
    picked, off = [], num_decode
    for ch, route in zip(chunks, routes):
        if route == "paged":
            picked.append((ch, off))
        off += ch.length
    if not picked:
        return None
    rows = np.concatenate([np.arange(o, o + ch.length) for ch, o in picked])
    return make_chunks(rows, [ch.used_pages for ch, _ in picked], [ch.length for ch, _ in picked],
                       [ch.start for ch, _ in picked], backend.num_qo_heads, backend.cache.num_kv_heads, device)


def torch_decode_attention(q, read_pages, block_table, context_lens, sm_scale, exact: bool = False):
    """Decode attention in fp32 torch (fp64 when ``exact``: then a row's result does not depend
    on the batch's padding, up to ~1e-16 relative before the final rounding):
    q [B, Hq, D]; ``read_pages(ids) -> [n, 2, 16, H, D]``.

    o_b = softmax(sm_scale · q_b K_bᵀ) V_b over the first context_lens[b] tokens of request b,
    query head i reading KV head i // (Hq / H).
    """
    ftype = torch.float64 if exact else torch.float32
    B, Hq, D = q.shape
    lens = context_lens.to(torch.int64)
    max_pages = int(-(-int(lens.max()) // PAGE_TOKENS))
    table = block_table[:, :max_pages].to(torch.int64)
    used = torch.arange(max_pages, device=q.device)[None, :] * PAGE_TOKENS < lens[:, None]
    ids = torch.where(used, table, torch.zeros_like(table))
    uniq, inverse = torch.unique(ids[used], return_inverse=True)
    pages = read_pages(uniq)                                    # [n, 2, 16, H, D]
    H = pages.shape[3]
    slot = torch.zeros_like(ids)
    slot[used] = inverse
    kv = pages[slot]                                            # [B, P, 2, 16, H, D]
    k = kv[:, :, 0].reshape(B, max_pages * PAGE_TOKENS, H, D).to(ftype)
    v = kv[:, :, 1].reshape(B, max_pages * PAGE_TOKENS, H, D).to(ftype)
    qg = q.to(ftype).reshape(B, H, Hq // H, D)
    scores = torch.einsum("bhgd,bthd->bhgt", qg, k) * sm_scale
    valid = torch.arange(max_pages * PAGE_TOKENS, device=q.device)[None, :] < lens[:, None]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    v = v.masked_fill(~valid[:, :, None, None], 0.0)           # unwritten slots may hold NaN bits
    out = torch.einsum("bhgt,bthd->bhgd", scores.softmax(-1), v)
    return out.reshape(B, Hq, D).float().to(q.dtype)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Causal attention of q [n, Hq, D] (positions start..start+n-1) over k, v [start+n, H, D]:
    query i sees keys j <= start + i. Memory linear in n (no score matrix) on CUDA.

    CUDA: torch's fused kernels in bf16 -- cuDNN for a whole prompt (top-left causal, GQA native,
    its shapes bucketed: ``_attend_lse``), SDPA's FlashAttention where cuDNN is missing; with a
    prefix, SDPA's bottom-right causal variant (``causal_lower_right``, FlashAttention/memory-
    efficient kernels), K/V heads repeated for GQA. CPU (and fp32): SDPA.
    """
    if start == 0 and _cudnn(q):
        return _attend_lse(q, k, v, True, scale)[0]                          # cuDNN, its shapes bucketed
    n, Hq, _ = q.shape
    H = k.shape[1]
    qb, kb, vb = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))        # [1, heads, len, D]
    if start == 0:
        with sdpa_kernel(CUDA_SDPA, set_priority=True) if q.is_cuda else contextlib.nullcontext():
            o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=Hq != H)
    elif q.is_cuda:
        if Hq != H:
            kb, vb = kb.repeat_interleave(Hq // H, dim=1), vb.repeat_interleave(Hq // H, dim=1)
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=causal_lower_right(n, start + n), scale=scale)
    else:
        pos = torch.arange(start + n, device=q.device)
        mask = pos[None, :] <= (start + torch.arange(n, device=q.device))[:, None]
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=Hq != H)
    return o[0].transpose(0, 1)
