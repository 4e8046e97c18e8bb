"""The engine's view of the KV cache: :class:`ArenaKVCache` (BF16 pages in the memory manager's
arena, compressed when full) and :class:`DenseKVCache` (any dtype, never compressed), with the
same methods, so the scheduler, runner and attention backend do not care which.
"""

from __future__ import annotations

import torch

from ..format import PAGE_TOKENS, PageLayout
from ..models.layers import apply_rope
from .manager import KVCacheManager


class KVCache:
    """What both caches share; subclasses hold the pages."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    kv_compression: bool = False
    kv_dtype: str = "bf16"  # "bf16" (exact) or "fp8" (E4M3)

    def read_tokens(self, layer: int, pages: list[int], n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [n_tokens, H, D] of a request's first ``n_tokens`` tokens (its prefix)."""
        n_pages = -(-n_tokens // PAGE_TOKENS)
        kv = self.read_pages(layer, pages[:n_pages])
        kv = kv.transpose(0, 1).reshape(2, n_pages * PAGE_TOKENS, self.num_kv_heads, self.head_dim)
        return kv[0, :n_tokens], kv[1, :n_tokens]

    def stored_ratio(self) -> float:
        """Bytes of stored full pages over their open size (1.0 when nothing is compressed)."""
        return 1.0

    def flush_table(self) -> None:
        """Bring the kernels' page table up to date (before each forward)."""


class ArenaKVCache(KVCache):
    """BF16 pages in the arena of :class:`zipfusion.memory.KVCacheManager`."""

    layout_class = PageLayout

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, budget_bytes: int,
                 device, kv_compression: bool = True, merged_store: bool | None = None,
                 defer_table_sync: bool = False, **manager_kwargs):
        """``merged_store``: rope + store in one Triton kernel (default: on CUDA);
        ``defer_table_sync``: page-table changes reach the device in one copy at :meth:`flush_table`."""
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.layout = self.layout_class(num_kv_heads, head_dim)
        self.dtype, self.device = torch.bfloat16, torch.device(device)
        self.kv_compression = kv_compression
        self.manager = KVCacheManager(num_layers, self.layout, int(budget_bytes), self.device,
                                      kv_compression=kv_compression, **manager_kwargs)
        self.merged_store = self.device.type == "cuda" if merged_store is None else merged_store
        self.manager.table.deferred = defer_table_sync

    @property
    def arena(self) -> torch.Tensor:
        return self.manager.arena

    @property
    def page_loc(self) -> torch.Tensor:
        return self.manager.page_loc

    def alloc(self, n, keep_reserve: bool = True, reclaim=None):
        """``n`` new open pages; ``reclaim``: the caller's policy for pages compaction would move."""
        return list(self.manager.alloc_pages(n, keep_reserve, reclaim)) if n > 0 else []

    def free(self, ids):
        if ids:
            self.manager.free_pages(list(ids))

    def flush_table(self) -> None:
        self.manager.table.flush()

    def capacity_new_pages(self, keep_reserve: bool = True):
        """New pages that fit now (``keep_reserve=False``: the compression reserve too)."""
        return int(self.manager.capacity_new_pages(keep_reserve=keep_reserve))

    def stored_ratio(self):
        return self.manager.stored_ratio()

    def store(self, layer, q, k, v, cos, sin, page_ids, slots, want_kv: bool):
        """Rotate q, k and write k, v into the open pages; returns (q, k, v), k, v None unless
        ``want_kv``."""
        if self.merged_store:
            from ..kernels.rope_store import rope_and_store
            q, k = rope_and_store(q, k, v, cos, sin, self.arena, self.page_loc[layer], page_ids, slots,
                                  want_k=want_kv)
            return q, k, (v if want_kv else None)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        idx = self.layout.open_elements(self.page_loc[layer, page_ids], slots)
        vals = torch.stack([k, v], dim=1).to(torch.bfloat16)
        self.arena.view(torch.bfloat16).index_copy_(0, idx.reshape(-1), vals.reshape(-1))
        return q, k, v

    def read_pages(self, layer, ids):
        """Pages [n, 2, 16, H, D] bf16: open ones copied, compressed ones decoded."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return self.manager.read_pages(layer, ids)

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

    def alloc(self, n, keep_reserve: bool = True, reclaim=None):
        if n > len(self._free):
            raise RuntimeError(f"KV cache full: {n} pages wanted, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, ids):
        self._free.extend(ids)

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

    def stats(self):
        used = self.num_pages - len(self._free)
        bytes_per_page = self.kv[:, 0].numel() * self.kv.element_size()
        return {"pages_in_use": used, "open_pages": used, "stored_pages": 0,
                "bytes_in_use": used * bytes_per_page, "open_bytes_equivalent": used * bytes_per_page}
