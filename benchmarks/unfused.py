"""The unfused baseline: decompress a layer's pages into a BF16 buffer, then run the twin.

``plan_unfused`` (host side, once per page set) lists the compressed and open pages of a layer
and builds the page table of the scratch buffer; ``decode_attention_unfused`` then decompresses
the compressed pages with ``zipfusion.format.triton_codec.decompress_pages``, copies the open
ones next to them, and runs :func:`decode_attention_uncompressed` over the scratch buffer as an arena of
open pages. This is what a system without the fused kernel would do every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zipfusion.format import triton_codec
from zipfusion.format.layout import PAGE_TOKENS, PageLayout, loc_is_compressed, loc_is_open, open_bf16_index, open_loc
from zipfusion.kernels.decode_attention import _check_inputs, decode_attention_uncompressed


@dataclass
class UnfusedPlan:
    comp_offsets: torch.Tensor    # [Pc] int64 byte offsets of the compressed pages
    open_starts: torch.Tensor     # [Po] int64 bf16-element offsets of the open pages
    scratch: torch.Tensor         # [Pc + Po, 2, 16, H, D] bf16
    scratch_loc: torch.Tensor     # [max_pages] int64: page id -> open_loc(slot · open_bytes) (or -1)


def plan_unfused(arena: torch.Tensor, page_loc_layer: torch.Tensor,
                 layout: PageLayout) -> UnfusedPlan:
    """Which pages to decompress or copy, and where they land (one device sync)."""
    loc = page_loc_layer
    present = loc >= 0
    comp = present & loc_is_compressed(loc)
    opn = present & loc_is_open(loc)
    comp_ids = torch.nonzero(comp).flatten()
    open_ids = torch.nonzero(opn).flatten()
    slots = torch.full_like(loc, -1)
    slots[comp_ids] = torch.arange(comp_ids.numel(), device=loc.device)
    slots[open_ids] = comp_ids.numel() + torch.arange(open_ids.numel(), device=loc.device)
    scratch_loc = torch.where(slots >= 0, open_loc(slots * layout.open_page_bytes), slots)
    n = comp_ids.numel() + open_ids.numel()
    scratch = torch.empty(n, 2, PAGE_TOKENS, layout.num_kv_heads, layout.head_dim,
                          dtype=torch.bfloat16, device=arena.device)
    return UnfusedPlan(loc[comp_ids].contiguous(), open_bf16_index(loc[open_ids]), scratch, scratch_loc)


def decode_attention_unfused(q, arena, page_loc_layer, block_table, context_lens, layout,
                             sm_scale, out=None, *, plan: UnfusedPlan | None = None,
                             **twin_kwargs):
    """Decompress the layer's compressed pages (and copy its open pages) into a bf16 scratch
    buffer, then run the twin over it. Pass ``plan`` (from :func:`plan_unfused`) to keep the
    planning sync and allocation out of timings."""
    _check_inputs(q, arena, page_loc_layer, block_table, context_lens, layout, sm_scale, out)
    if plan is None:
        plan = plan_unfused(arena, page_loc_layer, layout)
    pc = plan.comp_offsets.numel()
    if pc:
        triton_codec.decompress_pages(arena, plan.comp_offsets, layout, plan.scratch[:pc],
                                      validate=False)
    if plan.open_starts.numel():
        n = layout.open_page_bytes // 2
        bf = arena[:arena.numel() // 2 * 2].view(torch.bfloat16)
        idx = plan.open_starts[:, None] + torch.arange(n, device=arena.device)
        plan.scratch[pc:].view(-1, n).copy_(bf[idx])
    return decode_attention_uncompressed(q, plan.scratch.view(-1).view(torch.uint8), plan.scratch_loc,
                                 block_table, context_lens, layout, sm_scale, out, **twin_kwargs)
