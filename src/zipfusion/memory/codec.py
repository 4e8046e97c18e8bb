"""Which codec compresses open pages and decodes stored ones (Triton on CUDA, else the torch
reference: the same bytes). ``analyze`` hands back sizes on their way to the host.
"""

from __future__ import annotations

import numpy as np
import torch

from ..format import PAGE_TOKENS, PageLayout, decode_pages, encode_pages_into, page_sizes
from ..format.fp8 import Fp8PageLayout
from ..format.fp8_blocks import decode_fp8_pages, encode_fp8_pages, fp8_page_sizes
from .copy import HostArray, copy_ranges, to_device

try:
    from ..format.triton_codec import analyze_open_pages, compress_open_pages, decompress_pages
except ImportError:
    analyze_open_pages = compress_open_pages = decompress_pages = None


FP8_SLICE = 128  # per torch pass (bounds int64 temporaries)


def uses_triton(arena: torch.Tensor) -> bool:
    """Whether pages in ``arena`` go through the Triton codec (CUDA) or the torch reference."""
    return arena.device.type == "cuda" and analyze_open_pages is not None


def _fp8(layout: PageLayout) -> bool:
    return isinstance(layout, Fp8PageLayout)


def gather_open_pages(arena: torch.Tensor, src_offsets: torch.Tensor, layout: PageLayout) -> torch.Tensor:
    """Copies of the open pages at byte ``src_offsets`` -> [P, 2, 16, H, D]."""
    nbytes = layout.open_page_bytes
    if src_offsets.numel() <= 64 and not src_offsets.is_cuda:   # few pages: slices beat an index tensor
        locs = src_offsets.tolist()
        pages = torch.cat([arena[s:s + nbytes] for s in locs]) if locs else arena[:0]
    else:
        idx = src_offsets.to(arena.device)[:, None] + torch.arange(nbytes, device=arena.device)
        pages = arena[idx.reshape(-1)]
    pages = pages.view(layout.element_dtype)
    return pages.view(-1, 2, PAGE_TOKENS, layout.num_kv_heads, layout.head_dim)


def analyze(arena: torch.Tensor, src_offsets: np.ndarray, layout: PageLayout) -> tuple[tuple, HostArray]:
    """Encoded size of each open page -> (codec state, sizes on their way to the host)."""
    src = to_device(src_offsets, arena.device)
    if _fp8(layout):
        sizes = [fp8_page_sizes(gather_open_pages(arena, src[i:i + FP8_SLICE], layout))
                 for i in range(0, src.numel(), FP8_SLICE)]
        sizes = HostArray(torch.cat(sizes) if sizes else src.new_zeros(0))
        return ("fp8", src, sizes), sizes
    if uses_triton(arena):
        base_half, sizes = analyze_open_pages(arena, src, layout, validate=False)
        return ("triton", src, base_half), HostArray(sizes)
    pages = gather_open_pages(arena, src, layout)
    return ("torch", src, pages), HostArray(page_sizes(pages))


def encode(arena: torch.Tensor, state, keep: np.ndarray, dst_offsets: np.ndarray, layout: PageLayout) -> None:
    """Write the compressed pages ``keep`` (indices into the analyzed batch) at ``dst_offsets``."""
    if len(keep) == 0:
        return
    kind, src, payload = state
    if kind == "stored":
        start, size = payload
        copy_ranges(src, arena, start[keep], np.asarray(dst_offsets, dtype=np.int64), size[keep])
        return
    if kind == "fp8":
        sizes, keep = payload.get(), np.asarray(keep, dtype=np.int64)
        dst_offsets = np.asarray(dst_offsets, dtype=np.int64)
        for i in range(0, keep.size, FP8_SLICE):
            part = keep[i:i + FP8_SLICE]
            buf, _ = encode_fp8_pages(gather_open_pages(arena, src[to_device(part, arena.device)], layout))
            copy_ranges(buf.view(-1), arena, np.arange(part.size) * buf.shape[1], dst_offsets[i:i + FP8_SLICE],
                        sizes[part])
        return
    keep_t, dst = to_device(np.stack([keep, dst_offsets]), arena.device)
    if kind == "triton":
        compress_open_pages(arena, src, payload, dst, layout, index=keep_t, validate=False)
    else:
        encode_pages_into(payload[keep_t].contiguous(), arena, dst)


def stored(buf: torch.Tensor, start: np.ndarray, nbytes: np.ndarray):
    """The state of pages encoded already, in ``buf`` (the host tier's swap-in)."""
    return "stored", buf, (np.asarray(start, dtype=np.int64).reshape(-1), np.asarray(nbytes, dtype=np.int64).reshape(-1))


def staged(state, keep: np.ndarray, offsets: np.ndarray, device):
    """The state of an analysis whose pages ``keep`` were copied, open, to a staging tensor."""
    kind, src, payload = state
    if kind in ("torch", "stored"):
        return state
    src = src.clone()
    src[to_device(keep, device)] = to_device(offsets, device)
    return kind, src, payload


def decode(arena: torch.Tensor, offsets: np.ndarray, sizes: np.ndarray, layout: PageLayout,
           trusted: bool = False) -> torch.Tensor:
    """Decoded compressed pages at byte ``offsets`` -> [P, 2, 16, H, D] bf16; metadata checked
    unless ``trusted`` (this process's own bytes: no check, no sync)."""
    off = to_device(offsets, arena.device)
    if _fp8(layout):
        return decode_fp8_pages(arena, off, None if trusted else np.asarray(sizes, dtype=np.int64),
                                layout.num_kv_heads, layout.head_dim)
    if uses_triton(arena):
        return decompress_pages(arena, off, layout, validate=not trusted)
    return decode_pages(arena, off, layout.num_kv_heads, layout.head_dim,
                        sizes=None if trusted else torch.from_numpy(np.asarray(sizes, dtype=np.int64)))
