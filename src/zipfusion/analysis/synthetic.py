"""Synthetic KV pages: realistic statistics (``realistic_pages``), a trained model's outliers
(``model_like_pages``), or an exact compressible fraction (``pages_with_fraction``) for
benchmarks that must state it.
"""

from __future__ import annotations

import math

import torch

from ..format.layout import BLOCK_VALUES, MAX_ESCAPES, PAGE_TOKENS, from_blocks


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
    kv = torch.stack([k, v]).to(torch.bfloat16)
    if zero_fraction > 0:
        zeros = torch.rand(kv.shape, generator=g) < zero_fraction
        kv[zeros] = 0
    return kv.view(2, num_pages, PAGE_TOKENS, H, D).transpose(0, 1).contiguous()


# A trained model's KV (docs/real_model.md): blocks with k = 1..4 values outside the v2 window,
# and the share of those below it.
OUTLIER_COUNTS = {"K": (0.0875, 0.0049, 0.00022, 0.000014), "V": (0.0684, 0.0034, 0.00014, 0.0)}
BELOW_WINDOW = {"K": 0.998, "V": 0.993}


def _distinct_positions(n_blocks: int, k: int, g: torch.Generator) -> torch.Tensor:
    if n_blocks == 0 or k == 0:
        return torch.zeros(n_blocks, k, dtype=torch.int64)
    return torch.rand(n_blocks, BLOCK_VALUES, generator=g).topk(k, -1).indices


def _set_outliers(flat: torch.Tensor, rows: torch.Tensor, k: int, below: torch.Tensor | float,
                  g: torch.Generator) -> None:
    """Give each block ``rows`` k values outside its window, in place (2^-40 where ``below``, else 2^12)."""
    where = _distinct_positions(rows.numel(), k, g)
    low = torch.rand(rows.numel(), k, generator=g) < below
    mag = torch.where(low, 2.0 ** -40, 2.0 ** 12)
    r = rows[:, None].expand(-1, k)
    flat[r, where] = mag * torch.where(flat[r, where] < 0, -1.0, 1.0)


def _windowed_blocks(P: int, H: int, nb: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(P, H, 2, nb, BLOCK_VALUES, generator=g)
    return torch.sign(x) * x.abs().clamp(min=2.0 ** -9, max=2.0 ** 2.5)


def pages_with_fraction(num_pages: int, num_kv_heads: int, head_dim: int,
                        compressible_fraction: float, *, escaped_fraction: float = 0.0,
                        seed: int = 0, device: str | torch.device = "cpu") -> torch.Tensor:
    """Pages in which exactly round(fraction * blocks) blocks are compressible (format v2),
    round(escaped_fraction * blocks) of them with one escape below the window."""
    if not 0.0 <= escaped_fraction <= compressible_fraction <= 1.0:
        raise ValueError(f"need 0 <= escaped_fraction <= compressible_fraction <= 1, got "
                         f"{escaped_fraction} and {compressible_fraction}")
    g = torch.Generator().manual_seed(seed)
    P, H, D = num_pages, num_kv_heads, head_dim
    nb = PAGE_TOKENS * D // BLOCK_VALUES
    x = _windowed_blocks(P, H, nb, g)
    n_blocks = P * H * 2 * nb
    n_ok = round(compressible_fraction * n_blocks)
    n_esc = min(round(escaped_fraction * n_blocks), n_ok)
    order = torch.randperm(n_blocks, generator=g)
    flat = x.view(n_blocks, BLOCK_VALUES)
    _set_outliers(flat, order[n_ok:], MAX_ESCAPES + 1, 0.0, g)
    _set_outliers(flat, order[:n_esc], 1, 1.0, g)
    return from_blocks(x.to(torch.bfloat16)).contiguous().to(device)


def model_like_pages(num_pages: int, num_kv_heads: int, head_dim: int, *, seed: int = 0,
                     counts: dict | None = None, below: dict | None = None) -> torch.Tensor:
    """[num_pages, 2, 16, H, D] bf16 KV with a trained model's outlier statistics
    (:data:`OUTLIER_COUNTS`, :data:`BELOW_WINDOW`): v2 compresses every block."""
    counts, below = counts or OUTLIER_COUNTS, below or BELOW_WINDOW
    g = torch.Generator().manual_seed(seed)
    P, H, D = num_pages, num_kv_heads, head_dim
    nb = PAGE_TOKENS * D // BLOCK_VALUES
    x = _windowed_blocks(P, H, nb, g)
    for r, role in enumerate(("K", "V")):
        flat = x[:, :, r].reshape(-1, BLOCK_VALUES)
        u = torch.rand(flat.shape[0], generator=g)
        edges = torch.cumsum(torch.tensor((0.0,) + tuple(counts[role])), 0)
        for k in range(1, len(edges)):
            rows = torch.nonzero((u >= edges[k - 1]) & (u < edges[k])).flatten()
            _set_outliers(flat, rows, k, below[role], g)
        x[:, :, r] = flat.view(P, H, nb, BLOCK_VALUES)
    return from_blocks(x.to(torch.bfloat16)).contiguous()


def compressible_fraction(pages: torch.Tensor, version: int = 2) -> float:
    """Fraction of the pages' 512-value blocks that the format (``version`` 2 or 1) compresses."""
    from ..format.reference import analyze_pages
    from ..format.layout import RAW_MARK
    base = analyze_pages(pages, version)
    return float((base != RAW_MARK).float().mean()) if base.numel() else math.nan
