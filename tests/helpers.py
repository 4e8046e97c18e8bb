"""Test helpers, outside the package: arenas laid out for the attention tests."""

from __future__ import annotations

import torch

from zipfusion.format import PageLayout, encode_pages_into, page_sizes


def build_arena(pages: torch.Tensor, compressed: torch.Tensor, *, seed: int = 0,
                gap_bytes: int = 64, device=None, chunk: int = 1024
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Lay pages [P, 2, 16, H, D] out in a fresh arena, in a random order with random gaps.

    ``compressed[i]`` (bool) stores page i compressed (reference encoder), else open. Returns
    (arena uint8, page_loc int64 [P]: offset for compressed pages, offset | 1 for open ones).
    Gaps and unused bytes hold random bytes, so that a kernel reading outside a page shows.
    """
    device = torch.device(device) if device is not None else pages.device
    P, _, _, H, D = pages.shape
    layout = PageLayout(H, D)
    g = torch.Generator().manual_seed(seed)
    compressed = compressed.to(torch.bool).cpu()
    sizes = torch.full((P,), layout.open_page_bytes, dtype=torch.int64)
    comp_idx = torch.nonzero(compressed).flatten()
    for c in comp_idx.split(chunk):
        sizes[c] = page_sizes(pages[c.to(pages.device)].to(device)).cpu()
    order = torch.randperm(P, generator=g)
    gaps = torch.randint(0, gap_bytes // 16 + 1, (P,), generator=g) * 16
    ends = torch.cumsum(gaps[order] + sizes[order], 0)
    loc = torch.empty(P, dtype=torch.int64)
    loc[order] = ends - sizes[order]
    total = int(ends[-1]) + 16 if P else 16
    dg = torch.Generator(device=device).manual_seed(seed)
    arena = torch.randint(0, 256, (total,), generator=dg, dtype=torch.uint8, device=device)
    for c in comp_idx.split(chunk):
        encode_pages_into(pages[c.to(pages.device)].to(device), arena, loc[c].to(device))
    n = layout.open_page_bytes
    for c in torch.nonzero(~compressed).flatten().split(max(1, chunk // 8)):
        idx = loc[c].to(device)[:, None] + torch.arange(n, device=device)
        arena[idx.flatten()] = pages[c.to(pages.device)].to(device).contiguous().view(
            torch.uint8).flatten()
    page_loc = torch.where(compressed, loc, loc | 1).to(device)
    return arena, page_loc
