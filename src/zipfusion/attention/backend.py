"""The engine's attention: one backend made from the EngineConfig, planned once a step, run per layer
(plan/run), with one route object each for decode, prefill over fresh K/V and prefill over stored
pages. Routes depend only on a chunk's start and length, the config and the device.
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
    """A prefill chunk: ``length`` tokens at positions ``start..`` and its request's pages."""
    start: int
    length: int
    pages: list[int]

    @property
    def used_pages(self) -> list[int]:
        return self.pages[:-(-(self.start + self.length) // PAGE_TOKENS)]


class AttentionBackend:
    """Decode and prefill attention over a KV cache, as the engine's config says (``kind``: "kernel",
    "torch", "flashinfer" or "auto"; ``packed``: packed decode)."""

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
        fp8 = cache.kv_dtype == "fp8"
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
            self.prefill_open = self.prefill_stored = RowsPrefill(
                self.decode, read if kind == "kernel" and kv_compression and not fp8 else None)
        else:
            self.prefill_open = OpenPrefill(sm_scale)
            self.prefill_stored = GatherPrefill(read, sm_scale, RowsPrefill(self.decode) if kind == "kernel" else None,
                                                split_min_tokens, split_grain)
        # rows behind one shared prefix share the kernel's restores of it (not batch-invariant)
        self.packed = packed and kind == "kernel" and not deterministic and not fp8 and self.masked is None
        self._packed: PackedPlan | None = None             # this step's, from prepare_decode
        self._packed_buffers: PackedPlan | None = None    # packed CUDA graphs' inputs

    @staticmethod
    def check_kind(kind: str, device: torch.device, dtype: torch.dtype) -> None:
        """Rules of a backend kind that need the resolved device and dtype."""
        if kind in ("kernel", "flashinfer") and dtype != torch.bfloat16:
            raise ValueError(f"attention_backend={kind!r} reads bfloat16 pages; dtype {dtype} runs with "
                             "attention_backend='torch' (or 'auto')")
        if kind == "flashinfer" and device.type != "cuda":
            raise ValueError(f"attention_backend='flashinfer' runs on CUDA only, the KV cache is on {device}")

    @classmethod
    def from_config(cls, config, cache, model_config, tp_size: int = 1) -> "AttentionBackend":
        return cls(cache, config.attention_backend, kv_compression=cache.kv_compression,
                   deterministic=config.deterministic, num_qo_heads=model_config.num_attention_heads // tp_size,
                   sm_scale=model_config.softmax_scale, packed=config.packed_decode,
                   check_pages=config.check_pages, split_min_tokens=config.prefill_split_min_tokens,
                   split_grain=config.prefill_split_grain, tuning=config.tuning,
                   windows=model_config.sliding_windows, softcap=model_config.attn_softcap)

    @property
    def graph_safe(self) -> bool:
        return self.decode.graph_safe and (self.masked is None or self.masked.graph_safe)

    def warm_up_prefill(self, max_tokens: int) -> None:
        """Build cuDNN's prefill graphs for every step shape up to ``max_tokens`` before the first
        request, which would otherwise wait for them (CUDA, bf16/fp16)."""
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

    def prepare_decode(self, context_lens: torch.Tensor, block_table: torch.Tensor, graph: bool = False) -> str:
        """Host set-up of a step's decode rows before the forward: the decode route's plan, or
        packed requests for the next :meth:`plan`. Returns "graph", "packed" or "eager"."""
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
        """Allocate the packed CUDA graphs' inputs; returns whether steps here may pack."""
        R = rows_per_request(self.num_qo_heads, self.cache.num_kv_heads) if self.packed else 0
        from ..kernels.decode_attention import uses_cuda_kernel
        if R and not uses_cuda_kernel(None, self.cache.device, self.cache.layout,
                                      self.num_qo_heads // self.cache.num_kv_heads):
            R = 0                      # packed steps on the Triton route run eagerly
        if R:
            self._packed_buffers = PackedPlan.empty(max_batch, R, R * max_pages, max_batch,
                                                    device=self.cache.device)
        return bool(R)

    def use_packed_buffers(self, bs: int) -> None:
        """The next :meth:`plan` reads the packed graph buffers' first ``bs`` requests (capture)."""
        self._packed = self._packed_buffers.view(bs)

    def plan(self, page_ids: torch.Tensor, slots: torch.Tensor, num_decode: int = 0,
             block_table: torch.Tensor | None = None, context_lens: torch.Tensor | None = None,
             chunks: list[ChunkView] = ()) -> "PagedKVCacheStep":
        """The step's :class:`PagedKVCacheStep` (K/V destinations and what each row attends to)."""
        packed, self._packed = self._packed, None
        return PagedKVCacheStep(self, page_ids, slots, num_decode, block_table, context_lens, list(chunks),
                                packed if num_decode else None)


class PagedKVCacheStep(KVCacheStep):
    """The model's :class:`KVCacheStep` over the paged KV cache for one step; each prefill
    route's host work is planned here, once."""

    def __init__(self, backend: AttentionBackend, page_ids, slots, num_decode, block_table, context_lens,
                 chunks: list[ChunkView], packed: PackedPlan | None = None):
        self.backend, self.cache = backend, backend.cache
        self.packed = packed
        self.page_ids, self.slots = page_ids, slots
        self.num_decode, self.block_table, self.context_lens = num_decode, block_table, context_lens
        self.chunks = chunks
        at, off = [], num_decode
        for ch in chunks:
            at.append((off, ch))
            off += ch.length
        routes = ((backend.prefill_open, [c for c in at if c[1].start == 0]),
                  (backend.prefill_stored, [c for c in at if c[1].start > 0]))
        self._prefill = [(route, route.plan(picked, page_ids.device)) for route, picked in routes if picked]

    def store(self, layer, q, k, v, cos, sin):
        return self.cache.store(layer, q, k, v, cos, sin, self.page_ids, self.slots, want_kv=bool(self.chunks))

    def decode(self, layer, q):
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
        for route, plan in self._prefill:
            route.run(layer, q, k, v, out, plan)
        return out
