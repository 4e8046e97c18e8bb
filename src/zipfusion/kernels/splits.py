"""Split-KV planning shared by the Triton and CUDA launchers: fixed split sizes (``split_pages``,
batch-invariant) or each request's pages balanced over the splits in whole tiles.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch


def split_size(n_pages: int, pages: int, count: int) -> int:
    """Pages per split of a request (> 0: fixed; -T: balanced in whole T-page tiles), the
    kernels' rule written once more for the host and tests."""
    if pages > 0:
        return pages
    even = -(-n_pages // count)
    return max(-pages, -(-even // -pages) * -pages)


class SplitPlan(NamedTuple):
    count: int
    pages: int  # or -T: balanced in tiles of T pages
    part_o: torch.Tensor  # empty when S == 1
    part_lse: torch.Tensor  # empty when S == 1


def check_split_args(num_splits, split_pages) -> None:
    for name, v in (("num_splits", num_splits), ("split_pages", split_pages)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be a positive int or None, got {v!r}")
    if num_splits is not None and split_pages is not None:
        raise ValueError("give num_splits or split_pages, not both (split_pages fixes the split "
                         "size, and with it the number of splits)")


def plan_splits(out: torch.Tensor, max_pages: int, num_splits: int | None,
                split_pages: int | None, default: Callable[[], int],
                tile_pages: int = 1) -> SplitPlan:
    """The splits of a launch over a block table ``max_pages`` wide, and their buffers."""
    if split_pages is not None:
        pages = split_pages
        S = max(1, -(-max_pages // pages))
    else:
        pages = -tile_pages
        S = max(1, min(num_splits or default(), -(-max_pages // tile_pages)))
    if S == 1:  # unused stand-ins: the kernels see the same argument types
        unused = out.new_empty(0, dtype=torch.float32)
        return SplitPlan(1, pages, unused, unused)
    B, Hq, D = out.shape
    part_o = torch.empty(B * Hq * S * D, dtype=torch.float32, device=out.device)
    part_lse = torch.empty(B * Hq * S, dtype=torch.float32, device=out.device)
    return SplitPlan(S, pages, part_o, part_lse)


def default_num_splits(batch: int, num_kv_heads: int, max_pages: int, tile_pages: int,
                       device: torch.device) -> int:
    """Split-KV factor: about 4 programs per SM, each with at least 4 tiles of work."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = 4
    want = -(-4 * sms // max(1, batch * num_kv_heads))
    most = max(1, max_pages // (4 * tile_pages))
    return int(max(1, min(want, most, 64)))


def tile_plan(out: torch.Tensor, batch: int, num_kv_heads: int, max_pages: int, num_splits, split_pages,
              tile_pages, interpreted: bool) -> tuple[int, SplitPlan | None]:
    """A Triton launch's tile of TP pages and its :class:`SplitPlan` (None for an empty batch)."""
    TP = tile_pages or (1 if interpreted else 2)
    if tile_pages is None and split_pages is not None:
        TP = math.gcd(TP, split_pages)
    if isinstance(TP, bool) or not isinstance(TP, int) or TP < 1 or TP & (TP - 1):
        raise ValueError(f"tile_pages must be a power of 2, got {tile_pages!r}")
    if split_pages is not None and split_pages % TP:
        raise ValueError(f"split_pages={split_pages} must be a multiple of the Triton kernel's "
                         f"tile of {TP} pages (tile_pages={TP})")
    if batch == 0:
        return TP, None
    return TP, plan_splits(out, max_pages, num_splits, split_pages,
                           lambda: default_num_splits(batch, num_kv_heads, max_pages, TP, out.device), TP)
