"""The FP8 KV cache (``kv_cache_dtype="fp8"``): E4M3 pages in the memory manager's arena.

:class:`Fp8KVCache` is an :class:`~.kv_cache.ArenaKVCache` whose pages hold one byte a value
(``format.fp8.Fp8PageLayout``: ``[2, 16, H, D]`` E4M3); with ``kv_compression``
(``kv_cache_dtype="fp8_lossless"``, experimental) its full pages
are sealed into the lossless FP8 block format (``format.fp8_blocks``: the E4M3 bytes kept bit
for bit) as BF16 pages are into theirs. The arena, the
allocator and admission count pages by the layout's ``open_page_bytes``, so the same
``kv_memory_gb`` holds about twice the pages of BF16 (uncompressed). It is lossy
(kernels/fp8_kv.py has the rounding): every value is stored as ``E4M3_RNE(clamp(x / s, ±448))``
and read as ``bf16(E4M3 · s)``, with per-tensor scales ``k_scale``, ``v_scale`` (default 1.0,
as vLLM's).

* ``store``: rope (models.layers.apply_rope), then K/V quantized into the open pages: torch ops
  on the CPU, on CUDA the merged Triton rope+store kernel (kernels/rope_store.py, its FP8
  variant: the same bits; ``merged_store`` as for BF16). When the step's fresh K/V are wanted
  (prefill chunks attend to them, attention/prefill_open.py) it returns them *as the pages hold
  them* (quantized and read back),
  so a prompt's own tokens see exactly what later tokens, a prefix-cache hit or a recompute see.
* ``read_pages``: pages read back dequantized to BF16 (the torch decode route, prefill over
  stored pages).
* decode: the Triton FP8 kernel (kernels/fp8_attention.py) reads the bytes in place
  (attention/decode.py: ``Fp8KernelDecode``).
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
    """E4M3 pages in the arena (module docstring); ``k_scale``, ``v_scale``: per-tensor scales."""

    layout_class = Fp8PageLayout
    kv_dtype = "fp8"

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, budget_bytes: int, device,
                 k_scale: float = 1.0, v_scale: float = 1.0, **kwargs):
        """``kwargs``: ArenaKVCache's (``kv_compression``: full pages stored in the lossless FP8
        block format, default off here; ``merged_store``: the FP8 rope+store kernel, default on
        CUDA)."""
        self.k_scale, self.v_scale = check_scale("k_scale", k_scale), check_scale("v_scale", v_scale)
        kwargs.setdefault("kv_compression", False)
        super().__init__(num_layers, num_kv_heads, head_dim, budget_bytes, device, **kwargs)

    def store(self, layer, q, k, v, cos, sin, page_ids, slots, want_kv: bool):
        """Rotate q, k and write k, v as E4M3 bytes into the open pages at (page_ids[t],
        slots[t]); returns (q, k', v') rotated, k', v' the values the pages now hold (None
        unless ``want_kv``). On CUDA (``merged_store``) one Triton kernel, the same bits."""
        if self.merged_store:
            from ..kernels.rope_store import rope_and_store
            return rope_and_store(q, k, v, cos, sin, self.arena, self.page_loc[layer], page_ids, slots,
                                  want_k=want_kv, fp8_scales=(self.k_scale, self.v_scale))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        idx = self.layout.open_elements(self.page_loc[layer, page_ids], slots)        # [T, 2, H, D]
        kb, vb = quantize_e4m3(k, self.k_scale), quantize_e4m3(v, self.v_scale)
        self.arena.index_copy_(0, idx.reshape(-1), torch.stack([kb, vb], dim=1).reshape(-1))
        if not want_kv:
            return q, None, None
        return q, dequantize_e4m3(kb, self.k_scale, k.dtype), dequantize_e4m3(vb, self.v_scale, v.dtype)

    def read_pages(self, layer, ids):
        """Pages [n, 2, 16, H, D] bf16: K as bf16(E4M3 · k_scale), V as bf16(E4M3 · v_scale)
        (compressed pages decoded to their E4M3 bytes first). Ids on the device (prefill over
        stored pages) are read through the device table, with no host sync."""
        if self.kv_compression and isinstance(ids, torch.Tensor) and ids.device == self.device:
            raw = self._read_on_device(layer, ids.to(torch.int64))
        elif self.kv_compression:
            raw = self.manager.read_pages(layer, ids.tolist() if isinstance(ids, torch.Tensor) else list(ids))
        else:
            ids = ids.to(self.device, torch.int64) if isinstance(ids, torch.Tensor) else \
                to_device(np.asarray(ids, dtype=np.int64), self.device)     # pinned: no wait for the GPU
            H, D = self.num_kv_heads, self.head_dim
            raw = self.arena[self.layout.page_byte_index(self.page_loc[layer, ids])].view(-1, 2, 16, H, D)
        return torch.stack([dequantize_e4m3(raw[:, 0], self.k_scale), dequantize_e4m3(raw[:, 1], self.v_scale)],
                           dim=1)

    def _read_on_device(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """E4M3 bytes [n, 2, 16, H, D] of pages open or compressed, from the device table alone:
        each slice of FP8_SLICE pages is both gathered open and decoded (trusted bytes: this
        process's encoder), and each page keeps the form its location says."""
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
