"""Synthetic KV pages: realistic statistics, or an exact compressible-block fraction.

``realistic_pages`` imitates what attention layers write: keys with per-channel scales, a few
large outlier channels and rope rotation (channel i paired with i + D/2), values whose scale
varies by token, and a sprinkle of exact zeros. ``pages_with_fraction`` builds pages where a
chosen fraction of the 512-value blocks is compressible, for benchmarks that must state it.
"""

from __future__ import annotations

import math

import torch

from ..format.layout import BLOCK_VALUES, PAGE_TOKENS, from_blocks, to_blocks


def realistic_pages(num_pages: int, num_kv_heads: int, head_dim: int, *, seed: int = 0,
                    outlier_channels: int = 3, zero_fraction: float = 1e-4,
                    rope_theta: float = 500000.0) -> torch.Tensor:
    """[num_pages, 2, 16, H, D] bf16 KV with key outlier channels, rope, token-varying values."""
    g = torch.Generator().manual_seed(seed)
    H, D, T = num_kv_heads, head_dim, num_pages * PAGE_TOKENS
    half = D // 2
    scale = torch.exp(torch.randn(H, D, generator=g) * 0.5)
    for h in range(H):
        idx = torch.randint(0, half, (outlier_channels,), generator=g)
        boost = torch.empty(outlier_channels).uniform_(8, 30, generator=g)
        scale[h, idx] *= boost
        scale[h, idx + half] *= boost
    mean = torch.randn(H, D, generator=g) * scale * 0.5
    k = torch.randn(T, H, D, generator=g) * scale + mean
    pos = torch.arange(T, dtype=torch.float32)[:, None]
    inv_freq = rope_theta ** (-torch.arange(half, dtype=torch.float32) / half)
    cos, sin = torch.cos(pos * inv_freq)[:, None], torch.sin(pos * inv_freq)[:, None]
    k1, k2 = k[..., :half], k[..., half:]
    k = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1)
    token_scale = torch.exp(torch.randn(T, 1, 1, generator=g) * 0.7)
    v = torch.randn(T, H, D, generator=g) * torch.exp(torch.randn(H, D, generator=g) * 0.3) * token_scale
    kv = torch.stack([k, v]).to(torch.bfloat16)                    # [2, T, H, D]
    if zero_fraction > 0:
        zeros = torch.rand(kv.shape, generator=g) < zero_fraction
        kv[zeros] = 0
    return kv.view(2, num_pages, PAGE_TOKENS, H, D).transpose(0, 1).contiguous()


def pages_with_fraction(num_pages: int, num_kv_heads: int, head_dim: int,
                        compressible_fraction: float, *, seed: int = 0,
                        device: str | torch.device = "cpu") -> torch.Tensor:
    """Pages in which exactly round(fraction * blocks) blocks are compressible.

    Every block starts as Gaussian data clipped to an exponent span of 12 (compressible); the
    chosen raw blocks get one value whose exponent is 20 above the block's smallest.
    """
    if not 0.0 <= compressible_fraction <= 1.0:
        raise ValueError(f"compressible_fraction must be in [0, 1], got {compressible_fraction}")
    g = torch.Generator().manual_seed(seed)
    P, H, D = num_pages, num_kv_heads, head_dim
    nb = PAGE_TOKENS * D // BLOCK_VALUES
    x = torch.randn(P, H, 2, nb, BLOCK_VALUES, generator=g)
    sign = torch.sign(x)
    x = sign * x.abs().clamp(min=2.0 ** -9, max=2.0 ** 2.5)        # exponents 118..129
    n_blocks = P * H * 2 * nb
    n_raw = n_blocks - round(compressible_fraction * n_blocks)
    raw = torch.randperm(n_blocks, generator=g)[:n_raw]
    flat = x.view(n_blocks, BLOCK_VALUES)
    where = torch.randint(0, BLOCK_VALUES, (n_raw,), generator=g)
    flat[raw, where] = 2.0 ** 12 * torch.where(flat[raw, where] < 0, -1.0, 1.0)
    pages = from_blocks(x.to(torch.bfloat16))
    return pages.contiguous().to(device)


def compressible_fraction(pages: torch.Tensor) -> float:
    """Fraction of the pages' 512-value blocks that the format compresses."""
    from ..format.reference import analyze_pages
    from ..format.layout import RAW_MARK
    base = analyze_pages(pages)
    return float((base != RAW_MARK).float().mean()) if base.numel() else math.nan
