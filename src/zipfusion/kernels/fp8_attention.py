"""Paged decode attention over open FP8 (E4M3) pages: dequantize a tile, then the BF16 kernels'
arithmetic, so the output equals the uncompressed BF16 kernel's over the dequantized values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..format.layout import PAGE_TOKENS, loc_offset
from .triton_interpreter import kernel_module, same_mode
from . import fp8_kv, triton_attention
from .decode_attention import LOG2E, _check_inputs, check_ids
from ..format.fp8 import Fp8PageLayout, check_scale
from .splits import check_split_args, tile_plan

_TA = same_mode(triton_attention)
_begin_split, _attend_tile, _store_split = _TA.begin_split, _TA.attend_tile, _TA.store_split
_dequant = same_mode(fp8_kv).e4m3_dequant
NUM_STAGES = 1  # the compiled kernel's software pipelining
_loc_offset = triton.jit(loc_offset)
PT = tl.constexpr(PAGE_TOKENS)


def _interpreting() -> bool:
    return not isinstance(_fp8_decode_kernel, triton.runtime.jit.JITFunction)


@triton.jit(do_not_specialize=["stride_bt", "pages_per_split", "num_splits"])
def _fp8_decode_kernel(q_ptr, arena, page_loc_ptr, bt_ptr, ctx_ptr, out_ptr, part_o_ptr, part_lse_ptr,
                       qk_scale, k_scale, v_scale, stride_bt, pages_per_split, num_splits,
                       H: tl.constexpr, D: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                       TP: tl.constexpr, INTERPRET: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    ctx, p_begin, p_end, q, q_rows, t, slot, m_i, l_i, acc = _begin_split(
        q_ptr, ctx_ptr, b, h, s, pages_per_split, num_splits, H, D, G, G_PAD, TP)
    d = tl.arange(0, D)
    for p0 in range(p_begin, p_end, TP):
        page = p0 + slot
        in_range = page < p_end
        valid = in_range & (page * PT + t < ctx)
        pid = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + page, mask=in_range, other=0)
        base = _loc_offset(tl.load(page_loc_ptr + pid.to(tl.int64), mask=in_range, other=1))
        k_off = base + (t * H + h) * D  # role 0, slot t, head h
        v_off = base + ((t + PT) * H + h) * D  # role 1
        kb = tl.load(arena + k_off[:, None] + d[None, :], mask=valid[:, None], other=0)
        vb = tl.load(arena + v_off[:, None] + d[None, :], mask=valid[:, None], other=0)
        m_i, l_i, acc = _attend_tile(valid[None, :], _dequant(kb, k_scale), _dequant(vb, v_scale), q,
                                     m_i, l_i, acc, qk_scale, INTERPRET, True)
    _store_split(acc, m_i, l_i, q_rows, s, num_splits, out_ptr, part_o_ptr, part_lse_ptr, G, D)


def decode_attention_fp8(q, arena, page_loc_layer, block_table, context_lens, layout, sm_scale,
                         out=None, *, k_scale: float = 1.0, v_scale: float = 1.0,
                         num_splits: int | None = None, split_pages: int | None = None,
                         validate: bool = True, tile_pages: int | None = None,
                         num_warps: int | None = None, num_stages: int | None = None):
    """Paged decode attention over open FP8 pages (``layout`` an ``Fp8PageLayout``), K and V
    dequantized with ``k_scale`` / ``v_scale``; other arguments as ``decode_attention``'s."""
    def launch(grid, q, out, plan, TP, G, k_scale, v_scale, interp):
        m = kernel_module(arena.device, __name__, __file__, _interpreting())
        m._fp8_decode_kernel[grid](
            q, arena, page_loc_layer, block_table, context_lens, out, plan.part_o, plan.part_lse,
            float(sm_scale) * LOG2E, k_scale, v_scale, block_table.stride(0), plan.pages, plan.count,
            H=layout.num_kv_heads, D=q.shape[2], G=G, G_PAD=max(16, triton.next_power_of_2(G)), TP=TP,
            INTERPRET=interp, num_warps=num_warps or 4, num_stages=num_stages or NUM_STAGES)
    return run_fp8_decode(launch, q, arena, page_loc_layer, block_table, context_lens, layout, sm_scale, out,
                          k_scale, v_scale, num_splits, split_pages, validate, tile_pages, "decode_attention_fp8")


def run_fp8_decode(launch, q, arena, page_loc_layer, block_table, context_lens, layout, sm_scale, out,
                   k_scale, v_scale, num_splits, split_pages, validate, tile_pages, open_only):
    """What the FP8 kernels' entry points share: input checks, the split plan, then ``launch``
    (the entry point's kernel) and the merge kernel."""
    if not isinstance(layout, Fp8PageLayout):
        raise TypeError(f"layout must be a zipfusion.format.fp8.Fp8PageLayout, got {type(layout).__name__}")
    _check_inputs(q, arena, page_loc_layer, block_table, context_lens, layout, sm_scale, out)
    k_scale, v_scale = check_scale("k_scale", k_scale), check_scale("v_scale", v_scale)
    check_split_args(num_splits, split_pages)
    if validate:
        check_ids(arena, page_loc_layer, block_table, context_lens, layout, open_only)
    q = q.contiguous()
    out = torch.empty_like(q) if out is None else out
    merge = triton_attention._kernels(arena.device)[1]
    interp = arena.device.type == "cpu"
    B, Hq, D = q.shape
    H = layout.num_kv_heads
    TP, plan = tile_plan(out, B, H, block_table.shape[1], num_splits, split_pages, tile_pages, interp)
    if plan is None:
        return out
    launch((B, H, plan.count), q, out, plan, TP, Hq // H, k_scale, v_scale, interp)
    if plan.count > 1:
        merge[(B * Hq,)](plan.part_o, plan.part_lse, out, context_lens, plan.pages, plan.count,
                         HQ=Hq, D=D, num_warps=4)
    return out
