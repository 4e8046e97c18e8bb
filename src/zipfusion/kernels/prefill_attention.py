"""Paged prefill attention over the KV arena, fused with the page decoder (Triton): chunks attend
causally to their pages read in place, planned once a step (``plan_prefill``) with the decode
kernel's loads, restore and softmax, so a row's bits depend on its chunk alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..format.layout import PAGE_TOKENS
from .triton_interpreter import kernel_module, same_mode
from . import triton_attention
from .decode_attention import (LOG2E, check_block_table, check_ids, check_q_and_arena,
                               check_scale_and_out, check_tensors)

# The decode kernel's helpers, in this module's mode (interpreted or compiled).
_TA = same_mode(triton_attention)
_load_meta, _tile_load, _tile_compute = _TA._load_meta, _TA._tile_load, _TA._tile_compute
_restore_tile = _TA._restore_tile
PT = tl.constexpr(PAGE_TOKENS)


def _interpreting() -> bool:
    return not isinstance(_prefill_kernel, triton.runtime.jit.JITFunction)


@triton.jit
def _kv_tiles(p_lo, p_hi, ctx, pos, q, m_i, l_i, acc, qk_scale, arena32, page_loc_ptr, bt_ptr,
              c, stride_bt, h, H: tl.constexpr, D: tl.constexpr, TP: tl.constexpr,
              COMPRESSED: tl.constexpr, INTERPRET: tl.constexpr, MASKED: tl.constexpr):
    """Online softmax over the K/V tiles of pages p_lo .. p_hi - 1; ``MASKED``: keys past a
    row's position ``pos``."""
    r = tl.arange(0, TP * PT)
    t = r % PT
    slot = r // PT
    for p0 in range(p_lo, p_hi, TP):
        loc, kf, kh0, kh1, vf, vh0, vh1 = _load_meta(arena32, page_loc_ptr, bt_ptr, c, stride_bt,
                                                     p0, slot, p_hi, h, D, COMPRESSED)
        (valid, k_p4, k_lo, k_code, k_meta, k_esc, k_packed, v_p4, v_lo, v_code, v_meta, v_esc,
         v_packed, any_esc) = _tile_load(p0, ctx, p_hi, t, slot, h, arena32, loc, kf, kh0, kh1,
                                         vf, vh0, vh1, H, D, COMPRESSED)
        mask = valid[None, :] & (((p0 + slot) * PT + t)[None, :] <= pos[:, None])
        m_i, l_i, acc = _tile_compute(mask, k_p4, k_lo, k_code, k_meta, k_esc, k_packed, v_p4,
                                      v_lo, v_code, v_meta, v_esc, v_packed, any_esc, q, m_i,
                                      l_i, acc, qk_scale, COMPRESSED, INTERPRET, MASKED)
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(q_ptr, arena32, page_loc_ptr, bt_ptr, indptr_ptr, start_ptr, end_ptr, items_ptr,
                    out_ptr, lse_ptr, qk_scale, stride_bt,
                    H: tl.constexpr, D: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                    BT: tl.constexpr, TP: tl.constexpr, COMPRESSED: tl.constexpr,
                    INTERPRET: tl.constexpr, WRITE_LSE: tl.constexpr):
    pid = tl.program_id(0)
    item = pid // H
    h = pid % H
    c = tl.load(items_ptr + 2 * item)
    m0 = tl.load(items_ptr + 2 * item + 1)
    row0 = tl.load(indptr_ptr + c)
    n_rows = tl.load(indptr_ptr + c + 1) - row0
    start = tl.load(start_ptr + c)
    kv_end = tl.load(end_ptr + c)   # keys past kv_end - 1 are never seen

    rm = tl.arange(0, BT * G_PAD)
    i = m0 + rm // G_PAD            # token of the chunk
    g = rm % G_PAD                  # query head in the group
    pos = tl.minimum(start + i, kv_end - 1)
    rows = ((row0 + i).to(tl.int64) * (H * G) + h * G + g) * D
    ok = (i < n_rows) & (g < G)
    row_ok = ok[:, None]
    d = tl.arange(0, D)
    q = tl.load(q_ptr + rows[:, None] + d[None, :], mask=row_ok, other=0.0)

    ctx = tl.minimum(start + tl.minimum(m0 + BT, n_rows), kv_end)     # keys read: 0 .. ctx - 1
    p_full = (tl.minimum(start + m0, kv_end - 1) + 1) // (PT * TP) * TP  # unmasked tiles
    m_i = tl.full([BT * G_PAD], -1.0e30, tl.float32)
    l_i = tl.full([BT * G_PAD], 0.0, tl.float32)
    acc = tl.full([BT * G_PAD, D], 0.0, tl.float32)
    m_i, l_i, acc = _kv_tiles(0, p_full, ctx, pos, q, m_i, l_i, acc, qk_scale, arena32,
                              page_loc_ptr, bt_ptr, c, stride_bt, h, H, D, TP, COMPRESSED,
                              INTERPRET, False)
    m_i, l_i, acc = _kv_tiles(p_full, (ctx + PT - 1) // PT, ctx, pos, q, m_i, l_i, acc, qk_scale,
                              arena32, page_loc_ptr, bt_ptr, c, stride_bt, h, H, D, TP,
                              COMPRESSED, INTERPRET, True)
    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(out_ptr + rows[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty), mask=row_ok)
    if WRITE_LSE:
        tl.store(lse_ptr + rows // D, m_i + tl.log2(tl.maximum(l_i, 1e-30)), mask=ok)



@dataclass(frozen=True)
class PrefillPlan:
    """A prefill step's work items, heaviest first: ``items`` [N, 2] (chunk, first token of its
    query tile) and ``ends`` [C] (each chunk's key count) on the device; host copies for checks."""
    items: torch.Tensor
    block_tokens: int
    group_pad: int
    q_indptr: tuple[int, ...]
    q_start: tuple[int, ...]
    ends: torch.Tensor
    kv_end: tuple[int, ...]

    @property
    def num_chunks(self) -> int:
        return len(self.q_start)

    @property
    def num_rows(self) -> int:
        return self.q_indptr[-1]


def _host_ints(x, name: str) -> list[int]:
    if isinstance(x, torch.Tensor):
        if x.dim() != 1 or x.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a 1-D int32 tensor, got {x.dtype} {list(x.shape)}")
        return x.tolist()
    return [int(v) for v in x]


def plan_prefill(q_indptr, q_start, num_q_heads: int, num_kv_heads: int, *,
                 block_m: int | None = None, device=None, kv_end=None) -> PrefillPlan:
    """Work items for :func:`paged_prefill_attention`, reused by every layer of a step (``kv_end``
    ends chunks' keys early; ``block_m``: query rows per program)."""
    if device is None:
        device = q_indptr.device if isinstance(q_indptr, torch.Tensor) else torch.device("cpu")
    device = torch.device(device)
    indptr, start = _host_ints(q_indptr, "q_indptr"), _host_ints(q_start, "q_start")
    if len(indptr) != len(start) + 1 or indptr[0] != 0:
        raise ValueError(f"q_indptr must be [num_chunks + 1] starting at 0 and q_start "
                         f"[num_chunks], got {len(indptr)} and {len(start)} entries")
    lens = [b - a for a, b in zip(indptr, indptr[1:])]
    if any(n < 1 for n in lens) or any(s < 0 for s in start):
        raise ValueError("every chunk must have at least one query row (q_indptr increasing) "
                         f"and q_start >= 0, got q_indptr {indptr[:8]}.., q_start {start[:8]}..")
    end = [s + n for s, n in zip(start, lens)] if kv_end is None else _host_ints(kv_end, "kv_end")
    if len(end) != len(start) or any(not s < e <= s + n for s, n, e in zip(start, lens, end)):
        raise ValueError("kv_end must hold one value per chunk with q_start < kv_end <= q_start + "
                         f"rows, got {end[:8]}..")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of "
                         f"num_kv_heads={num_kv_heads}")
    G_PAD = triton.next_power_of_2(num_q_heads // num_kv_heads)
    if block_m is None:
        block_m = 128 if device.type == "cuda" else 64
    if isinstance(block_m, bool) or not isinstance(block_m, int) or block_m < 1 \
            or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of 2, got {block_m!r}")
    bt = max(block_m, 16) // G_PAD or 1
    items = sorted(((min(s + min(m0 + bt, n), e), c, m0) for c, (s, n, e) in enumerate(zip(start, lens, end))
                    for m0 in range(0, n, bt)), key=lambda w: (-w[0], w[1], w[2]))
    table = torch.tensor([(c, m0) for _, c, m0 in items], dtype=torch.int32).reshape(-1, 2)
    return PrefillPlan(table.to(device), bt, G_PAD, tuple(indptr), tuple(start),
                       torch.tensor(end, dtype=torch.int32).to(device), tuple(end))


def _check_tensors(q, arena, page_loc_layer, block_table, q_indptr, q_start, layout, sm_scale,
                   out, lse):
    check_tensors(layout, arena, q=q, page_loc_layer=page_loc_layer, block_table=block_table,
                  q_indptr=q_indptr, q_start=q_start)
    check_q_and_arena(q, arena, page_loc_layer, layout, "tokens")
    if q_start.dtype != torch.int32 or q_start.dim() != 1:
        raise TypeError(f"q_start must be torch.int32 [num_chunks], got {q_start.dtype} "
                        f"{list(q_start.shape)}")
    C = q_start.shape[0]
    if q_indptr.dtype != torch.int32 or tuple(q_indptr.shape) != (C + 1,):
        raise TypeError(f"q_indptr must be torch.int32 [num_chunks + 1 = {C + 1}], got "
                         f"{q_indptr.dtype} {list(q_indptr.shape)}")
    check_block_table(block_table, C, "num_chunks")
    check_scale_and_out(sm_scale, out, q, dtypes=(torch.bfloat16, torch.float32))
    if lse is not None and (not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32
                            or lse.shape != q.shape[:2] or lse.device != q.device
                            or not lse.is_contiguous()):
        raise ValueError(f"lse must be a contiguous fp32 tensor of shape {list(q.shape[:2])} on {q.device}")


def _check_plan(plan, q, num_chunks, num_kv_heads):
    if plan.num_chunks != num_chunks or plan.num_rows != q.shape[0]:
        raise ValueError(f"the plan is for {plan.num_chunks} chunks and {plan.num_rows} query "
                         f"rows, got {num_chunks} chunks and q of {q.shape[0]} rows")
    G_PAD = triton.next_power_of_2(q.shape[1] // num_kv_heads)
    if plan.group_pad != G_PAD:
        raise ValueError(f"the plan was made for a GQA group padded to {plan.group_pad}, q's is "
                         f"{G_PAD}: plan with num_q_heads={q.shape[1]}")


def paged_prefill_attention(q, arena, page_loc_layer, block_table, q_indptr, q_start, layout,
                            sm_scale, out=None, *, compressed: bool, plan: PrefillPlan | None = None,
                            lse: torch.Tensor | None = None, validate: bool = True,
                            block_m: int | None = None, tile_pages: int | None = None,
                            num_warps: int | None = None, num_stages: int | None = None):
    """Causal attention of C chunks' query rows (chunk c: rows q_indptr[c]:q_indptr[c+1] from position
    q_start[c]) over their pages in place; ``compressed=False``: open pages only, the same bits.
    ``lse`` receives each row's log2-sum-exp; ``validate`` checks pages (a sync)."""
    _check_tensors(q, arena, page_loc_layer, block_table, q_indptr, q_start, layout, sm_scale,
                   out, lse)
    if plan is None:
        plan = plan_prefill(q_indptr, q_start, q.shape[1], layout.num_kv_heads,
                            block_m=block_m, device=arena.device)
    elif block_m is not None and block_m != plan.block_tokens * plan.group_pad:
        raise ValueError(f"block_m={block_m} differs from the plan's "
                         f"{plan.block_tokens * plan.group_pad}: pass it to plan_prefill")
    _check_plan(plan, q, q_start.shape[0], layout.num_kv_heads)
    kernel = kernel_module(arena.device, __name__, __file__, _interpreting())._prefill_kernel
    interp = arena.device.type == "cpu"
    TP = tile_pages or (1 if interp else 4)
    if isinstance(TP, bool) or not isinstance(TP, int) or TP < 1 or TP & (TP - 1):
        raise ValueError(f"tile_pages must be a power of 2, got {tile_pages!r}")
    if validate:              # an ended chunk's last page may be full and compressed
        ends = [e if e == s + b - a else -(-e // PAGE_TOKENS) * PAGE_TOKENS
                for s, e, a, b in zip(plan.q_start, plan.kv_end, plan.q_indptr, plan.q_indptr[1:])]
        if ends and max(ends) > PAGE_TOKENS * block_table.shape[1]:
            raise ValueError(f"a chunk ends at position {max(ends) - 1}, past the "
                             f"{block_table.shape[1]} pages of block_table")
        lens = torch.tensor(ends, dtype=torch.int32, device=arena.device)
        check_ids(arena, page_loc_layer, block_table, lens, layout,
                  None if compressed else "paged_prefill_attention(compressed=False)")
    q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    H = layout.num_kv_heads
    if plan.items.shape[0] == 0:
        return out
    arena32 = arena[:arena.numel() // 4 * 4].view(torch.int32)
    kernel[(plan.items.shape[0] * H,)](
        q, arena32, page_loc_layer, block_table, q_indptr, q_start, plan.ends, plan.items, out,
        out if lse is None else lse, float(sm_scale) * LOG2E, block_table.stride(0),
        H=H, D=layout.head_dim, G=q.shape[1] // H, G_PAD=plan.group_pad, BT=plan.block_tokens,
        TP=TP, COMPRESSED=bool(compressed), INTERPRET=interp, WRITE_LSE=lse is not None,
        num_warps=num_warps or (4 if interp else 8), num_stages=num_stages or 2)
    return out


def prefill_flops(q_indptr, q_start, num_q_heads: int, head_dim: int) -> float:
    indptr, start = _host_ints(q_indptr, "q_indptr"), _host_ints(q_start, "q_start")
    keys = sum(n * s + n * (n + 1) // 2
               for s, n in zip(start, (b - a for a, b in zip(indptr, indptr[1:]))))
    return 4.0 * head_dim * num_q_heads * keys



@triton.jit(do_not_specialize=["stride_bt", "num_tokens"])
def _gather_kernel(arena32, page_loc_ptr, bt_ptr, k_ptr, v_ptr, stride_bt, num_tokens,
                   H: tl.constexpr, D: tl.constexpr, TP: tl.constexpr,
                   COMPRESSED: tl.constexpr, INTERPRET: tl.constexpr):
    """Program (tile of TP pages, head h): the tile's K and V rows restored into k, v."""
    p0 = tl.program_id(0) * TP
    h = tl.program_id(1)
    r = tl.arange(0, TP * PT)
    t = r % PT
    slot = r // PT
    p_end = (num_tokens + PT - 1) // PT
    row = h * 0                     # the one block-table row, as a tensor
    loc, kf, kh0, kh1, vf, vh0, vh1 = _load_meta(arena32, page_loc_ptr, bt_ptr, row, stride_bt, p0,
                                                 slot, p_end, h, D, COMPRESSED)
    (valid, k_p4, k_lo, k_code, k_meta, k_esc, k_packed, v_p4, v_lo, v_code, v_meta, v_esc,
     v_packed, any_esc) = _tile_load(p0, num_tokens, p_end, t, slot, h, arena32, loc, kf, kh0,
                                     kh1, vf, vh0, vh1, H, D, COMPRESSED)
    k = _restore_tile(k_p4, k_lo, k_code, k_meta, k_esc, k_packed, any_esc, COMPRESSED, INTERPRET)
    v = _restore_tile(v_p4, v_lo, v_code, v_meta, v_esc, v_packed, any_esc, COMPRESSED, INTERPRET)
    d = tl.arange(0, D)
    off = ((p0 * PT + r).to(tl.int64) * H + h)[:, None] * D + d[None, :]
    tl.store(k_ptr + off, k, mask=valid[:, None])
    tl.store(v_ptr + off, v, mask=valid[:, None])


def gather_kv(arena, page_loc_layer, pages, num_tokens: int, layout, *, compressed: bool,
              tile_pages: int = 1):
    """K, V [num_tokens, H, D] bf16 of the tokens held in ``pages``, restored in one launch
    (tables trusted, no checks)."""
    H, D = layout.num_kv_heads, layout.head_dim
    k = torch.empty(num_tokens, H, D, dtype=torch.bfloat16, device=arena.device)
    v = torch.empty_like(k)
    if num_tokens == 0:
        return k, v
    kernel = kernel_module(arena.device, __name__, __file__, _interpreting())._gather_kernel
    interp = arena.device.type == "cpu"
    TP = 1 if interp else tile_pages
    n_tiles = -(-num_tokens // (PAGE_TOKENS * TP))
    arena32 = arena[:arena.numel() // 4 * 4].view(torch.int32)
    kernel[(n_tiles, H)](arena32, page_loc_layer, pages, k, v, pages.numel(), num_tokens,
                         H=H, D=D, TP=TP, COMPRESSED=bool(compressed), INTERPRET=interp, num_warps=4)
    return k, v


__all__ = ["PrefillPlan", "plan_prefill", "paged_prefill_attention", "prefill_flops", "gather_kv"]
