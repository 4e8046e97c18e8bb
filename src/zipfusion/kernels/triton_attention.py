"""The Triton decode-attention kernel, fused with the page decoder: the CPU-checkable reference and
the GPU fallback. Compressed blocks are restored in registers into the words an open page holds,
so open and compressed pages give the same bits; its pieces also serve the prefill and FP8 kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..format import triton_restore
from ..format.layout import PAGE_TOKENS, loc_is_compressed, loc_is_open, loc_offset
from .triton_interpreter import kernel_module, same_mode
from .splits import tile_plan


def _interpreting() -> bool:
    return not isinstance(_decode_attention_kernel, triton.runtime.jit.JITFunction)


def _kernels(device: torch.device):
    """(attention kernel, merge kernel, interpreted?) for tensors on ``device``."""
    m = kernel_module(device, __name__, __file__, _interpreting())
    return m._decode_attention_kernel, m._merge_kernel, device.type == "cpu"


# The page-location tag, jitted here so that this module's interpreted copy interprets it.
_loc_is_open = triton.jit(loc_is_open)
_loc_is_compressed = triton.jit(loc_is_compressed)
_loc_offset = triton.jit(loc_offset)
PT = tl.constexpr(PAGE_TOKENS)
_restore_group = same_mode(triton_restore).restore_group


# Reductions from builtins only: an interpreted copy of this module cannot call the @jit ones.

@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


@triton.jit
def _sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _add)


@triton.jit
def _max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _larger)



@triton.jit
def _group_load(arena32, lo_off, code_off, plain_off, esc_off, packed, escaped, valid,
                COMPRESSED: tl.constexpr):
    """Loads of a tile's groups: plain words [R, NG, 4]; for compressed groups low-byte words
    [R, NG, 2], code words [R, NG] and escape records [R, NG, 2]."""
    plain_off = tl.multiple_of(plain_off, [4, 4])
    if COMPRESSED:
        pm = valid & (packed == 0)
    else:
        pm = valid
    p4 = tl.load(arena32 + plain_off[:, :, None] + tl.arange(0, 4)[None, None, :],
                 mask=pm[:, :, None], other=0)
    if COMPRESSED:
        cm = valid & packed
        lo_off = tl.multiple_of(lo_off, [2, 2])
        lo = tl.load(arena32 + lo_off[:, :, None] + tl.arange(0, 2)[None, None, :],
                     mask=cm[:, :, None], other=0)
        code = tl.load(arena32 + code_off, mask=cm, other=0)
        esc = tl.load(arena32 + esc_off[:, :, None] + tl.arange(0, 2)[None, None, :],
                      mask=(cm & escaped)[:, :, None], other=0)
    else:
        lo = p4
        code = p4
        esc = p4
    return p4, lo, code, esc


@triton.jit
def _restore_tile(p4, lo, code, meta, esc, packed, any_esc, COMPRESSED: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """The [R, D] bf16 tile of a loaded tile's groups, in channel order; ``meta`` packs b/2
    (bits 0..6) and the group's index in its block (bits 8..)."""
    R: tl.constexpr = p4.shape[0]
    NG: tl.constexpr = p4.shape[1]
    p4 = p4.to(tl.uint32, bitcast=True)
    p_even, p_odd = tl.split(tl.reshape(p4, (R, NG, 2, 2)))
    w0, w2 = tl.split(p_even)
    w1, w3 = tl.split(p_odd)
    if COMPRESSED:
        lo0, lo1 = tl.split(lo.to(tl.uint32, bitcast=True))
        e0, e1 = tl.split(esc.to(tl.uint32, bitcast=True))
        meta = meta.to(tl.uint32)
        r0, r1, r2, r3 = _restore_group(lo0, lo1, code.to(tl.uint32, bitcast=True), meta & 0x7F,
                                        e0, e1, meta >> 8, any_esc, INTERPRET)
        w0 = tl.where(packed, r0, w0)
        w1 = tl.where(packed, r1, w1)
        w2 = tl.where(packed, r2, w2)
        w3 = tl.where(packed, r3, w3)
    w = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (R, 4 * NG))
    even = w.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    odd = (w >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return tl.reshape(tl.join(even, odd), (R, 8 * NG))


@triton.jit
def _dot(a, b, acc, INTERPRET: tl.constexpr):
    """acc + a·b in fp32 (fp32 operands under the interpreter, whose bf16 dot is wrong)."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)



@triton.jit
def _role_bytes(hw0, hw1, NB: tl.constexpr):
    """Per row, packed 4 bits per block: raw blocks and escaped blocks before each block j."""
    cum = tl.full(hw0.shape, 0, hw0.dtype)
    cume = tl.full(hw0.shape, 0, hw0.dtype)
    rb = tl.full(hw0.shape, 0, hw0.dtype)
    eb = tl.full(hw0.shape, 0, hw0.dtype)
    for j in tl.static_range(NB):
        if j < 4:
            byte = (hw0 >> (8 * j)) & 0xFF
        else:
            byte = (hw1 >> (8 * (j - 4))) & 0xFF
        cum = cum | (rb << (4 * j))
        cume = cume | (eb << (4 * j))
        rb = rb + (byte == 0xFF).to(tl.int32)
        eb = eb + (((byte & 0x80) != 0) & (byte != 0xFF)).to(tl.int32)
    return cum, cume


@triton.jit
def _select_byte(hw0, hw1, j, NB: tl.constexpr):
    if NB > 4:
        return tl.where(j < 4, hw0 >> (8 * (j % 4)), hw1 >> (8 * (j % 4))) & 0xFF
    else:
        return (hw0 >> (8 * j)) & 0xFF


@triton.jit
def _load_meta(arena32, page_loc_ptr, bt_ptr, b, stride_bt, p0, slot, p_end, h,
               D: tl.constexpr, COMPRESSED: tl.constexpr):
    """Per token row of the tile at page p0: the page location and head h's K and V records."""
    REC_W: tl.constexpr = 2 if D <= 128 else 4
    page = p0 + slot
    in_range = page < p_end
    pid = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + page, mask=in_range, other=0)
    loc = tl.load(page_loc_ptr + pid.to(tl.int64), mask=in_range, other=1)
    if COMPRESSED:
        cm = in_range & _loc_is_compressed(loc)
        rec = _loc_offset(loc) // 4 + h * (2 * REC_W)
        kf = tl.load(arena32 + rec, mask=cm, other=0)
        kh0 = tl.load(arena32 + rec + 1, mask=cm, other=0)
        vf = tl.load(arena32 + rec + REC_W, mask=cm, other=0)
        vh0 = tl.load(arena32 + rec + REC_W + 1, mask=cm, other=0)
        if D > 128:
            kh1 = tl.load(arena32 + rec + 2, mask=cm, other=0)
            vh1 = tl.load(arena32 + rec + REC_W + 2, mask=cm, other=0)
        else:
            kh1 = tl.full(kh0.shape, 0, kh0.dtype)
            vh1 = tl.full(vh0.shape, 0, vh0.dtype)
    else:
        kf = tl.full(pid.shape, 0, pid.dtype)
        kh0 = kf
        kh1 = kf
        vf = kf
        vh0 = kf
        vh1 = kf
    return loc, kf, kh0, kh1, vf, vh0, vh1


