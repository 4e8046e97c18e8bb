"""Bit-exact byte moves inside the arena (compaction, pages stored in open form).

Pages start at 16-byte aligned offsets and their sizes are multiples of 16, so the arena is
viewed as rows of 16 bytes and a move is one gather into a temporary plus one scatter. Moves
are done in batches of at most ``batch_bytes`` so the temporary stays small; inside a batch
every source is read before any destination is written, so a page may slide onto its own old
bytes (compaction relies on the order argument in packed.py for bytes of later batches).
"""

from __future__ import annotations

import numpy as np
import torch

ROW = 16


def _row_index(starts: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Row numbers of every 16-byte row of every range, concatenated."""
    rows = nbytes // ROW
    total = int(rows.sum())
    first = np.repeat(starts // ROW - np.concatenate([[0], np.cumsum(rows)[:-1]]), rows)
    return first + np.arange(total, dtype=np.int64)


def move_ranges(arena: torch.Tensor, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray,
                batch_bytes: int = 64 << 20) -> None:
    """Copy ``nbytes[i]`` bytes from ``src[i]`` to ``dst[i]``, in order, bit-exact."""
    if len(src) == 0 or arena.device.type == "meta":
        return
    rows = arena.view(-1, ROW)
    i, n = 0, len(src)
    csum = np.concatenate([[0], np.cumsum(nbytes)])
    while i < n:
        j = int(np.searchsorted(csum, csum[i] + batch_bytes, side="right")) - 1
        j = min(max(j, i + 1), n)
        s_rows = torch.from_numpy(_row_index(src[i:j], nbytes[i:j])).to(arena.device)
        d_rows = torch.from_numpy(_row_index(dst[i:j], nbytes[i:j])).to(arena.device)
        rows[d_rows] = rows[s_rows]        # advanced indexing: gathers into a temporary first
        i = j
