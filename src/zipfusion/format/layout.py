"""Sizes and index maps of the KV page format (docs/format.md): everything that knows where a
value or block lives, so the reference codec and the kernels agree by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:  # the Triton interpreter runs a @jit function only where triton.language is visible
    import triton.language as tl  # noqa: F401
except ImportError:
    tl = None

PAGE_TOKENS = 16          # tokens per KV page
BLOCK_VALUES = 512        # values per block
GROUP_VALUES = 8
COMPRESSED_BLOCK_BYTES = 768
ESCAPE_CHUNK_BYTES = 16
ESCAPED_BLOCK_BYTES = COMPRESSED_BLOCK_BYTES + ESCAPE_CHUNK_BYTES
RAW_BLOCK_BYTES = 1024
RAW_MARK = 0xFF           # metadata byte of a block stored raw
ESCAPE_FLAG = 0x80  # v2: bit 7 of a metadata byte (b/2 below it): the block has escapes
MAX_ESCAPES = 4  # v2: escape records per block (more outliers: raw)
SUPPORTED_HEAD_DIMS = (64, 128, 256)


# The page-location tag: ``page_loc`` holds a page's byte offset in the arena with bit 0 set for
# an open page, clear for a compressed one (-1: no page). Plain integer arithmetic, so one body
# serves ints, NumPy, torch and Triton kernels (``triton.jit(loc_offset)`` in the kernel module).

def loc_is_open(loc):
    """Whether the page at ``loc`` is in open form (bit 0 set)."""
    return (loc & 1) != 0


def loc_is_compressed(loc):
    """Whether ``loc`` holds a compressed page (bit 0 clear; -1, no page, is neither)."""
    return (loc & 1) == 0


def loc_offset(loc):
    """The page's byte offset in the arena (bit 0 cleared)."""
    return loc - (loc & 1)


def open_loc(offset):
    """The location of an open page at byte ``offset``."""
    return offset | 1


def moved_loc(loc, offset):
    """The location of the page at ``loc`` moved to byte ``offset``, in the same form."""
    return offset | (loc & 1)


def open_bf16_index(loc):
    """Element index of the open page at ``loc`` into ``arena.view(torch.bfloat16)``."""
    return loc >> 1


@dataclass(frozen=True)
class PageLayout:
    """Byte geometry of one page for a given number of KV heads and head dim."""

    element_dtype = torch.bfloat16  # an open page's values

    num_kv_heads: int
    head_dim: int

    def __post_init__(self):
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(
                f"head_dim={self.head_dim} is not supported by the page format; "
                f"use one of {SUPPORTED_HEAD_DIMS}")
        if not isinstance(self.num_kv_heads, int) or self.num_kv_heads < 1:
            raise ValueError(f"num_kv_heads must be a positive int, got {self.num_kv_heads!r}")

    @property
    def blocks_per_head(self) -> int:
        """nb: blocks of 512 values per head for K (and V)."""
        return PAGE_TOKENS * self.head_dim // BLOCK_VALUES

    @property
    def record_bytes(self) -> int:
        """M: metadata bytes per (head, K or V), padded to 8."""
        return 8 * -(-(4 + self.blocks_per_head) // 8)

    @property
    def header_bytes(self) -> int:
        return 2 * self.num_kv_heads * self.record_bytes

    @property
    def num_blocks(self) -> int:
        return 2 * self.num_kv_heads * self.blocks_per_head

    @property
    def open_page_bytes(self) -> int:
        return 2 * PAGE_TOKENS * self.num_kv_heads * self.head_dim * 2

    @property
    def min_page_bytes(self) -> int:
        return self.header_bytes + self.num_blocks * COMPRESSED_BLOCK_BYTES

    @property
    def max_page_bytes(self) -> int:
        return self.header_bytes + self.num_blocks * RAW_BLOCK_BYTES

    def open_elements(self, page_loc: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """bf16 element indices [T, 2, H, D] of token slots ``slots`` of the open pages at
        ``page_loc``: the one statement of the open-page layout."""
        H, D = self.num_kv_heads, self.head_dim
        dev = page_loc.device
        rhc = ((torch.arange(2, device=dev).view(2, 1, 1) * PAGE_TOKENS * H
                + torch.arange(H, device=dev).view(1, H, 1)) * D + torch.arange(D, device=dev).view(1, 1, D))
        return open_bf16_index(page_loc).view(-1, 1, 1, 1) + slots.view(-1, 1, 1, 1) * (H * D) + rhc[None]

    def compressed_blocks(self, sizes):
        """Compressed blocks of stored pages from their stored sizes (NumPy; exact below 16
        escaped blocks a page)."""
        import numpy as np
        saved = self.max_page_bytes - sizes
        return np.where(sizes >= self.open_page_bytes, 0, -(-saved // (RAW_BLOCK_BYTES - COMPRESSED_BLOCK_BYTES)))

    def page_bytes(self, num_compressed_blocks, num_escaped_blocks=0):
        """Size of a page with that many compressed (and escaped) blocks."""
        n_raw = self.num_blocks - num_compressed_blocks
        return (self.header_bytes + num_compressed_blocks * COMPRESSED_BLOCK_BYTES
                + num_escaped_blocks * ESCAPE_CHUNK_BYTES + n_raw * RAW_BLOCK_BYTES)


def block_bytes(meta):
    """Stored size of a block from its metadata byte: 1024 raw, 784 with escapes, else 768."""
    escaped = (meta & ESCAPE_FLAG) != 0
    raw = meta == RAW_MARK
    return COMPRESSED_BLOCK_BYTES + escaped * ESCAPE_CHUNK_BYTES \
        + raw * (RAW_BLOCK_BYTES - ESCAPED_BLOCK_BYTES)


def to_blocks(pages: torch.Tensor) -> torch.Tensor:
    """[P, 2, 16, H, D] -> [P, H, 2, nb, 512] in format order (K channel-grouped, V token-grouped)."""
    P, two, T, H, D = pages.shape
    nb = T * D // BLOCK_VALUES
    k = pages[:, 0]
    k = k.reshape(P, T, H, nb, 32).permute(0, 2, 3, 1, 4).reshape(P, H, nb, BLOCK_VALUES)
    v = pages[:, 1]
    v = v.reshape(P, nb, T // nb, H, D).permute(0, 3, 1, 2, 4).reshape(P, H, nb, BLOCK_VALUES)
    return torch.stack([k, v], dim=2)


def from_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_blocks`: [P, H, 2, nb, 512] -> [P, 2, 16, H, D]."""
    P, H, two, nb, n = blocks.shape
    D = nb * BLOCK_VALUES // PAGE_TOKENS
    k = blocks[:, :, 0].reshape(P, H, nb, PAGE_TOKENS, 32).permute(0, 3, 1, 2, 4)
    k = k.reshape(P, PAGE_TOKENS, H, D)
    v = blocks[:, :, 1].reshape(P, H, nb, PAGE_TOKENS // nb, D).permute(0, 2, 3, 1, 4)
    v = v.reshape(P, PAGE_TOKENS, H, D)
    return torch.stack([k, v], dim=1)
