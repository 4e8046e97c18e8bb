"""The format half of `zipfusion demo`: compress realistic synthetic KV on the CPU and restore it,
printing the blocks compressed, the bytes saved and whether the round trip is bit-exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .analysis.synthetic import realistic_pages
from .format import RAW_MARK, PageLayout, analyze_pages, decode_pages, encode_pages_into, page_sizes


@dataclass
class FormatDemoResult:
    pages: int
    num_kv_heads: int
    head_dim: int
    key_fraction: float
    value_fraction: float
    open_bytes: int
    compressed_bytes: int
    bit_exact: bool

    @property
    def compressible_fraction(self) -> float:
        return (self.key_fraction + self.value_fraction) / 2

    @property
    def saved_fraction(self) -> float:
        return 1 - self.compressed_bytes / self.open_bytes


def format_demo(num_pages: int = 256, num_kv_heads: int = 8, head_dim: int = 128,
                seed: int = 0, echo=print) -> FormatDemoResult:
    """Compress ``num_pages`` synthetic pages (Llama-3.1-8B head shape by default) and restore them."""
    layout = PageLayout(num_kv_heads, head_dim)
    pages = realistic_pages(num_pages, num_kv_heads, head_dim, seed=seed)
    base = analyze_pages(pages)                                   # [P, H, 2, nb]
    compressible = base != RAW_MARK
    sizes = page_sizes(pages)
    offsets = torch.cumsum(sizes, 0) - sizes
    buf = torch.empty(int(sizes.sum()), dtype=torch.uint8)
    encode_pages_into(pages, buf, offsets)
    restored = decode_pages(buf, offsets, num_kv_heads, head_dim, sizes=sizes)
    result = FormatDemoResult(
        pages=num_pages, num_kv_heads=num_kv_heads, head_dim=head_dim,
        key_fraction=float(compressible[:, :, 0].float().mean()),
        value_fraction=float(compressible[:, :, 1].float().mean()),
        open_bytes=num_pages * layout.open_page_bytes, compressed_bytes=int(sizes.sum()),
        bit_exact=torch.equal(restored.view(torch.int16), pages.view(torch.int16)))
    echo(f"KV format: {num_pages} pages of 16 tokens x {num_kv_heads} KV heads x {head_dim} dims "
         f"({result.open_bytes / 2**20:.1f} MiB of BF16 K+V, synthetic with key outlier channels, rope, zeros)")
    echo(f"  compressible 512-value blocks: {result.compressible_fraction:.1%} "
         f"(keys {result.key_fraction:.1%}, values {result.value_fraction:.1%})")
    echo(f"  compressed size: {result.compressed_bytes / 2**20:.1f} MiB, "
         f"{result.saved_fraction:.1%} saved (the format's ceiling is 25%)")
    echo(f"  round trip bit-exact: {'yes' if result.bit_exact else 'NO'}")
    return result
