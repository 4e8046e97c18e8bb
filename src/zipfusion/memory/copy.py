"""Bit-exact byte moves inside the arena, through a temporary buffer in batches; ``to_device`` and
``HostArray`` move arrays to and from the GPU through pinned memory without a stream sync.
"""

from __future__ import annotations

import numpy as np
import torch

ROW = 16

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


if triton is not None:
    @triton.jit
    def _copy_ranges_kernel(src_ptr, dst_ptr, src_off_ptr, dst_off_ptr, n_ptr, BLOCK: tl.constexpr):
        """Program i copies n[i] int32 words from src + src_off[i] to dst + dst_off[i]."""
        i = tl.program_id(0)
        s = tl.multiple_of(tl.load(src_off_ptr + i), 4)
        d = tl.multiple_of(tl.load(dst_off_ptr + i), 4)
        n = tl.load(n_ptr + i)
        for start in range(0, n, BLOCK):
            w = start + tl.arange(0, BLOCK)
            m = w < n
            tl.store(dst_ptr + d + w, tl.load(src_ptr + s + w, mask=m), mask=m)


def to_device(a, device: torch.device) -> torch.Tensor:
    """A host array or tensor on ``device``: on CUDA through a pinned copy, asynchronously."""
    t = a.contiguous() if isinstance(a, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class HostArray:
    """A device tensor on its way to the host (pinned, with an event); :meth:`get` waits for it."""

    def __init__(self, t: torch.Tensor):
        if t.is_cuda:
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._host.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host, self._event = t, None

    def get(self) -> np.ndarray:
        if self._event is not None:
            self._event.synchronize()
        return self._host.numpy()


def _row_index(starts: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    rows = nbytes // ROW
    total = int(rows.sum())
    first = np.repeat(starts // ROW - np.concatenate([[0], np.cumsum(rows)[:-1]]), rows)
    return first + np.arange(total, dtype=np.int64)


def _words(t: torch.Tensor) -> torch.Tensor:
    return t[:t.numel() // 4 * 4].view(torch.int32)


def copy_ranges(src: torch.Tensor, dst: torch.Tensor, src_off: np.ndarray, dst_off: np.ndarray,
                nbytes: np.ndarray) -> None:
    """Copy ``nbytes[i]`` bytes from ``src`` at ``src_off[i]`` to ``dst`` at ``dst_off[i]``
    (16-byte aligned; one tensor only if no destination overlaps a source)."""
    if len(src_off) == 0 or dst.device.type == "meta":
        return
    src_off, dst_off, nbytes = (np.asarray(a, dtype=np.int64).reshape(-1) for a in (src_off, dst_off, nbytes))
    if src.is_cuda and triton is not None:
        s, d, n = to_device(np.stack([src_off, dst_off, nbytes]) // 4, src.device)
        _copy_ranges_kernel[(len(src_off),)](_words(src), _words(dst), s, d, n, BLOCK=1024)
        return
    s_rows = torch.from_numpy(_row_index(src_off, nbytes)).to(src.device)
    d_rows = torch.from_numpy(_row_index(dst_off, nbytes)).to(dst.device)
    dst.view(-1, ROW)[d_rows] = src.view(-1, ROW)[s_rows]  # advanced indexing: a gather first


def batches(sizes: np.ndarray, limit: int):
    """(i, j) slices of consecutive items whose sizes sum to at most ``limit`` (one item at least)."""
    ends = np.cumsum(sizes)
    i = 0
    while i < len(sizes):
        j = max(i + 1, int(np.searchsorted(ends, ends[i] - sizes[i] + limit, side="right")))
        yield i, j
        i = j


def move_ranges(arena: torch.Tensor, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray,
                batch_bytes: int = 64 << 20) -> None:
    """Copy ``nbytes[i]`` bytes from ``src[i]`` to ``dst[i]``, in order, bit-exact."""
    if len(src) == 0 or arena.device.type == "meta":
        return
    src, dst, nbytes = (np.asarray(a, dtype=np.int64).reshape(-1) for a in (src, dst, nbytes))
    csum = np.concatenate([[0], np.cumsum(nbytes)])
    for i, j in batches(nbytes, batch_bytes):
        if arena.is_cuda and triton is not None:
            temp = torch.empty(int(csum[j] - csum[i]), dtype=torch.uint8, device=arena.device)
            packed = csum[i:j] - csum[i]
            copy_ranges(arena, temp, src[i:j], packed, nbytes[i:j])
            copy_ranges(temp, arena, packed, dst[i:j], nbytes[i:j])
        else:
            copy_ranges(arena, arena, src[i:j], dst[i:j], nbytes[i:j])
