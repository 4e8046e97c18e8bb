"""The engine's attention: one backend object, made once from the EngineConfig, planned once per
step and run per layer (FlashInfer's plan/run shape). It is the only reader of
``attention_backend``, ``kv_compression`` (which kernel reads the pages) and ``deterministic``
for attention; the KV cache (memory/kv_cache.py) only holds memory.

When it is built the backend picks one object for each of three routes, by the config and the
device, and keeps them:

* ``decode`` (decode.py): a decode row over its request's pages -- our kernel (fused
  over compressed pages, or uncompressed; the Triton FP8 kernel over FP8 pages), torch, or
  FlashInfer's;
* ``prefill_open`` (prefill_open.py): a chunk that starts its request, over its own
  fresh K/V (cuDNN on the GPU, SDPA elsewhere);
* ``prefill_stored`` (prefill_stored.py): a chunk that continues its request, over the
  request's pages (restored and attended densely, or as decode rows).

Deterministic mode has one prefill route for both: every prefill token attends as a decode row
over its request's pages with its own context length (``RowsPrefill``), so that its sums run in
the same order wherever it was computed.

A step's tokens are flattened as ``[decode rows | prefill chunk 1 | prefill chunk 2 ...]``:
each decode row is one request's newest token, each chunk a run of one request's prompt (or
recomputed) tokens. :meth:`AttentionBackend.plan` turns that into a :class:`PagedKVCacheStep`, the
engine's implementation of the model's :class:`~zipfusion.models.llama.KVCacheStep`:

* ``store``: rope and K/V of every token written into its page slot (one call per layer), so a
  chunk's own K/V are in its pages before it attends;
* ``attend``: decode rows through the decode route (or as packed requests, packing.py), each
  chunk through its prefill route, with the host work planned once for the step.

A chunk's route depends only on where it starts, its length, the config and the device, so
compressed and uncompressed runs of one schedule take the same routes and give the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import PREFILL_SPLIT_GRAIN, PREFILL_SPLIT_MIN_TOKENS, Tuning
from ..format import PAGE_TOKENS
from ..models.llama import KVCacheStep
from .decode import FlashInferPagedDecode, Fp8KernelDecode, KernelDecode, MaskedAttention, TorchDecode
from .prefill_open import CUDNN_BUCKET, OpenPrefill, cudnn_takes
from .prefill_stored import GatherPrefill, RowsPrefill, page_reader
from .packing import PackedPlan, plan_packed, rows_per_request


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

    ``kind``: "kernel" (our kernels: CUDA C++ / Triton decode; on CPU tensors through the Triton
    interpreter, slowly), "torch" (fp32/fp64 torch over read pages), "flashinfer" (FlashInfer's
    paged decode over open pages) or "auto" (kernel on CUDA, torch on the CPU).
    ``kv_compression``: the cache compresses full pages (the fused kernel reads them; otherwise
    the uncompressed kernel, bit-identical on open pages). ``packed``: decode rows behind one
    shared prefix travel as packed requests (packing.py; the kernel, not deterministic).
    ``check_pages``: the kernel asserts every call's pages on the device first.
    ``split_min_tokens``, ``split_grain``: see prefill_stored.GatherPrefill.
    ``windows`` (per layer, None: no window) and ``softcap``: layers with a sliding window or
    soft-capped scores attend through :class:`~.decode.MaskedAttention` instead.
    """

    def __init__(self, cache, kind: str = "auto", *, kv_compression: bool, deterministic: bool = False,
                 num_qo_heads: int, sm_scale: float, packed: bool = False, check_pages: bool = False,
                 split_min_tokens: int = PREFILL_SPLIT_MIN_TOKENS, split_grain: int = PREFILL_SPLIT_GRAIN,
                 tuning: Tuning = Tuning(), windows: tuple = (), softcap: float | None = None):
        arena = getattr(cache, "arena", None)
        self.check_kind(kind, cache.device, cache.dtype)
        if kind == "auto":
            kind = "kernel" if cache.device.type == "cuda" and arena is not None else "torch"
        self.kind, self.cache, self.sm_scale, self.num_qo_heads = kind, cache, sm_scale, num_qo_heads
        self.split_grain, self.tuning = split_grain, tuning
        fp8 = cache.kv_dtype == "fp8"    # E4M3 pages (fp8_kv_cache.py): the FP8 kernel, FlashInfer's or torch
        if kind == "kernel" and fp8:
            self.decode = Fp8KernelDecode(cache, sm_scale, deterministic=deterministic, check_pages=check_pages)
        elif kind == "kernel":
            self.decode = KernelDecode(cache, sm_scale, compressed=kv_compression, deterministic=deterministic,
                                       check_pages=check_pages)
        elif kind == "flashinfer":
            self.decode = FlashInferPagedDecode(cache, sm_scale, num_qo_heads)
        else:
            self.decode = TorchDecode(cache, sm_scale, exact=deterministic)
        read = page_reader(cache, kind != "torch", kv_compression)
        route = self.decode if type(self.decode) in (KernelDecode, TorchDecode) else TorchDecode(
            cache, sm_scale, exact=deterministic)              # (FP8 and FlashInfer decode: no windows)
        self.masked = MaskedAttention(route, sm_scale, windows, softcap, read, cache.num_layers, deterministic)
        if not self.masked.layers:
            self.masked = None
        if deterministic:
            self.prefill_open = self.prefill_stored = RowsPrefill(      # (FP8: no open copy, rows over pages)
                self.decode, read if kind == "kernel" and kv_compression and not fp8 else None)
        else:
            self.prefill_open = OpenPrefill(sm_scale)
            self.prefill_stored = GatherPrefill(read, sm_scale, RowsPrefill(self.decode) if kind == "kernel" else None,
                                                split_min_tokens, split_grain)
        # decode rows behind one shared prefix share the decode kernel's restores of its pages
        # (packing.py); not batch-invariant
        self.packed = packed and kind == "kernel" and not deterministic and not fp8 and self.masked is None
        self._packed: PackedPlan | None = None             # this step's, from prepare_decode
        self._packed_buffers: PackedPlan | None = None    # packed CUDA graphs' inputs (packed_graph_buffers)

    @staticmethod
    def check_kind(kind: str, device: torch.device, dtype: torch.dtype) -> None:
        """The rules of a backend kind that need the resolved device and dtype (the EngineConfig
        checks those between options); the engine asks before it builds the model."""
        if kind in ("kernel", "flashinfer") and dtype != torch.bfloat16:
            raise ValueError(f"attention_backend={kind!r} reads bfloat16 pages; dtype {dtype} runs with "
                             "attention_backend='torch' (or 'auto')")
        if kind == "flashinfer" and device.type != "cuda":
            raise ValueError(f"attention_backend='flashinfer' runs on CUDA only, the KV cache is on {device}")

    @classmethod
    def from_config(cls, config, cache, model_config, tp_size: int = 1) -> "AttentionBackend":
        """The engine's backend (``tp_size``: this rank holds 1/tp_size of the heads)."""
        return cls(cache, config.attention_backend, kv_compression=cache.kv_compression,
                   deterministic=config.deterministic, num_qo_heads=model_config.num_attention_heads // tp_size,
                   sm_scale=model_config.softmax_scale, packed=config.packed_decode,
                   check_pages=config.check_pages, split_min_tokens=config.prefill_split_min_tokens,
                   split_grain=config.prefill_split_grain, tuning=config.tuning,
                   windows=model_config.sliding_windows, softcap=model_config.attn_softcap)

    @property
    def graph_safe(self) -> bool:
        """Whether a decode step can be captured as a CUDA graph."""
        return self.decode.graph_safe and (self.masked is None or self.masked.graph_safe)

    def warm_up_prefill(self, max_tokens: int) -> None:
        """Build cuDNN's prefill graphs before the first request (CUDA, bf16/fp16): the prefill
        routes' calls for every shape a step of up to ``max_tokens`` tokens starts with. torch
        builds a graph per new shape (tens of milliseconds each, more for the first of a kind:
        docs/benchmarks.md), which the first requests would otherwise wait for."""
        c = self.cache
        if not cudnn_takes(torch.empty(0, c.head_dim, dtype=c.dtype, device=c.device)):
            return
        q = torch.zeros(-(-max_tokens // CUDNN_BUCKET) * CUDNN_BUCKET, self.num_qo_heads, c.head_dim,
                        dtype=c.dtype, device=c.device)
        kv = torch.zeros(max(q.shape[0], self.split_grain), c.num_kv_heads, c.head_dim, dtype=c.dtype,
                         device=c.device)
        self.prefill_open.warm_up(q, kv)
        if self.prefill_stored is not self.prefill_open:
            self.prefill_stored.warm_up(q, kv)

    # -- per step ---------------------------------------------------------------------------
    def prepare_decode(self, context_lens: torch.Tensor, block_table: torch.Tensor, graph: bool = False) -> str:
        """Host-side set-up of a step's decode rows before the forward (or the CUDA-graph
        replay; ``graph``: the batch is a graph bucket): host ``context_lens`` [B] and
        ``block_table`` [B, W]: the decode route's plan, or packed requests over shared prefixes
        (used by the next :meth:`plan`). Returns how the step runs: "graph" (the bucket's CUDA
        graph may replay), "packed" (its packed graph: the packed requests are in that graph's
        buffers) or "eager"."""
        self._packed = None
        if self.packed:
            plan = plan_packed(context_lens, block_table, self.num_qo_heads, self.cache.num_kv_heads, self.tuning)
            if plan is not None:
                bufs = self._packed_buffers
                if graph and bufs is not None and plan.block_table.shape[1] <= bufs.block_table.shape[1]:
                    self._packed = bufs.view(len(context_lens))
                    self._packed.fill(plan)
                    return "packed"
                self._packed = plan.to(self.cache.device)
                return "eager"
        self.decode.prepare(context_lens, block_table, graph)
        return "graph"

    def packed_graph_buffers(self, max_batch: int, max_pages: int) -> bool:
        """Allocate the packed CUDA graphs' inputs for up to ``max_batch`` rows of up to
        ``max_pages`` pages; returns whether steps here may pack (a packed graph to capture)."""
        R = rows_per_request(self.num_qo_heads, self.cache.num_kv_heads) if self.packed else 0
        from ..kernels.decode_attention import uses_cuda_kernel
        if R and not uses_cuda_kernel(None, self.cache.device, self.cache.layout,
                                      self.num_qo_heads // self.cache.num_kv_heads):
            R = 0                      # the Triton route's host work: packed steps run eagerly
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


class PagedKVCacheStep(KVCacheStep):
    """The model's :class:`KVCacheStep` over the engine's paged KV cache for one step, made by
    :meth:`AttentionBackend.plan`: each prefill route's host work is planned here, once."""

    def __init__(self, backend: AttentionBackend, page_ids, slots, num_decode, block_table, context_lens,
                 chunks: list[ChunkView], packed: PackedPlan | None = None):
        self.backend, self.cache = backend, backend.cache
        self.packed = packed
        self.page_ids, self.slots = page_ids, slots
        self.num_decode, self.block_table, self.context_lens = num_decode, block_table, context_lens
        self.chunks = chunks
        at, off = [], num_decode                           # (the chunk's first row in the step, chunk)
        for ch in chunks:
            at.append((off, ch))
            off += ch.length
        routes = ((backend.prefill_open, [c for c in at if c[1].start == 0]),
                  (backend.prefill_stored, [c for c in at if c[1].start > 0]))
        self._prefill = [(route, route.plan(picked, page_ids.device)) for route, picked in routes if picked]

    def store(self, layer, q, k, v, cos, sin):
        return self.cache.store(layer, q, k, v, cos, sin, self.page_ids, self.slots, want_kv=bool(self.chunks))

    def decode(self, layer, q):
        """The step's decode rows: packed requests where the backend planned them, else the route."""
        if self.packed is not None:
            return self.packed.run(self.backend.decode, layer, q, self.cache.num_kv_heads)
        return self.backend.decode(layer, q, self.block_table, self.context_lens)

    def attend(self, layer, q, k, v):
        n = self.num_decode
        if self.backend.masked is not None and layer in self.backend.masked.layers:
            return self.backend.masked.attend(layer, q, k, v, self)
        if not self.chunks:
            return self.decode(layer, q)
        out = torch.empty_like(q)
        if n:
            out[:n] = self.decode(layer, q[:n])
        for route, plan in self._prefill:                  # (k, v: this step's fresh K/V)
            route.run(layer, q, k, v, out, plan)
        return out
