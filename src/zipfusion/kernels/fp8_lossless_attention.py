"""Paged decode attention over FP8 pages in the lossless block format (docs/fp8_format.md section 5):
tiles restored to E4M3 bytes in registers, then the open-FP8 kernel's arithmetic, so the output
equals ``decode_attention_fp8``'s bit for bit. Corrupt records are clamped: wrong values, no fault.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..format.fp8_blocks import BLK2, BLK3, BODY_BYTES, COL2, RAW, record_bytes
from ..format.layout import BLOCK_VALUES, PAGE_TOKENS, loc_is_compressed, loc_offset
from .triton_interpreter import kernel_module, same_mode
from . import fp8_kv, triton_attention
from .decode_attention import LOG2E
from .fp8_attention import NUM_STAGES, run_fp8_decode

_TA = same_mode(triton_attention)
_begin_split, _attend_tile, _store_split = _TA.begin_split, _TA.attend_tile, _TA.store_split
_add, _sum, _max = _TA._add, _TA._sum, _TA._max
_dequant = same_mode(fp8_kv).e4m3_dequant
_loc_offset = triton.jit(loc_offset)
_loc_is_compressed = triton.jit(loc_is_compressed)
PT = tl.constexpr(PAGE_TOKENS)
WORDS = tl.constexpr(BLOCK_VALUES // 4)              # words of 4 values per block
MAX_W = tl.constexpr(BLOCK_VALUES // 8)              # escape-stream words of a block, at most
M_RAW, M_BLK3, M_BLK2, M_COL2 = (tl.constexpr(m) for m in (RAW, BLK3, BLK2, COL2))
B_RAW, B_BLK3, B_BLK2, B_COL2 = (tl.constexpr(BODY_BYTES[m]) for m in (RAW, BLK3, BLK2, COL2))


def _interpreting() -> bool:
    return not isinstance(_fp8_lossless_kernel, triton.runtime.jit.JITFunction)


@triton.jit
def _body_bytes(mode):
    return tl.where(mode == M_RAW, B_RAW, tl.where(mode == M_BLK3, B_BLK3, tl.where(mode == M_BLK2, B_BLK2, B_COL2)))


@triton.jit
def _blocks(arena32, n_words, loc, enc, h, ROLE: tl.constexpr, NB: tl.constexpr, REC: tl.constexpr):
    """Per block of the tile ([TP·NB]): body word address (clamped into the arena), mode, β and
    escape words w, from its record (all 0 where ``enc`` is false: raw)."""
    j = tl.arange(0, loc.shape[0]) % NB
    rec = (_loc_offset(loc) + (2 * h + ROLE) * REC) // 4
    first = tl.load(arena32 + rec, mask=enc, other=0).to(tl.uint32, bitcast=True).to(tl.int64)
    jj = tl.arange(0, NB)[None, :]
    mw = tl.load(arena32 + rec[:, None] + 1 + jj // 2, mask=enc[:, None], other=0)
    metas = (mw >> (16 * (jj % 2))) & 0xFFFF
    sizes = _body_bytes((metas >> 4) & 3) + 4 * tl.minimum((metas >> 6) & 127, MAX_W)
    prefix = _sum(tl.where(jj < j[:, None], sizes, 0), 1)
    meta = _sum(tl.where(jj == j[:, None], metas, 0), 1)
    mode = (meta >> 4) & 3
    w = tl.minimum((meta >> 6) & 127, MAX_W)
    size = _body_bytes(mode) + 4 * w
    body = (_loc_offset(loc) + first + prefix) // 4
    body = tl.maximum(tl.minimum(body, n_words - size // 4), 0)
    return body, mode, meta & 15, w


@triton.jit
def _restore_words(arena32, plain, body, mode, beta, packed, valid, i):
    """The tile's block words [TP·NB, 128] restored, their escape-lane masks and lane bases."""
    x = tl.load(arena32 + plain, mask=valid, other=0).to(tl.uint32, bitcast=True)
    pk = packed[:, None] & valid
    blk3 = (mode == M_BLK3)[:, None]
    col2 = (mode == M_COL2)[:, None]
    at = body[:, None] + tl.where(col2, 4, 0)
    c = tl.load(arena32 + at + 64 + i // 4, mask=pk, other=0).to(tl.uint32, bitcast=True)
    b1 = tl.load(arena32 + body[:, None] + 96 + i // 8, mask=pk & blk3, other=0).to(tl.uint32, bitcast=True)
    bw = tl.load(arena32 + body[:, None] + (i % 8) // 2, mask=pk & col2, other=0).to(tl.uint32, bitcast=True)
    n = (x >> (4 * (i % 2))) & 0x0F0F0F0F
    d = ((c >> (2 * (i % 4))) & 0x03030303) | (((b1 >> (i % 8)) & 0x01010101) << 2)
    base = tl.where(col2, (bw >> (4 * (i % 2))) & 0x0F0F0F0F, (beta * 0x01010101).to(tl.uint32)[:, None])
    esc = d & (d >> 1) & tl.where(blk3, d >> 2, 0x01010101) & 0x01010101
    d = d ^ (esc * tl.where(blk3, 7, 3).to(tl.uint32))
    y = n + 15 * (n & 0x08080808) + 8 * (base + d)
    return tl.where(pk, y, x), tl.where(pk, esc, 0), base


@triton.jit
def _patch_escapes(arena32, x, esc, base, body, mode, w):
    """Each escaped lane's exponent from its block's stream (a word's window of 4 nibbles from
    stream words r // 8 and r // 8 + 1, never past ``w``)."""
    p = esc * 0x01010101                                           # lane l: escapes in lanes 0..l
    cnt = (p >> 24).to(tl.int32)
    r = tl.associative_scan(cnt, 1, _add) - cnt                    # escapes in the words before
    at = (body + _body_bytes(mode) // 4)[:, None] + r // 8
    lo = tl.load(arena32 + at, mask=(cnt > 0) & (r // 8 < w[:, None]), other=0)
    hi = tl.load(arena32 + at + 1, mask=(r % 8 + cnt > 8) & (r // 8 + 1 < w[:, None]), other=0)
    win = (((hi.to(tl.uint32, bitcast=True).to(tl.uint64) << 32) | lo.to(tl.uint32, bitcast=True).to(tl.uint64))
           >> (4 * (r % 8))).to(tl.uint32)
    lanes_before = p << 8                                          # lane l: escapes in lanes < l
    patch = tl.full(x.shape, 0, tl.uint32)
    for lane in tl.static_range(4):
        e = win >> (4 * ((lanes_before >> (8 * lane)) & 0xFF))
        patch = patch | (((e ^ (base >> (8 * lane))) & 15) << (8 * lane + 3))
    return x ^ (patch & (esc * 0x78))


@triton.jit
def _role_tile(arena32, n_words, loc, enc, page, ctx, h, ROLE: tl.constexpr,
               H: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, REC: tl.constexpr):
    """The E4M3 bytes [16·TP, D] (token-major) of role ROLE, head h, of a tile; rows past the
    context are 0, as the open-FP8 kernel loads them."""
    NBLK: tl.constexpr = loc.shape[0]
    TP: tl.constexpr = NBLK // NB
    j = (tl.arange(0, NBLK) % NB)[:, None]
    i = tl.arange(0, WORDS)[None, :]
    if ROLE == 0:
        t = i // 8
        ch = 32 * j + 4 * (i % 8)
    else:
        t = j * (512 // D) + i // (D // 4)
        ch = 4 * (i % (D // 4))
    valid = (page * PT)[:, None] + t < ctx
    body, mode, beta, w = _blocks(arena32, n_words, loc, enc, h, ROLE, NB, REC)
    packed = enc & (mode != M_RAW)
    open_w = (_loc_offset(loc)[:, None] + ((ROLE * PT + t) * H + h) * D + ch) // 4
    nib = tl.where(mode == M_COL2, 4, 0)[:, None] + i // 2
    plain = tl.where(enc[:, None], body[:, None] + tl.where(packed[:, None], nib, i), open_w)
    x, esc, base = _restore_words(arena32, plain, body, mode, beta, packed, valid, i)
    if _max(tl.where(packed & (w > 0), 1, 0), 0) != 0:
        x = _patch_escapes(arena32, x, esc, base, body, mode, w)
    x = tl.where(valid, x, 0)
    if ROLE == 0:             # K blocks -> token rows
        x = tl.permute(tl.reshape(x, (TP, NB, PT, 8)), (0, 2, 1, 3))
    x = tl.reshape(x, (TP * PT, D // 4))
    b0, b1, b2, b3 = x & 0xFF, (x >> 8) & 0xFF, (x >> 16) & 0xFF, x >> 24
    return tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), (TP * PT, D)).to(tl.uint8)


@triton.jit(do_not_specialize=["stride_bt", "pages_per_split", "num_splits", "n_words"])
def _fp8_lossless_kernel(q_ptr, arena32, page_loc_ptr, bt_ptr, ctx_ptr, out_ptr, part_o_ptr,
                         part_lse_ptr, qk_scale, k_scale, v_scale, stride_bt, pages_per_split, num_splits,
                         n_words, H: tl.constexpr, D: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                         TP: tl.constexpr, REC: tl.constexpr, INTERPRET: tl.constexpr):
    NB: tl.constexpr = D // 32
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    ctx, p_begin, p_end, q, q_rows, t, slot, m_i, l_i, acc = _begin_split(
        q_ptr, ctx_ptr, b, h, s, pages_per_split, num_splits, H, D, G, G_PAD, TP)
    blk_slot = tl.arange(0, TP * NB) // NB
    for p0 in range(p_begin, p_end, TP):
        valid = (p0 + slot < p_end) & ((p0 + slot) * PT + t < ctx)
        page = p0 + blk_slot
        in_range = page < p_end
        pid = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + page, mask=in_range, other=0)
        loc = tl.load(page_loc_ptr + pid.to(tl.int64), mask=in_range, other=1)
        enc = in_range & _loc_is_compressed(loc)
        page = tl.where(in_range, page, 1 << 24)
        kb = _role_tile(arena32, n_words, loc, enc, page, ctx, h, 0, H, D, NB, REC)
        vb = _role_tile(arena32, n_words, loc, enc, page, ctx, h, 1, H, D, NB, REC)
        m_i, l_i, acc = _attend_tile(valid[None, :], _dequant(kb, k_scale), _dequant(vb, v_scale), q,
                                     m_i, l_i, acc, qk_scale, INTERPRET, True)
    _store_split(acc, m_i, l_i, q_rows, s, num_splits, out_ptr, part_o_ptr, part_lse_ptr, G, D)


def decode_attention_fp8_lossless(q, arena, page_loc_layer, block_table, context_lens, layout, sm_scale,
                                  out=None, *, k_scale: float = 1.0, v_scale: float = 1.0,
                                  num_splits: int | None = None, split_pages: int | None = None,
                                  validate: bool = True, tile_pages: int | None = None,
                                  num_warps: int | None = None, num_stages: int | None = None):
    """``decode_attention_fp8``'s arguments and result, bit for bit, where ``page_loc_layer`` may
    also point (bit 0 clear) at pages from ``encode_fp8_page``."""
    def launch(grid, q, out, plan, TP, G, k_scale, v_scale, interp):
        m = kernel_module(arena.device, __name__, __file__, _interpreting())
        arena32 = arena[:arena.numel() // 4 * 4].view(torch.int32)
        m._fp8_lossless_kernel[grid](
            q, arena32, page_loc_layer, block_table, context_lens, out, plan.part_o, plan.part_lse,
            float(sm_scale) * LOG2E, k_scale, v_scale, block_table.stride(0), plan.pages, plan.count,
            arena32.numel(), H=layout.num_kv_heads, D=q.shape[2], G=G, G_PAD=max(16, triton.next_power_of_2(G)),
            TP=TP, REC=record_bytes(layout), INTERPRET=interp, num_warps=num_warps or 4,
            num_stages=num_stages or NUM_STAGES)
    return run_fp8_decode(launch, q, arena, page_loc_layer, block_table, context_lens, layout, sm_scale, out,
                          k_scale, v_scale, num_splits, split_pages, validate, tile_pages, None)
