"""FP8 E4M3 quantization of KV, as vLLM's ``kv_cache_dtype="fp8"`` writes it: the one place.

E4M3 (``torch.float8_e4m3fn``) is one byte ``s eeee mmm``: sign ``s``, 4-bit biased exponent
field ``e`` (bias 7), 3 mantissa bits ``m``. Its value is

    (-1)^s · 2^(e-7) · (1 + m/8)     for e = 1..15 (normal; ``e = 15, m = 7`` is NaN)
    (-1)^s · 2^(-6) · (m/8)          for e = 0     (zero and subnormals, steps of 2^-9)

so the finite range is ±448 (``0x7E``/``0xFE``), ``0x7F``/``0xFF`` are NaN, and there is no
infinity. Quantization (vLLM's ``scaled_convert``: ``x / scale`` in FP32, then a saturating
round-to-nearest-even conversion):

    q = E4M3_rne(clamp(x / scale, -448, 448))      (NaN stays NaN)
    x' = E4M3_value(q) · scale                     (dequantization)

±inf saturate to ±448, -0 stays -0 (``0x80``), values below 2^-10 round to a zero of their sign.

``scale`` is one FP32 number per tensor (vLLM's default is 1.0) or one per KV head
(:func:`head_scales`: ``amax / 448`` over the head's values, so that the largest one lands on
448). Codes are returned as ``uint8`` bytes: the lossless FP8 block format
(:mod:`zipfusion.format.fp8_blocks`) codes those bytes, and an FP8 KV cache stores them in open
pages of one byte a value (:class:`Fp8PageLayout`).
"""

from __future__ import annotations

import torch

from .layout import BLOCK_VALUES, PageLayout, loc_offset, open_bf16_index

E4M3_MAX = 448.0          # largest finite E4M3 magnitude
E4M3_NAN = 0x7F           # one of the two NaN codes (0xFF is the other)


def check_scale(name: str, scale) -> float:
    """A per-tensor scale: a positive finite number (one-line ValueError otherwise)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < float(scale) < float("inf"):
        raise ValueError(f"{name} must be a positive finite number, got {scale!r}")
    return float(scale)


def _scale_tensor(x: torch.Tensor, scale) -> torch.Tensor | None:
    """``scale`` as an FP32 tensor on ``x``'s device that broadcasts against ``x`` [..., H, D]
    (a number, a 0-d tensor, or one scale per KV head, [H]); None for the number 1.0 (nothing
    to do). A number becomes a device tensor, not a Python scalar: torch divides by a scalar on
    CUDA as a multiplication by its reciprocal, by a tensor exactly, as the kernels do. A
    number is checked on the host; a tensor's check reads it back (analysis only)."""
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
    """``x`` (bf16, fp16 or fp32, any shape) -> E4M3 codes (uint8, same shape):
    ``E4M3_rne(clamp(x / scale, -448, 448))``, the division in FP32 like vLLM's cache write
    (and the kernels' ``kernels/fp8_kv.e4m3_quant``: the same bytes, NaNs' sign aside).
    ``scale``: a number, a 0-d tensor, or one per KV head ([H], ``x`` shaped [..., H, D])."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"FP8 quantization takes bfloat16, float16 or float32 values, got {x.dtype}")
    s = _scale_tensor(x, scale)
    y = x.float() if s is None else x.float() / s
    return y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)   # clamp keeps NaN


def dequantize_e4m3(codes: torch.Tensor, scale=1.0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """E4M3 codes (uint8) -> ``E4M3_value(codes) · scale`` in ``dtype`` (the product in FP32,
    then rounded to ``dtype``, as the kernels' ``e4m3_dequant``)."""
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        got = codes.dtype if isinstance(codes, torch.Tensor) else type(codes).__name__
        raise TypeError(f"E4M3 codes must be a torch.uint8 tensor, got {got}")
    s = _scale_tensor(codes, scale)
    y = codes.view(torch.float8_e4m3fn).float()
    return (y if s is None else y * s).to(dtype)


def head_scales(x: torch.Tensor) -> torch.Tensor:
    """One scale per KV head for ``x`` [tokens, H, D]: ``amax_h / 448`` (FP32 [H]), 1.0 for a
    head whose values are all zero (or not finite), so that ``x / scale`` spans ±448."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"per-head scales need values shaped [tokens, num_kv_heads, head_dim], got "
                         f"{list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    amax = x.float().abs().amax(dim=(0, 2))
    ok = torch.isfinite(amax) & (amax > 0)
    return torch.where(ok, amax / E4M3_MAX, torch.ones_like(amax))


class Fp8PageLayout(PageLayout):
    """An open page ``[2, 16, H, D]`` at one byte a value (E4M3): half a BF16 page. Compressed,
    a page is in the FP8 block format (:mod:`zipfusion.format.fp8_blocks`), whose records and
    block sizes replace the BF16 format's below."""

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
        """Every block in its smallest mode (blk2) without escapes."""
        from .fp8_blocks import BLK2, BODY_BYTES
        return self.header_bytes + self.num_blocks * BODY_BYTES[BLK2]

    @property
    def max_page_bytes(self) -> int:
        """Every block raw (stored in open form instead: no stored page is larger than open)."""
        return self.header_bytes + self.num_blocks * BLOCK_VALUES

    def compressed_blocks(self, sizes):
        """Blocks stored in a coded mode, from stored sizes: a lower bound, ceil(saved / 128)
        (a coded block saves 64 to 128 bytes less 4 per escape word)."""
        import numpy as np
        saved = self.max_page_bytes - sizes
        return np.where(sizes >= self.open_page_bytes, 0, np.minimum(-(-saved // 128), self.num_blocks))

    def open_elements(self, page_loc: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Byte indices [T, 2, H, D] into the arena of slot ``slots[t]`` of the open page at
        ``page_loc[t]``: role r, head h, channel c at
        ``loc_offset(page_loc) + ((r·16 + slot)·H + h)·D + c`` (the BF16 layout's element order)."""
        return super().open_elements(page_loc, slots) - open_bf16_index(page_loc).view(-1, 1, 1, 1) \
            + loc_offset(page_loc).view(-1, 1, 1, 1)

    def page_byte_index(self, page_loc: torch.Tensor) -> torch.Tensor:
        """Byte indices [n, open_page_bytes] of whole open pages at ``page_loc`` [n]."""
        return loc_offset(page_loc)[:, None] + torch.arange(self.open_page_bytes, device=page_loc.device)
