"""The engine's view of the KV cache: pages to allocate, K/V to store, pages to attend over.

* :class:`ArenaKVCache` -- BF16 pages in the memory manager's arena (docs/design.md). Full pages
  are compressed when ``compress=True``. On CUDA, rope + store is one Triton kernel and decode
  attention is the fused kernel (its uncompressed twin when compression is off).
* :class:`DenseKVCache` -- pages of any dtype (float32 for exactness tests) in one tensor,
  never compressed; torch throughout.

Both address K/V by page id and slot (token % 16) and offer the same methods, so the
scheduler, the runner and :class:`~zipfusion.engine.attention.StepKV` do not care which.
"""

from __future__ import annotations

import math

import torch

from ..format import PAGE_TOKENS, PageLayout
from ..models.layers import apply_rope


# deterministic mode: the attention kernels split every request's KV into runs of this many
# pages, whatever the batch (a split count chosen from the batch would order the sums differently)
DETERMINISTIC_SPLIT_PAGES = 64


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


ATTENTION_BACKENDS = ("auto", "kernel", "torch", "flashinfer")


def check_attention_backend(backend: str, compress: bool, deterministic: bool = False) -> None:
    """One-line ValueError for a backend that cannot serve this cache."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {list(ATTENTION_BACKENDS)}, got {backend!r}")
    if backend == "flashinfer" and compress:
        raise ValueError("attention_backend='flashinfer' reads uncompressed pages only; pass kv_compression=False")
    if backend == "flashinfer" and deterministic:
        raise ValueError("attention_backend='flashinfer' is not batch-invariant; drop deterministic=True "
                         "or use attention_backend='auto'")


class KVCache:
    """What both caches share; subclasses hold the pages."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    compress: bool = False
    deterministic: bool = False     # batch-invariant attention (fixed KV splits; fp64 in torch)

    def read_tokens(self, layer: int, pages: list[int], n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [n_tokens, H, D] of a request's first ``n_tokens`` tokens (its prefix)."""
        n_pages = -(-n_tokens // PAGE_TOKENS)
        kv = self.read_pages(layer, pages[:n_pages])                        # [n, 2, 16, H, D]
        kv = kv.transpose(0, 1).reshape(2, n_pages * PAGE_TOKENS, self.num_kv_heads, self.head_dim)
        return kv[0, :n_tokens], kv[1, :n_tokens]

    def stored_ratio(self) -> float:
        """Bytes of stored full pages over their open size (1.0 when nothing is compressed)."""
        return 1.0

    def prepare_decode(self, context_lens: torch.Tensor, block_table: torch.Tensor, sm_scale: float,
                       graph: bool = False) -> None:
        """Host-side set-up of a step's decode rows before the forward (or the CUDA-graph
        replay; ``graph``: the batch is a graph bucket): host ``context_lens`` [B] and
        ``block_table`` [B, W]. Only the FlashInfer backend needs it (its plan)."""


class ArenaKVCache(KVCache):
    """BF16 pages in the arena of :class:`zipfusion.memory.KVCacheManager`."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, budget_bytes: int,
                 device, compress: bool = True, attention_backend: str = "auto",
                 fused_store: bool | None = None, deterministic: bool = False,
                 num_qo_heads: int | None = None, **manager_kwargs):
        """``attention_backend``: "kernel" (our kernels; on CPU tensors the Triton ones run in
        the interpreter, slowly), "torch" (fp32 torch over read pages), "auto" (kernel on CUDA),
        "flashinfer" (FlashInfer's paged decode; uncompressed, CUDA, needs ``num_qo_heads``).
        ``fused_store``: rope + K/V store as one Triton kernel (default: on CUDA).
        ``deterministic``: batch-invariant attention (DETERMINISTIC_SPLIT_PAGES)."""
        check_attention_backend(attention_backend, compress, deterministic)
        from ..memory import KVCacheManager
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.layout = PageLayout(num_kv_heads, head_dim)
        self.dtype, self.device, self.compress = torch.bfloat16, torch.device(device), compress
        self.manager = KVCacheManager(num_layers, self.layout, int(budget_bytes), self.device,
                                      compression=compress, **manager_kwargs)
        cuda = self.device.type == "cuda"
        self._use_kernel = attention_backend == "kernel" or (attention_backend == "auto" and cuda)
        self._flashinfer = None
        if attention_backend == "flashinfer":
            from ..kernels.flashinfer_decode import FlashInferDecode
            self._flashinfer = FlashInferDecode(self.arena, self.layout, num_qo_heads, self.manager.chunk_bytes)
        self.fused_store = cuda if fused_store is None else fused_store
        self.deterministic = deterministic

    @property
    def arena(self) -> torch.Tensor:
        return self.manager.arena

    @property
    def seal_batch(self) -> int:
        """Full pages worth one compress call (the manager compresses a group's worth at a time)."""
        return self.manager.slots_per_chunk if self.compress else 1

    @property
    def page_loc(self) -> torch.Tensor:
        return self.manager.page_loc

    def alloc(self, n, keep_reserve: bool = True):
        return list(self.manager.alloc_pages(n, keep_reserve)) if n > 0 else []

    def free(self, ids):
        if ids:
            self.manager.free_pages(list(ids))

    def seal(self, ids, min_capacity: int = 0):
        """Compress full pages; returns the ids left open (no room yet, or room promised to
        running requests: ``min_capacity`` new pages must still fit). They stay readable as
        open pages; the scheduler offers them again later."""
        if not ids or not self.compress:
            return []
        return self.manager.compress_pages(list(ids), min_capacity=min_capacity)

    def capacity_new_pages(self, keep_reserve: bool = True):
        """New pages that fit now; ``keep_reserve=False`` counts the compression reserve too
        (the last resort before preempting a running request)."""
        return int(self.manager.capacity_new_pages(keep_reserve=keep_reserve))

    def stored_ratio(self):
        return self.manager.stored_ratio()

    def store(self, layer, q, k, v, cos, sin, page_ids, slots, want_kv: bool):
        """Rotate q, k (models.layers.RotaryEmbedding's arithmetic) and write k, v as bf16 into
        the open pages at (page_ids[t], slots[t]); returns (q, k, v) rotated (k, v None unless
        ``want_kv``: decode rows read everything from the pages)."""
        if self.fused_store:
            from ..models.fused import rope_and_store
            q, k = rope_and_store(q, k, v, cos, sin, self.arena, self.page_loc[layer], page_ids, slots,
                                  want_k=want_kv)
            return q, k, (v if want_kv else None)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        idx = self.layout.open_elements(self.page_loc[layer, page_ids], slots)        # [T, 2, H, D]
        vals = torch.stack([k, v], dim=1).to(torch.bfloat16)
        self.arena.view(torch.bfloat16).index_copy_(0, idx.reshape(-1), vals.reshape(-1))
        return q, k, v

    def read_pages(self, layer, ids):
        """Pages [n, 2, 16, H, D] bf16: open ones copied, compressed ones decoded."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return self.manager.read_pages(layer, ids)

    def prepare_decode(self, context_lens, block_table, sm_scale, graph: bool = False):
        if self._flashinfer is not None:
            self._flashinfer.prepare(context_lens, block_table, sm_scale, graph)

    def decode_attention(self, layer, q, block_table, context_lens, sm_scale):
        if self._flashinfer is not None:
            return self._flashinfer.run(q, self.page_loc[layer])
        if self._use_kernel:
            from ..kernels import decode_attention, decode_attention_twin
            kernel = decode_attention if self.compress else decode_attention_twin
            kw = {"split_pages": DETERMINISTIC_SPLIT_PAGES} if self.deterministic else {}
            # the engine builds valid tables; validate=False keeps the call free of host syncs
            return kernel(q, self.arena, self.page_loc[layer], block_table, context_lens,
                          self.layout, sm_scale, validate=False, **kw)
        return torch_decode_attention(q, lambda ids: self.read_pages(layer, ids), block_table,
                                      context_lens, sm_scale, exact=self.deterministic)

    def stats(self):
        """The manager's numbers plus what the engine reports: bytes in use vs all-open."""
        s = self.manager.stats()
        d = s.as_dict()
        pages = d["open_pages"] + d["stored_pages"]
        d["pages_in_use"] = pages
        d["bytes_in_use"] = s.used_bytes
        d["open_bytes_equivalent"] = pages * self.num_layers * self.layout.open_page_bytes
        return d


class DenseKVCache(KVCache):
    """``num_pages`` pages of any dtype in one tensor [L, P, 2, 16, H, D]; no compression."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int,
                 dtype: torch.dtype, device):
        if num_pages < 1:
            raise ValueError(f"the KV memory holds no page (num_pages={num_pages}); give more kv_memory_gb")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.kv = torch.zeros(num_layers, num_pages, 2, PAGE_TOKENS, num_kv_heads, head_dim,
                              dtype=dtype, device=self.device)
        self._free = list(range(num_pages - 1, -1, -1))
        self.num_pages = num_pages

    @staticmethod
    def pages_for(budget_bytes: int, num_layers, num_kv_heads, head_dim, dtype) -> int:
        per_page = num_layers * 2 * PAGE_TOKENS * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8
        return int(budget_bytes // per_page)

    def alloc(self, n, keep_reserve: bool = True):
        if n > len(self._free):
            raise RuntimeError(f"KV cache full: {n} pages wanted, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, ids):
        self._free.extend(ids)

    def seal(self, ids, min_capacity: int = 0):
        return []

    def capacity_new_pages(self, keep_reserve: bool = True):
        return len(self._free)

    def store(self, layer, q, k, v, cos, sin, page_ids, slots, want_kv: bool):
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        self.kv[layer, page_ids, 0, slots] = k.to(self.dtype)
        self.kv[layer, page_ids, 1, slots] = v.to(self.dtype)
        return q, k, v

    def read_pages(self, layer, ids):
        ids = torch.as_tensor(ids, dtype=torch.int64, device=self.device)
        return self.kv[layer, ids]

    def decode_attention(self, layer, q, block_table, context_lens, sm_scale):
        return torch_decode_attention(q, lambda ids: self.read_pages(layer, ids), block_table,
                                      context_lens, sm_scale, exact=self.deterministic)

    def stats(self):
        used = self.num_pages - len(self._free)
        bytes_per_page = self.kv[:, 0].numel() * self.kv.element_size()
        return {"pages_in_use": used, "open_pages": used, "stored_pages": 0,
                "bytes_in_use": used * bytes_per_page, "open_bytes_equivalent": used * bytes_per_page}


def default_sm_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
