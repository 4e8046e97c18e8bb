"""FP8 E4M3 quantization of KV as vLLM's ``kv_cache_dtype="fp8"`` writes it, the one place:
``E4M3_rne(clamp(x / scale, -448, 448))`` in FP32, a scale per tensor (1.0 by default) or per KV
head (:func:`head_scales`). Codes are uint8 bytes (docs/fp8_format.md section 1).
"""

from __future__ import annotations

import torch

from .layout import BLOCK_VALUES, PageLayout, loc_offset, open_bf16_index

E4M3_MAX = 448.0
E4M3_NAN = 0x7F  # 0xFF is the other NaN


def check_scale(name: str, scale) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < float(scale) < float("inf"):
        raise ValueError(f"{name} must be a positive finite number, got {scale!r}")
    return float(scale)


def _scale_tensor(x: torch.Tensor, scale) -> torch.Tensor | None:
    """``scale`` as an FP32 device tensor broadcasting against ``x`` [..., H, D] (None for 1.0): a
    tensor, because CUDA divides by a scalar as a multiplication by its reciprocal."""
    if not isinstance(scale, torch.Tensor):
        if check_scale("FP8 scale", scale) == 1.0:
            return None
        return torch.full((), float(scale), dtype=torch.float32, device=x.device)
    s = scale.to(device=x.device, dtype=torch.float32)
    if s.dim() == 1:
        if x.dim() < 2 or s.shape[0] != x.shape[-2]:
            raise ValueError(f"per-head scales [{s.shape[0]}] need values shaped [..., {s.shape[0]}, head_dim], "
                             f"got {list(x.shape)}")
        s = s[:, None]
    elif s.dim() != 0:
        raise ValueError(f"scale must be a number, a 0-d tensor or one per KV head ([H]), got shape {list(s.shape)}")
    if not bool(torch.isfinite(s).all()) or bool((s <= 0).any()):
        raise ValueError("FP8 scales must be finite and > 0")
    return s


def quantize_e4m3(x: torch.Tensor, scale=1.0) -> torch.Tensor:
    """``x`` -> E4M3 codes (uint8, same shape), the division in FP32 as vLLM's cache write and
    the kernels' ``e4m3_quant``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"FP8 quantization takes bfloat16, float16 or float32 values, got {x.dtype}")
    s = _scale_tensor(x, scale)
    y = x.float() if s is None else x.float() / s
    return y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def dequantize_e4m3(codes: torch.Tensor, scale=1.0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """E4M3 codes -> ``value · scale`` in ``dtype`` (the product in FP32, as ``e4m3_dequant``)."""
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        got = codes.dtype if isinstance(codes, torch.Tensor) else type(codes).__name__
        raise TypeError(f"E4M3 codes must be a torch.uint8 tensor, got {got}")
    s = _scale_tensor(codes, scale)
    y = codes.view(torch.float8_e4m3fn).float()
    return (y if s is None else y * s).to(dtype)


def head_scales(x: torch.Tensor) -> torch.Tensor:
    """One scale per KV head for ``x`` [tokens, H, D]: ``amax_h / 448`` (1.0 for an all-zero head)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"per-head scales need values shaped [tokens, num_kv_heads, head_dim], got "
                         f"{list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    amax = x.float().abs().amax(dim=(0, 2))
    ok = torch.isfinite(amax) & (amax > 0)
    return torch.where(ok, amax / E4M3_MAX, torch.ones_like(amax))


class Fp8PageLayout(PageLayout):
    """An open E4M3 page ``[2, 16, H, D]`` at one byte a value; compressed pages use the FP8 block
    format (:mod:`zipfusion.format.fp8_blocks`)."""

    element_dtype = torch.uint8

    @property
    def open_page_bytes(self) -> int:
        return super().open_page_bytes // 2

    @property
    def record_bytes(self) -> int:
        from .fp8_blocks import record_bytes
        return record_bytes(self)

    @property
    def min_page_bytes(self) -> int:
        from .fp8_blocks import BLK2, BODY_BYTES
        return self.header_bytes + self.num_blocks * BODY_BYTES[BLK2]

    @property
    def max_page_bytes(self) -> int:
        return self.header_bytes + self.num_blocks * BLOCK_VALUES

    def compressed_blocks(self, sizes):
        """Blocks stored in a coded mode, from stored sizes (a lower bound)."""
        import numpy as np
        saved = self.max_page_bytes - sizes
        return np.where(sizes >= self.open_page_bytes, 0, np.minimum(-(-saved // 128), self.num_blocks))

    def open_elements(self, page_loc: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Arena byte indices [T, 2, H, D] of token slots ``slots`` of the open pages at ``page_loc``."""
        return super().open_elements(page_loc, slots) - open_bf16_index(page_loc).view(-1, 1, 1, 1) \
            + loc_offset(page_loc).view(-1, 1, 1, 1)

    def page_byte_index(self, page_loc: torch.Tensor) -> torch.Tensor:
        return loc_offset(page_loc)[:, None] + torch.arange(self.open_page_bytes, device=page_loc.device)