@triton.jit
def _open_only(off):
    """Uncompressed kernel: every group is plain words at ``off`` (the rest: placeholders)."""
    return off, off, off, off, off < 0, off < 0, off.to(tl.uint32)


@triton.jit
def _escaped(byte):
    return ((byte & 0x80) != 0) & (byte != 0xFF)


@triton.jit
def _tile_load(p0, ctx, p_end, t, slot, h, arena32, loc, kf, kh0, kh1, vf, vh0, vh1,
               H: tl.constexpr, D: tl.constexpr, COMPRESSED: tl.constexpr):
    """Addresses and loads of one tile of TP pages, K and V of head h; ``any_esc``: whether a
    block of the tile has escapes (tiles without skip the patch)."""
    NB: tl.constexpr = D // 32
    NG: tl.constexpr = D // 8
    TPB: tl.constexpr = 512 // D
    page = p0 + slot
    valid = (page < p_end) & (page * PT + t < ctx)
    is_open = _loc_is_open(loc)
    base_w = _loc_offset(loc) // 4
    g = tl.arange(0, NG)[None, :]
    tt = t[:, None]
    kv_valid = valid[:, None] & (g >= 0)
    # K: group (t, g) lies in block g // 4
    k_open = base_w[:, None] + (tt * H + h) * (D // 2) + 4 * g
    if COMPRESSED:
        j = g // 4
        cum, cume = _role_bytes(kh0, kh1, NB)
        byte = _select_byte(kh0[:, None], kh1[:, None], j, NB)
        blk = base_w[:, None] + (kf[:, None] + 768 * j + 256 * ((cum[:, None] >> (4 * j)) & 0xF)
                                 + 16 * ((cume[:, None] >> (4 * j)) & 0xF)) // 4
        gi = g % 4
        k_lo = blk + 8 * tt + 2 * gi
        k_code = blk + 128 + 4 * tt + gi
        k_esc = blk + 192
        k_plain = tl.where(is_open[:, None], k_open, blk + 16 * tt + 4 * gi)
        k_packed = (byte != 0xFF) & (is_open[:, None] == 0)
        k_escaped = _escaped(byte) & k_packed
        k_meta = (byte & 0x7F).to(tl.uint32) | ((4 * tt + gi).to(tl.uint32) << 8)
    else:
        k_lo, k_code, k_plain, k_esc, k_packed, k_escaped, k_meta = _open_only(k_open)
    # V: row t lies in block t // TPB
    v_open = base_w[:, None] + ((PT + tt) * H + h) * (D // 2) + 4 * g
    if COMPRESSED:
        jv = t // TPB
        cumv, cumev = _role_bytes(vh0, vh1, NB)
        bytev = _select_byte(vh0, vh1, jv, NB)
        blkv = base_w + (vf + 768 * jv + 256 * ((cumv >> (4 * jv)) & 0xF)
                         + 16 * ((cumev >> (4 * jv)) & 0xF)) // 4
        tr = (t % TPB)[:, None]
        v_lo = blkv[:, None] + tr * (D // 4) + 2 * g
        v_code = blkv[:, None] + 128 + tr * (D // 8) + g
        v_esc = blkv[:, None] + 192 + 0 * g
        v_plain = tl.where(is_open[:, None], v_open, blkv[:, None] + tr * (D // 2) + 4 * g)
        v_packed = ((bytev != 0xFF) & (is_open == 0))[:, None] & (g >= 0)
        v_escaped = _escaped(bytev)[:, None] & v_packed
        v_meta = (bytev & 0x7F).to(tl.uint32)[:, None] | ((tr * (D // 8) + g).to(tl.uint32) << 8)
        any_esc = _max(_max(tl.where((k_escaped | v_escaped) & kv_valid, 1, 0), axis=1),
                       axis=0) != 0
    else:
        v_lo, v_code, v_plain, v_esc, v_packed, v_escaped, v_meta = _open_only(v_open)
        any_esc = ctx < 0          # unused; a scalar tensor like the fused kernel's
    k_p4, k_lo, k_code, k_esc = _group_load(arena32, k_lo, k_code, k_plain, k_esc, k_packed,
                                            k_escaped, kv_valid, COMPRESSED)
    v_p4, v_lo, v_code, v_esc = _group_load(arena32, v_lo, v_code, v_plain, v_esc, v_packed,
                                            v_escaped, kv_valid, COMPRESSED)
    return (valid, k_p4, k_lo, k_code, k_meta, k_esc, k_packed, v_p4, v_lo, v_code, v_meta,
            v_esc, v_packed, any_esc)



@triton.jit
def _tile_compute(mask, k_p4, k_lo, k_code, k_meta, k_esc, k_packed, v_p4, v_lo, v_code, v_meta,
                  v_esc, v_packed, any_esc, q, m_i, l_i, acc, qk_scale, COMPRESSED: tl.constexpr, INTERPRET: tl.constexpr,
                  MASKED: tl.constexpr, cap2=0.0):
    """Restore K and V of a loaded tile, then ``attend_tile``."""
    k = _restore_tile(k_p4, k_lo, k_code, k_meta, k_esc, k_packed, any_esc, COMPRESSED, INTERPRET)
    v = _restore_tile(v_p4, v_lo, v_code, v_meta, v_esc, v_packed, any_esc, COMPRESSED, INTERPRET)
    return attend_tile(mask, k, v, q, m_i, l_i, acc, qk_scale, INTERPRET, MASKED, cap2)


@triton.jit
def attend_tile(mask, k, v, q, m_i, l_i, acc, qk_scale, INTERPRET: tl.constexpr, MASKED: tl.constexpr, cap2=0.0):
    """S = q·Kᵀ and one base-2 online-softmax update over k, v [R, D]; ``cap2`` > 0:
    soft-capping (c·log2 e)."""
    qk = _dot(q, tl.trans(k), tl.full([q.shape[0], k.shape[0]], 0.0, tl.float32), INTERPRET)
    qk = qk * qk_scale
    if cap2 > 0:
        qk = cap2 * (1.0 - 2.0 / (tl.exp(2.0 * qk / cap2) + 1.0))
    if MASKED:
        qk = tl.where(mask, qk, float("-inf"))
    m_new = tl.maximum(m_i, _max(qk, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + _sum(p, axis=1)
    acc = _dot(p.to(tl.bfloat16), v, acc * alpha[:, None], INTERPRET)
    return m_new, l_i, acc


@triton.jit
def split_size(n_pages, pages_per_split, num_splits):
    """Pages per split: ``pages_per_split`` if positive, else (-T) balanced in whole tiles of T."""
    tile = tl.maximum(-pages_per_split, 1)
    even = (n_pages + num_splits - 1) // num_splits
    return tl.where(pages_per_split > 0, pages_per_split, tl.maximum(tile, (even + tile - 1) // tile * tile))


@triton.jit
def begin_split(q_ptr, ctx_ptr, b, h, s, pages_per_split, num_splits, H: tl.constexpr, D: tl.constexpr,
                G: tl.constexpr, G_PAD: tl.constexpr, TP: tl.constexpr):
    """Program (b, h, s)'s start: context, split pages [p_begin, p_end), query rows, tile row
    coordinates and an empty softmax state."""
    ctx = tl.load(ctx_ptr + b)
    n_pages = (ctx + PT - 1) // PT
    pps = split_size(n_pages, pages_per_split, num_splits)
    p_begin = s * pps
    p_end = tl.minimum(p_begin + pps, n_pages)
    gq = tl.arange(0, G_PAD)
    q_rows = (b * H * G + h * G + gq).to(tl.int64)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + q_rows[:, None] * D + d[None, :], mask=(gq < G)[:, None], other=0.0)
    r = tl.arange(0, TP * PT)
    m_i = tl.full([G_PAD], -1.0e30, tl.float32)
    l_i = tl.full([G_PAD], 0.0, tl.float32)
    acc = tl.full([G_PAD, D], 0.0, tl.float32)
    return ctx, p_begin, p_end, q, q_rows, r % PT, r // PT, m_i, l_i, acc


@triton.jit(do_not_specialize=["stride_bt", "pages_per_split", "num_splits", "window", "cap2"])
def _decode_attention_kernel(
        q_ptr, arena32, page_loc_ptr, bt_ptr, ctx_ptr, out_ptr, part_o_ptr, part_lse_ptr,
        qk_scale, stride_bt, pages_per_split, num_splits, window, cap2,
        H: tl.constexpr, D: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
        TP: tl.constexpr, COMPRESSED: tl.constexpr, INTERPRET: tl.constexpr):
    # Table width and split counts are not specialized on: one binary for every batch, so a
    # request's pages run the same instructions in any batch.
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    ctx, p_begin, p_end, q, q_rows, t, slot, m_i, l_i, acc = begin_split(
        q_ptr, ctx_ptr, b, h, s, pages_per_split, num_splits, H, D, G, G_PAD, TP)
    lo = tl.where(window > 0, ctx - window, 0)
    p_begin = tl.maximum(p_begin, tl.maximum(lo, 0) // PT)

    # Software pipeline: tile i+1's K/V loads and tile i+2's metadata are issued before tile i
    # is computed (num_stages=1).
    loc, kf, kh0, kh1, vf, vh0, vh1 = _load_meta(arena32, page_loc_ptr, bt_ptr, b, stride_bt,
                                                 p_begin, slot, p_end, h, D, COMPRESSED)
    (valid, k_p4, k_lo, k_code, k_meta, k_esc, k_packed, v_p4, v_lo, v_code, v_meta, v_esc,
     v_packed, any_esc) = _tile_load(p_begin, ctx, p_end, t, slot, h, arena32, loc, kf, kh0,
                                     kh1, vf, vh0, vh1, H, D, COMPRESSED)
    loc, kf, kh0, kh1, vf, vh0, vh1 = _load_meta(arena32, page_loc_ptr, bt_ptr, b, stride_bt,
                                                 p_begin + TP, slot, p_end, h, D, COMPRESSED)
    for p0 in range(p_begin, p_end, TP):
        nxt = _tile_load(p0 + TP, ctx, p_end, t, slot, h, arena32, loc, kf, kh0, kh1, vf, vh0,
                         vh1, H, D, COMPRESSED)
        loc, kf, kh0, kh1, vf, vh0, vh1 = _load_meta(arena32, page_loc_ptr, bt_ptr, b,
                                                     stride_bt, p0 + 2 * TP, slot, p_end, h, D,
                                                     COMPRESSED)
        keep = valid & ((p0 + slot) * PT + t >= lo)
        m_i, l_i, acc = _tile_compute(keep[None, :], k_p4, k_lo, k_code, k_meta, k_esc, k_packed,
                                      v_p4, v_lo, v_code, v_meta, v_esc, v_packed, any_esc, q,
                                      m_i, l_i, acc, qk_scale, COMPRESSED, INTERPRET, True, cap2)
        (valid, k_p4, k_lo, k_code, k_meta, k_esc, k_packed, v_p4, v_lo, v_code, v_meta, v_esc,
         v_packed, any_esc) = nxt

    store_split(acc, m_i, l_i, q_rows, s, num_splits, out_ptr, part_o_ptr, part_lse_ptr, G, D)


@triton.jit
def store_split(acc, m_i, l_i, q_rows, s, num_splits, out_ptr, part_o_ptr, part_lse_ptr,
                G: tl.constexpr, D: tl.constexpr):
    """o = acc / l into ``out`` (one split) or o and lse into the merge's partials."""
    gq = tl.arange(0, acc.shape[0])
    qmask = (gq < G)[:, None]
    d = tl.arange(0, D)
    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    if num_splits == 1:
        tl.store(out_ptr + q_rows[:, None] * D + d[None, :], o.to(tl.bfloat16), mask=qmask)
    else:
        rows = q_rows * num_splits + s
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        tl.store(part_lse_ptr + rows, lse, mask=gq < G)
        tl.store(part_o_ptr + rows[:, None] * D + d[None, :], o, mask=qmask)


@triton.jit(do_not_specialize=["pages_per_split", "num_splits"])
def _merge_kernel(part_o_ptr, part_lse_ptr, out_ptr, ctx_ptr, pages_per_split, num_splits,
                  HQ: tl.constexpr, D: tl.constexpr):
    """One (request, query head): the lse-weighted sum of the splits holding its pages. One
    split passes o_0 through, as a one-split launch does, so the result does not depend on the
    launch's split count when the split size is fixed."""
    row = tl.program_id(0).to(tl.int64)
    n_pages = (tl.load(ctx_ptr + row // HQ) + PT - 1) // PT
    pps = split_size(n_pages, pages_per_split, num_splits)
    n = tl.minimum(tl.maximum((n_pages + pps - 1) // pps, 1), num_splits)
    base = row * num_splits
    d = tl.arange(0, D)
    o0 = tl.load(part_o_ptr + base * D + d)
    lse0 = tl.load(part_lse_ptr + base)
    mx = lse0
    for s in range(1, n):
        mx = tl.maximum(mx, tl.load(part_lse_ptr + base + s))
    w = tl.exp2(lse0 - mx)
    l_sum = w
    acc = w * o0
    for s in range(1, n):
        w = tl.exp2(tl.load(part_lse_ptr + base + s) - mx)
        l_sum += w
        acc += w * tl.load(part_o_ptr + (base + s) * D + d)
    res = tl.where(n == 1, o0, acc / l_sum)
    tl.store(out_ptr + row * D + d, res.to(tl.bfloat16))



def decode_attention_triton(q, arena, page_loc_layer, block_table, context_lens, num_kv_heads,
                            qk_scale, out, *, compressed, num_splits=None, split_pages=None,
                            tile_pages=None, num_warps=None, window=None, softcap=None):
    """Launch the kernel (and the merge for several splits); ``qk_scale`` is sm_scale·log2(e).
    head_dim 256 takes 8 warps: on 4 the compressed build spills registers."""
    attn_kernel, merge_kernel, interp = _kernels(arena.device)
    B, Hq, D = q.shape
    H = num_kv_heads
    G = Hq // H
    TP, plan = tile_plan(out, B, H, block_table.shape[1], num_splits, split_pages, tile_pages, interp)
    if plan is None:
        return out
    arena32 = arena[:arena.numel() // 4 * 4].view(torch.int32)
    attn_kernel[(B, H, plan.count)](
        q, arena32, page_loc_layer, block_table, context_lens, out, plan.part_o, plan.part_lse,
        qk_scale, block_table.stride(0), plan.pages, plan.count, int(window or 0),
        float(softcap or 0.0) * 1.4426950408889634,
        H=H, D=D, G=G, G_PAD=max(16, triton.next_power_of_2(G)), TP=TP,
        COMPRESSED=compressed, INTERPRET=interp, num_warps=num_warps or (8 if D >= 256 else 4), num_stages=1)
    if plan.count > 1:
        merge_kernel[(B * Hq,)](plan.part_o, plan.part_lse, out, context_lens, plan.pages,
                                plan.count, HQ=Hq, D=D, num_warps=4)
    return out
