"""Which codec compresses full open pages in the arena, and decodes stored ones: the one
dispatch point.

On CUDA, ``zipfusion.format.triton_codec`` (``analyze_open_pages`` / ``compress_open_pages``)
if it imports; otherwise (CPU, or no Triton codec) the torch reference: gather the open pages
as ``[P, 2, 16, H, D]`` bf16, ``page_sizes`` and ``encode_pages_into``. Both write identical
bytes (the format's contract), so the rest of the manager does not care which one ran.

Two steps, because the manager must know the sizes before it can choose destinations:
``analyze(...) -> (state, sizes)`` (sizes: a ``copy.HostArray`` on their way to the host, so the
caller decides when to wait: the engine launches the analysis behind one step's sampling and
reads the sizes while the next step's forward runs) then
``encode(..., state, keep, dst_offsets)`` for any subset of the analysis (on CUDA: one launch,
indices and destinations in one asynchronous copy, no gather, no sync). ``decode`` reads
compressed pages back (prefill over earlier chunks, the CPU attention path): the Triton
``decompress_pages`` on CUDA, the reference elsewhere; both check the metadata first unless the
bytes are trusted (the host tier's own).

FP8 pages (``Fp8PageLayout``: ``kv_cache_dtype="fp8_lossless"``) go through the
torch codec of :mod:`zipfusion.format.fp8_blocks` on every device, ``FP8_SLICE`` page-layers at a
time: the analysis sizes the pages, ``encode`` reads the (unchanged, full) open pages again,
encodes them and copies each page's bytes to its destination (sizes known on the host: no sync).
"""

from __future__ import annotations

import numpy as np
import torch

from ..format import PAGE_TOKENS, PageLayout, decode_pages, encode_pages_into, page_sizes
from ..format.fp8 import Fp8PageLayout
from ..format.fp8_blocks import decode_fp8_pages, encode_fp8_pages, fp8_page_sizes
from .copy import HostArray, copy_ranges, to_device

try:                                          # needs Triton; optional on CPU
    from ..format.triton_codec import analyze_open_pages, compress_open_pages, decompress_pages
except ImportError:                           # pragma: no cover - depends on the install
    analyze_open_pages = compress_open_pages = decompress_pages = None


FP8_SLICE = 128                               # FP8 page-layers per torch pass (~0.4 GB of int64 temporaries at H=8, D=128)


def uses_triton(arena: torch.Tensor) -> bool:
    """Whether pages in ``arena`` go through the Triton codec (CUDA) or the torch reference."""
    return arena.device.type == "cuda" and analyze_open_pages is not None


def _fp8(layout: PageLayout) -> bool:
    return isinstance(layout, Fp8PageLayout)


def gather_open_pages(arena: torch.Tensor, src_offsets: torch.Tensor, layout: PageLayout) -> torch.Tensor:
    """Copies of the open pages at byte ``src_offsets`` -> [P, 2, 16, H, D] of the layout's
    ``element_dtype`` (bf16; uint8 E4M3 codes for FP8 pages)."""
    nbytes = layout.open_page_bytes
    if src_offsets.numel() <= 64 and not src_offsets.is_cuda:   # few pages: slices beat an index
                                                                  # tensor of P*nbytes (no sync on CUDA)
        locs = src_offsets.tolist()
        pages = torch.cat([arena[s:s + nbytes] for s in locs]) if locs else arena[:0]
    else:
        idx = src_offsets.to(arena.device)[:, None] + torch.arange(nbytes, device=arena.device)
        pages = arena[idx.reshape(-1)]
    pages = pages.view(layout.element_dtype)
    return pages.view(-1, 2, PAGE_TOKENS, layout.num_kv_heads, layout.head_dim)


def analyze(arena: torch.Tensor, src_offsets: np.ndarray, layout: PageLayout) -> tuple[tuple, HostArray]:
    """Encoded size of each open page at ``src_offsets`` -> (codec state, sizes: int64 [P] on
    their way to the host, ``.get()``)."""
    src = to_device(src_offsets, arena.device)
    if _fp8(layout):                          # torch, a slice of pages at a time (encode re-reads them)
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
    if kind == "stored":                      # encoded already (:func:`stored`): the bytes are copied
        start, size = payload
        copy_ranges(src, arena, start[keep], np.asarray(dst_offsets, dtype=np.int64), size[keep])
        return
    if kind == "fp8":                         # encoded a slice at a time, then copied (sizes known)
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
    """The state of pages encoded already, their bytes in ``buf`` (the host tier's swap-in):
    page ``i`` of the batch at ``start[i]``, ``nbytes[i]`` bytes (layer-major, as ``analyze``'s
    sizes). ``encode`` copies them."""
    return "stored", buf, (np.asarray(start, dtype=np.int64).reshape(-1), np.asarray(nbytes, dtype=np.int64).reshape(-1))


def staged(state, keep: np.ndarray, offsets: np.ndarray, device):
    """The state of an analysis whose pages ``keep`` have been copied, open, to ``offsets`` of a
    staging tensor: ``encode(stage, staged(...), keep, ...)`` then reads them there."""
    kind, src, payload = state
    if kind in ("torch", "stored"):           # the state holds copies of the pages already (fp8, triton: offsets)
        return state
    src = src.clone()
    src[to_device(keep, device)] = to_device(offsets, device)
    return kind, src, payload


def decode(arena: torch.Tensor, offsets: np.ndarray, sizes: np.ndarray, layout: PageLayout,
           trusted: bool = False) -> torch.Tensor:
    """Decoded compressed pages at byte ``offsets`` (sizes in bytes) -> [P, 2, 16, H, D] bf16.
    The metadata is checked first, unless ``trusted`` (bytes this process's encoder wrote, such
    as the host tier's: then no check and, on CUDA, no host sync)."""
    off = to_device(offsets, arena.device)
    if _fp8(layout):
        return decode_fp8_pages(arena, off, None if trusted else np.asarray(sizes, dtype=np.int64),
                                layout.num_kv_heads, layout.head_dim)
    if uses_triton(arena):
        return decompress_pages(arena, off, layout, validate=not trusted)
    return decode_pages(arena, off, layout.num_kv_heads, layout.head_dim,
                        sizes=None if trusted else torch.from_numpy(np.asarray(sizes, dtype=np.int64)))
