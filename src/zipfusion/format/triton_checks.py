"""Argument checks of the Triton codec wrappers (``triton_codec``): types, shapes, devices,
and -- when asked, since they need a device sync -- offset alignment and ranges."""

from __future__ import annotations

import torch

from .layout import PageLayout

_ALIGN = 16   # every page starts at a 16-byte aligned arena offset (docs/design.md)


def check_layout(layout) -> PageLayout:
    if not isinstance(layout, PageLayout):
        raise TypeError(f"layout must be a zipfusion.format.PageLayout, got {type(layout).__name__}")
    return layout


def check_arena(arena) -> torch.device:
    if not isinstance(arena, torch.Tensor):
        raise TypeError(f"arena must be a torch.Tensor, got {type(arena).__name__}")
    if arena.dtype != torch.uint8 or arena.dim() != 1:
        raise TypeError("arena must be a 1-D torch.uint8 tensor (docs/design.md), got "
                        f"{arena.dtype} with shape {list(arena.shape)}")
    if not arena.is_contiguous():
        raise ValueError("arena must be contiguous")
    if arena.device.type not in ("cuda", "cpu"):
        raise ValueError(f"arena must live on a CUDA device (or the CPU, for the Triton "
                         f"interpreter), got {arena.device}")
    if arena.data_ptr() % _ALIGN:
        raise ValueError("arena's first byte must be 16-byte aligned; allocate it with torch.empty "
                         "and do not pass an unaligned slice")
    return arena.device


def check_offsets(name: str, offsets, device: torch.device, length: int | None = None,
                   arena_bytes: int | None = None, page_bytes=None, validate: bool = True) -> torch.Tensor:
    """Offsets must be a 1-D int64 tensor on the arena's device, 16-aligned, pages inside the arena."""
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"{name} must be a torch.int64 tensor of byte offsets, got {type(offsets).__name__}")
    if offsets.dtype != torch.int64 or offsets.dim() != 1:
        raise TypeError(f"{name} must be a 1-D torch.int64 tensor, got {offsets.dtype} with shape "
                        f"{list(offsets.shape)}")
    if offsets.device != device:
        raise ValueError(f"{name} is on {offsets.device} but the arena is on {device}; "
                         f"move it with .to(arena.device)")
    if length is not None and offsets.numel() != length:
        raise ValueError(f"{name} has {offsets.numel()} entries, expected {length} (one per page)")
    offsets = offsets.contiguous()
    if validate and offsets.numel():
        end = offsets + page_bytes if page_bytes is not None else offsets
        bad = (offsets % _ALIGN != 0) | (offsets < 0) | (end > arena_bytes)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            o = int(offsets[i])
            why = ("is not a multiple of 16" if o % _ALIGN else
                   "puts the page outside the arena")
            raise ValueError(f"{name}[{i}] = {o} {why} (arena of {arena_bytes} bytes); pages "
                             f"start at 16-byte aligned offsets inside the arena")
    return offsets


def check_index(index, P: int, device: torch.device, validate: bool) -> torch.Tensor:
    """``index``: a 1-D int64 tensor on the arena's device, entries in 0..P-1 (checked when
    ``validate``)."""
    if not isinstance(index, torch.Tensor) or index.dtype != torch.int64 or index.dim() != 1:
        raise TypeError(f"index must be a 1-D torch.int64 tensor, got {getattr(index, 'dtype', type(index).__name__)}")
    if index.device != device:
        raise ValueError(f"index is on {index.device} but the arena is on {device}")
    index = index.contiguous()
    if validate and index.numel() and bool(((index < 0) | (index >= P)).any()):
        raise ValueError(f"index holds entries outside 0..{P - 1} (the analyzed pages)")
    return index
