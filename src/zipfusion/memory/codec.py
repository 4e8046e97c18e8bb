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
"""

from __future__ import annotations

import numpy as np
import torch

from ..format import PAGE_TOKENS, PageLayout, decode_pages, encode_pages_into, page_sizes
from .copy import HostArray, copy_ranges, to_device

try:                                          # needs Triton; optional on CPU
    from ..format.triton_codec import analyze_open_pages, compress_open_pages, decompress_pages
except ImportError:                           # pragma: no cover - depends on the install
    analyze_open_pages = compress_open_pages = decompress_pages = None


def uses_triton(arena: torch.Tensor) -> bool:
    """Whether pages in ``arena`` go through the Triton codec (CUDA) or the torch reference."""
    return arena.device.type == "cuda" and analyze_open_pages is not None


def gather_open_pages(arena: torch.Tensor, src_offsets: torch.Tensor, layout: PageLayout) -> torch.Tensor:
    """Copies of the open pages at byte ``src_offsets`` -> [P, 2, 16, H, D] bf16."""
    nbytes = layout.open_page_bytes
    if src_offsets.numel() <= 64:         # few pages: slices beat an index tensor of P*nbytes
        locs = src_offsets.tolist()
        pages = torch.cat([arena[s:s + nbytes] for s in locs]) if locs else arena[:0]
        pages = pages.view(torch.bfloat16)
    else:
        idx = src_offsets.to(arena.device)[:, None] + torch.arange(nbytes, device=arena.device)
        pages = arena[idx.reshape(-1)].view(torch.bfloat16)
    return pages.view(-1, 2, PAGE_TOKENS, layout.num_kv_heads, layout.head_dim)


def analyze(arena: torch.Tensor, src_offsets: np.ndarray, layout: PageLayout) -> tuple[tuple, HostArray]:
    """Encoded size of each open page at ``src_offsets`` -> (codec state, sizes: int64 [P] on
    their way to the host, ``.get()``)."""
    src = to_device(src_offsets, arena.device)
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
    if kind in ("torch", "stored"):           # the state holds copies of the pages already
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
    if uses_triton(arena):
        return decompress_pages(arena, off, layout, validate=not trusted)
    return decode_pages(arena, off, layout.num_kv_heads, layout.head_dim,
                        sizes=None if trusted else torch.from_numpy(np.asarray(sizes, dtype=np.int64)))
