"""Sizes and index maps of the KV page format (docs/format.md, sections 1 and 3).

Everything that knows *where* a value or a block lives is here, so that the CPU reference
codec, the Triton codec kernels and the attention kernel agree by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:       # the Triton interpreter runs a @jit function only where triton.language is visible to it
    import triton.language as tl  # noqa: F401  (the tag functions below are kernels' own too)
except ImportError:                 # no Triton on this platform: the torch/NumPy uses still work
    tl = None

PAGE_TOKENS = 16          # tokens per KV page
BLOCK_VALUES = 512        # values per block
GROUP_VALUES = 8          # values restored together (one 8-byte + one 4-byte load)
COMPRESSED_BLOCK_BYTES = 768
ESCAPE_CHUNK_BYTES = 16   # v2: the escape records appended to a compressed block
ESCAPED_BLOCK_BYTES = COMPRESSED_BLOCK_BYTES + ESCAPE_CHUNK_BYTES
RAW_BLOCK_BYTES = 1024
RAW_MARK = 0xFF           # metadata byte of a block stored raw
ESCAPE_FLAG = 0x80        # v2: metadata byte bit 7 (with b/2 <= 126 below it): the block has escapes
MAX_ESCAPES = 4           # v2: escape records per block (a block with more outliers is raw)
SUPPORTED_HEAD_DIMS = (64, 128, 256)


# ---- the page-location tag ---------------------------------------------------------------
# ``page_loc`` holds, per layer and page id, the page's byte offset in the arena with bit 0 set
# for a page in open form ([2, 16, H, D] bf16) and clear for a compressed one; -1 for no page.
# Offsets are multiples of 16, so bit 0 is free. These are the only functions that read or
# write the tag. Each is plain integer arithmetic, so one body serves Python ints, NumPy arrays,
# torch tensors and Triton kernels: a kernel module makes its Triton copy with ``triton.jit(loc_offset)``
# (in its own import, so that the copy is interpreted exactly when its kernels are).

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

    element_dtype = torch.bfloat16    # an open page's values (Fp8PageLayout: uint8 E4M3 codes)

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
        """nb: blocks of 512 values per head for K (and as many for V)."""
        return PAGE_TOKENS * self.head_dim // BLOCK_VALUES

    @property
    def record_bytes(self) -> int:
        """M: metadata bytes per (head, K or V): a u32 offset + one byte per block, padded to 8."""
        return 8 * -(-(4 + self.blocks_per_head) // 8)

    @property
    def header_bytes(self) -> int:
        return 2 * self.num_kv_heads * self.record_bytes

    @property
    def num_blocks(self) -> int:
        """Blocks in a page, K and V of all heads."""
        return 2 * self.num_kv_heads * self.blocks_per_head

    @property
    def open_page_bytes(self) -> int:
        """Size of an uncompressed page [2, 16, H, D] bf16."""
        return 2 * PAGE_TOKENS * self.num_kv_heads * self.head_dim * 2

    @property
    def min_page_bytes(self) -> int:
        return self.header_bytes + self.num_blocks * COMPRESSED_BLOCK_BYTES

    @property
    def max_page_bytes(self) -> int:
        return self.header_bytes + self.num_blocks * RAW_BLOCK_BYTES

    def open_elements(self, page_loc: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Where token slot ``slots[t]`` of the open page at ``page_loc[t]`` lives: bf16 element
        indices [T, 2, H, D] into ``arena.view(torch.bfloat16)``, role r (0 = K, 1 = V), head h,
        channel c at ``open_bf16_index(page_loc) + ((r·16 + slot)·H + h)·D + c``.
        The one statement of the open-page layout; the Triton store kernels compute the same."""
        H, D = self.num_kv_heads, self.head_dim
        dev = page_loc.device
        rhc = ((torch.arange(2, device=dev).view(2, 1, 1) * PAGE_TOKENS * H
                + torch.arange(H, device=dev).view(1, H, 1)) * D + torch.arange(D, device=dev).view(1, 1, D))
        return open_bf16_index(page_loc).view(-1, 1, 1, 1) + slots.view(-1, 1, 1, 1) * (H * D) + rhc[None]

    def compressed_blocks(self, sizes):
        """Compressed blocks of stored pages from their stored sizes (NumPy; a page stored in
        open form: 0). A page saves 256 bytes per compressed block less 16 per block with
        escapes (format v2), so ceil(saved / 256) counts them exactly while a page has fewer
        than 16 blocks with escapes (and undercounts by one per 16 beyond)."""
        import numpy as np
        saved = self.max_page_bytes - sizes
        return np.where(sizes >= self.open_page_bytes, 0, -(-saved // (RAW_BLOCK_BYTES - COMPRESSED_BLOCK_BYTES)))

    def page_bytes(self, num_compressed_blocks, num_escaped_blocks=0):
        """Size of a page with that many compressed blocks, ``num_escaped_blocks`` of them with
        escapes (format v2); ints or integer arrays."""
        n_raw = self.num_blocks - num_compressed_blocks
        return (self.header_bytes + num_compressed_blocks * COMPRESSED_BLOCK_BYTES
                + num_escaped_blocks * ESCAPE_CHUNK_BYTES + n_raw * RAW_BLOCK_BYTES)


def block_bytes(meta):
    """Stored size of a block from its metadata byte (int, NumPy or torch integers): 1024 for
    RAW_MARK, 784 for a compressed block with escapes (bit 7 set), else 768."""
    escaped = (meta & ESCAPE_FLAG) != 0
    raw = meta == RAW_MARK
    return COMPRESSED_BLOCK_BYTES + escaped * ESCAPE_CHUNK_BYTES \
        + raw * (RAW_BLOCK_BYTES - ESCAPED_BLOCK_BYTES)


def to_blocks(pages: torch.Tensor) -> torch.Tensor:
    """[P, 2, 16, H, D] -> [P, H, 2, nb, 512] in format order (head, K/V, block, value).

    K blocks are channel-grouped (16 tokens x 32 channels, token-major), V blocks are
    token-grouped (512/D tokens x D channels, token-major).
    """
    P, two, T, H, D = pages.shape
    nb = T * D // BLOCK_VALUES
    k = pages[:, 0]                                     # [P, T, H, D]
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
