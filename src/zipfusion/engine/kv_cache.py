"""The engine's view of the KV cache: pages to allocate, K/V to write, pages to read.

* :class:`ArenaKVCache` -- BF16 pages in the memory manager's arena (docs/design.md). Full pages
  are compressed when ``compress=True``. Decode attention runs the fused kernel on CUDA and a
  torch path elsewhere, which reads compressed pages through the reference codec.
* :class:`DenseKVCache` -- pages of any dtype (float32 for exactness tests) in one tensor, never
  compressed.

Both address K/V by page id and slot (token % 16), so scheduler and runner do not care which.
"""

from __future__ import annotations

import math

import torch

from ..format import PAGE_TOKENS, PageLayout


def torch_decode_attention(q, gather, block_table, context_lens, sm_scale):
    """Decode attention in fp32 torch: q [B, Hq, D]; ``gather(page_ids) -> [n, 2, 16, H, D]``.

    o_b = softmax(sm_scale · q_b K_bᵀ) V_b over the first context_lens[b] tokens of request b,
    query head i reading KV head i // (Hq / H).
    """
    B, Hq, D = q.shape
    lens = context_lens.to(torch.int64)
    max_pages = int(-(-int(lens.max()) // PAGE_TOKENS))
    table = block_table[:, :max_pages].to(torch.int64)
    used = torch.arange(max_pages, device=q.device)[None, :] * PAGE_TOKENS < lens[:, None]
    ids = torch.where(used, table, torch.zeros_like(table))
    uniq, inverse = torch.unique(ids[used], return_inverse=True)
    pages = gather(uniq)                                        # [n, 2, 16, H, D]
    H = pages.shape[3]
    slot = torch.zeros_like(ids)
    slot[used] = inverse
    kv = pages[slot]                                            # [B, P, 2, 16, H, D]
    k = kv[:, :, 0].reshape(B, max_pages * PAGE_TOKENS, H, D).float()
    v = kv[:, :, 1].reshape(B, max_pages * PAGE_TOKENS, H, D).float()
    qg = q.float().reshape(B, H, Hq // H, D)
    scores = torch.einsum("bhgd,bthd->bhgt", qg, k) * sm_scale
    valid = torch.arange(max_pages * PAGE_TOKENS, device=q.device)[None, :] < lens[:, None]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    v = v.masked_fill(~valid[:, :, None, None], 0.0)           # unwritten slots may hold NaN bits
    out = torch.einsum("bhgt,bthd->bhgd", scores.softmax(-1), v)
    return out.reshape(B, Hq, D).to(q.dtype)


class KVCache:
    """Interface shared by both caches."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    compress: bool = False

    def alloc(self, n: int) -> list[int]: ...
    def free(self, ids: list[int]) -> None: ...
    def seal(self, ids: list[int]) -> list[int]: """Full pages: compress them if this cache compresses; returns ids left open."""
    def capacity_new_pages(self) -> int: ...
    def write(self, layer, page_ids, slots, k, v) -> None: ...
    def gather(self, layer: int, page_ids: torch.Tensor) -> torch.Tensor: ...
    def decode_attention(self, layer, q, block_table, context_lens, sm_scale) -> torch.Tensor: ...
    def stats(self) -> dict: ...

    def gather_tokens(self, layer: int, pages: list[int], n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [n_tokens, H, D] of a request's first ``n_tokens`` tokens."""
        n_pages = -(-n_tokens // PAGE_TOKENS)
        ids = torch.tensor(pages[:n_pages], dtype=torch.int64, device=self.device)
        kv = self.gather(layer, ids)                            # [n, 2, 16, H, D]
        kv = kv.transpose(0, 1).reshape(2, n_pages * PAGE_TOKENS, self.num_kv_heads, self.head_dim)
        return kv[0, :n_tokens], kv[1, :n_tokens]


class ArenaKVCache(KVCache):
    """BF16 pages in the arena of :class:`zipfusion.memory.KVCacheManager`."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, budget_bytes: int,
                 device, compress: bool = True, attention_backend: str = "auto", **manager_kwargs):
        """``attention_backend``: "kernel" (the Triton kernels; on CPU tensors they run in the
        interpreter, slowly), "torch" (fp32 torch over gathered pages), "auto" (kernel on CUDA)."""
        if attention_backend not in ("auto", "kernel", "torch"):
            raise ValueError(f"attention_backend must be 'auto', 'kernel' or 'torch', got {attention_backend!r}")
        from ..memory import KVCacheManager
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.layout = PageLayout(num_kv_heads, head_dim)
        self.dtype, self.device, self.compress = torch.bfloat16, torch.device(device), compress
        manager_kwargs.setdefault("chunk_bytes", min(2 << 20, 64 * self.layout.open_page_bytes))
        self.manager = KVCacheManager(num_layers, self.layout, int(budget_bytes), self.device,
                                      compression=compress, **manager_kwargs)
        H, D = num_kv_heads, head_dim
        # element offset of (role r, token slot t, head h, channel c) from a page's first bf16 element
        r = torch.arange(2, device=self.device).view(2, 1, 1, 1)
        h = torch.arange(H, device=self.device).view(1, 1, H, 1)
        c = torch.arange(D, device=self.device).view(1, 1, 1, D)
        self._rhc = (r * PAGE_TOKENS * H + h) * D + c            # [2, 1, H, D] (+ t·H·D per slot)
        self._page_elems = torch.arange(2 * PAGE_TOKENS * H * D, device=self.device)
        self._use_kernel = attention_backend == "kernel" or (
            attention_backend == "auto" and self.device.type == "cuda")

    @property
    def arena(self) -> torch.Tensor:
        return self.manager.arena

    @property
    def page_loc(self) -> torch.Tensor:
        return self.manager.page_loc

    def alloc(self, n):
        return list(self.manager.alloc_pages(n)) if n > 0 else []

    def free(self, ids):
        if ids:
            self.manager.free_pages(list(ids))

    def seal(self, ids):
        """Compress full pages; returns the ids left open because compressed space ran out
        (they stay readable as open pages; the scheduler retries them next step)."""
        if not ids or not self.compress:
            return []
        from ..memory import MemoryExhausted
        try:
            self.manager.compress_pages(list(ids))
            return []
        except MemoryExhausted:
            return [i for i in ids if self.manager.page_state(i) == "open"]

    def capacity_new_pages(self):
        return int(self.manager.capacity_new_pages())

    def write(self, layer, page_ids, slots, k, v):
        """Store k, v [T, H, D] at (page_ids[T], slots[T]) -- open pages: bf16 element
        loc/2 + ((r·16 + t)·H + h)·D + c, and loc/2 = page_loc >> 1 since loc = offset | 1."""
        base = self.page_loc[layer, page_ids] >> 1                              # [T]
        H, D = self.num_kv_heads, self.head_dim
        idx = base.view(-1, 1, 1, 1, 1) + (slots.view(-1, 1, 1, 1, 1) * (H * D) + self._rhc[None])
        vals = torch.stack([k, v], dim=1).unsqueeze(2).to(torch.bfloat16)       # [T, 2, 1, H, D]
        self.arena.view(torch.bfloat16).index_copy_(0, idx.reshape(-1), vals.reshape(-1))

    def gather(self, layer, page_ids):
        """Pages [n, 2, 16, H, D] bf16: open ones read in place, compressed ones decoded."""
        from ..format import decode_pages
        H, D = self.num_kv_heads, self.head_dim
        loc = self.page_loc[layer, page_ids]
        if bool((loc < 0).any()):
            raise RuntimeError(f"layer {layer}: page id without a page in page_loc: {page_ids[loc < 0].tolist()}")
        is_open = (loc & 1).bool()
        out = torch.empty(len(page_ids), 2, PAGE_TOKENS, H, D, dtype=torch.bfloat16, device=self.device)
        arena16 = self.arena.view(torch.bfloat16)
        if bool(is_open.any()):
            idx = (loc[is_open] >> 1)[:, None] + self._page_elems[None, :]
            out[is_open] = arena16[idx].view(-1, 2, PAGE_TOKENS, H, D)
        if bool((~is_open).any()):
            out[~is_open] = decode_pages(self.arena, loc[~is_open], H, D)
        return out

    def decode_attention(self, layer, q, block_table, context_lens, sm_scale):
        if self._use_kernel:
            from ..kernels import decode_attention, decode_attention_twin
            kernel = decode_attention if self.compress else decode_attention_twin
            # the engine builds valid tables; validate=False keeps the call free of host syncs
            return kernel(q, self.arena, self.page_loc[layer], block_table, context_lens,
                          self.layout, sm_scale, validate=False)
        return torch_decode_attention(q, lambda ids: self.gather(layer, ids), block_table, context_lens, sm_scale)

    def stats(self):
        """The manager's numbers plus what the engine reports: bytes in use vs all-open."""
        s = self.manager.stats()
        d = s.as_dict() if hasattr(s, "as_dict") else dict(s)
        pages = d["open_pages"] + d["stored_pages"]
        d["pages_in_use"] = pages
        d["bytes_in_use"] = s.used_bytes if hasattr(s, "used_bytes") else None
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

    def alloc(self, n):
        if n > len(self._free):
            raise RuntimeError(f"KV cache full: {n} pages wanted, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, ids):
        self._free.extend(ids)

    def seal(self, ids):
        return []

    def capacity_new_pages(self):
        return len(self._free)

    def write(self, layer, page_ids, slots, k, v):
        self.kv[layer, page_ids, 0, slots] = k.to(self.dtype)
        self.kv[layer, page_ids, 1, slots] = v.to(self.dtype)

    def gather(self, layer, page_ids):
        return self.kv[layer, page_ids]

    def decode_attention(self, layer, q, block_table, context_lens, sm_scale):
        return torch_decode_attention(q, lambda ids: self.gather(layer, ids), block_table, context_lens, sm_scale)

    def stats(self):
        used = self.num_pages - len(self._free)
        bytes_per_page = self.kv[:, 0].numel() * self.kv.element_size()
        return {"pages_in_use": used, "open_pages": used, "compressed_pages": 0,
                "bytes_in_use": used * bytes_per_page, "open_bytes_equivalent": used * bytes_per_page}


def default_sm_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
