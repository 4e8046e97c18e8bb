"""The FP8 KV cache (``kv_cache_dtype="fp8"``, lossy): E4M3 pages, one byte a value, in the arena,
with per-tensor scales; with ``kv_compression`` full pages are sealed losslessly into the FP8
block format.
"""

from __future__ import annotations

import numpy as np
import torch

from ..format.fp8 import Fp8PageLayout, check_scale, dequantize_e4m3, quantize_e4m3
from ..format.layout import loc_is_open, loc_offset
from ..models.layers import apply_rope
from .copy import to_device
from .kv_cache import ArenaKVCache


class Fp8KVCache(ArenaKVCache):
    """E4M3 pages in the arena; ``k_scale``, ``v_scale``: per-tensor scales."""

    layout_class = Fp8PageLayout
    kv_dtype = "fp8"

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, budget_bytes: int, device,
                 k_scale: float = 1.0, v_scale: float = 1.0, **kwargs):
        """``kwargs``: ArenaKVCache's (``kv_compression`` default off here)."""
        self.k_scale, self.v_scale = check_scale("k_scale", k_scale), check_scale("v_scale", v_scale)
        kwargs.setdefault("kv_compression", False)
        super().__init__(num_layers, num_kv_heads, head_dim, budget_bytes, device, **kwargs)

    def store(self, layer, q, k, v, cos, sin, page_ids, slots, want_kv: bool):
        """Rotate q, k and write k, v as E4M3 bytes into the open pages; returns (q, k', v'), k', v'
        the values the pages now hold (None unless ``want_kv``)."""
        if self.merged_store:
            from ..kernels.rope_store import rope_and_store
            return rope_and_store(q, k, v, cos, sin, self.arena, self.page_loc[layer], page_ids, slots,
                                  want_k=want_kv, fp8_scales=(self.k_scale, self.v_scale))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        idx = self.layout.open_elements(self.page_loc[layer, page_ids], slots)
        kb, vb = quantize_e4m3(k, self.k_scale), quantize_e4m3(v, self.v_scale)
        self.arena.index_copy_(0, idx.reshape(-1), torch.stack([kb, vb], dim=1).reshape(-1))
        if not want_kv:
            return q, None, None
        return q, dequantize_e4m3(kb, self.k_scale, k.dtype), dequantize_e4m3(vb, self.v_scale, v.dtype)

    def read_pages(self, layer, ids):
        """Pages [n, 2, 16, H, D] bf16, dequantized (device ids: no host sync)."""
        if self.kv_compression and isinstance(ids, torch.Tensor) and ids.device == self.device:
            raw = self._read_on_device(layer, ids.to(torch.int64))
        elif self.kv_compression:
            raw = self.manager.read_pages(layer, ids.tolist() if isinstance(ids, torch.Tensor) else list(ids))
        else:
            ids = ids.to(self.device, torch.int64) if isinstance(ids, torch.Tensor) else \
                to_device(np.asarray(ids, dtype=np.int64), self.device)
            H, D = self.num_kv_heads, self.head_dim
            raw = self.arena[self.layout.page_byte_index(self.page_loc[layer, ids])].view(-1, 2, 16, H, D)
        return torch.stack([dequantize_e4m3(raw[:, 0], self.k_scale), dequantize_e4m3(raw[:, 1], self.v_scale)],
                           dim=1)

    def _read_on_device(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """E4M3 bytes [n, 2, 16, H, D] of pages open or compressed, from the device table alone."""
        from ..format.fp8_blocks import decode_fp8_pages
        from .codec import FP8_SLICE
        H, D, n = self.num_kv_heads, self.head_dim, self.layout.open_page_bytes
        out, last = [], self.arena.numel() - 1
        for i in range(0, ids.numel(), FP8_SLICE):
            loc = self.page_loc[layer, ids[i:i + FP8_SLICE]]
            off = loc_offset(loc)
            opened = self.arena[(off[:, None] + torch.arange(n, device=self.device)).clamp(max=last)]
            decoded = decode_fp8_pages(self.arena, off, None, H, D).reshape(-1, n)
            out.append(torch.where(loc_is_open(loc)[:, None], opened, decoded))
        return torch.cat(out).view(-1, 2, 16, H, D) if out else self.arena[:0].view(0, 2, 16, H, D)
