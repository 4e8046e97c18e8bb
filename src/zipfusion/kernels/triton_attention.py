"""The Triton decode-attention kernel over the zipfusion KV arena, fused with the page decoder.

This is the CPU-checkable reference (Triton interpreter) and the GPU fallback of
``decode_attention`` (where the CUDA kernel of ``cuda_attention.py`` does not apply). Inputs are
checked, and this kernel chosen, by ``decode_attention.py``.

One query token per request. The KV cache lives in one ``uint8`` arena (docs/design.md): a page
is either *open* (``[2, 16, H, D]`` bf16) or *compressed* (docs/format.md), as its
``page_loc`` says (format/layout.py: ``loc_is_open``, ``loc_offset``). The fused kernel restores compressed blocks to BF16 in
registers -- nothing decompressed is written to global memory -- and runs flash-decoding on them.

Work split (flash decoding, ``splits.py``). Program ``(b, h, s)`` takes request ``b``, KV head
``h`` and the ``s``-th slice of that request's pages; it serves all ``G = Hq / H`` query heads
of the group at once (the GQA group is the M dimension of the tensor-core dots, padded to 16).
Per tile of ``TP`` pages (``R = 16·TP`` token rows), with ``c = sm_scale·log2(e)``::

    S   = c · q Kᵀ                        [G, R]   (bf16 operands, fp32 accumulate)
    m'  = max(m, rowmax S)
    P   = 2^(S - m')                      masked tokens -> 0
    l   = l · 2^(m - m') + rowsum P
    acc = acc · 2^(m - m') + P_bf16 · V   [G, D]

At the end a slice stores ``o = acc / l`` and ``lse = m + log2 l``; the merge kernel combines
the slices that hold pages of the request (one such slice: its ``o``, rounded as the one-split
launch rounds it). The loads are software-pipelined by hand: the K/V words of tile i+1 and the
page locations and records of tile i+2 are issued before tile i is computed.

Restoring a compressed block (docs/format.md section 2) is the format's one restore,
``format/triton_restore.restore_group``, per *group* (8 consecutive channels of one token: two
words of low bytes, one word ``w`` of 4-bit codes)::

    hi_0123 = (w & 0x87878787) + (b/2)·0x01010101
    hi_4567 = ((w << 1) & 0x80808080 | (w >> 3) & 0x07070707) + (b/2)·0x01010101

then, in blocks with escapes (format v2; the loads of their 4 records are masked to flagged
blocks, and a tile without any skips the patch), each record XORs 7 bits into one high byte;
byte interleaving (``prmt``) makes four words of bf16 pairs = channels (2k, 2k+1), exactly the
words an open page or a raw block holds at that place. Every source -- open page, raw block,
compressed block -- thus yields the same words, which are put back in channel order and split
into the same bf16 [R, D] tile. The arithmetic after that point is shared, so the output is
bit-identical whether a page is open or compressed; the *uncompressed kernel* is the same kernel
compiled with ``COMPRESSED=False`` (plain words only) and gives the same bits too.

Under the interpreter (``INTERPRET``: CPU) ``prmt`` is replaced by shifts and masks, and the
dots run on fp32-upcast operands (exact for bf16 products; the interpreter's bf16 dot is wrong).

The tile loads (``_load_meta``, ``_tile_load``), the restore and the softmax update
(``_tile_compute``) also serve the prefill kernel (``prefill_attention.py``); the arithmetic after
the restore (``attend_tile``) and a slice's store (``store_split``) serve the FP8 kernel too.
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
    """True when this module's kernels were created by the Triton interpreter (CPU)."""
    return not isinstance(_decode_attention_kernel, triton.runtime.jit.JITFunction)


def _kernels(device: torch.device):
    """(attention kernel, merge kernel, interpreted?) for tensors on ``device`` (CPU tensors in a
    compiled import: from this module's interpreted copy)."""
    m = kernel_module(device, __name__, __file__, _interpreting())
    return m._decode_attention_kernel, m._merge_kernel, device.type == "cpu"


# The page-location tag (format/layout.py), made here so that this module's interpreted copy
# makes interpreted copies.
_loc_is_open = triton.jit(loc_is_open)
_loc_is_compressed = triton.jit(loc_is_compressed)
_loc_offset = triton.jit(loc_offset)
PT = tl.constexpr(PAGE_TOKENS)                       # tokens per page, as a kernel constant
_restore_group = same_mode(triton_restore).restore_group     # the format's one restore


# ------------------------------------------------------------------------------------------
# Reductions written with builtins only: the standard-library ones are @jit functions, which a
# second, interpreted copy of this module (CPU tensors in a compiled import) cannot call.
# ------------------------------------------------------------------------------------------

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


# ------------------------------------------------------------------------------------------
# Restoring groups of 8 values
# ------------------------------------------------------------------------------------------

@triton.jit
def _group_load(arena32, lo_off, code_off, plain_off, esc_off, packed, escaped, valid,
                COMPRESSED: tl.constexpr):
    """Loads for the groups (row, g) of a tile: plain words [R, NG, 4] (open page or raw
    block), and for compressed groups low-byte words [R, NG, 2], code words [R, NG] and their
    block's escape records [R, NG, 2] (format v2; 0 for blocks without escapes)."""
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
    """The [R, D] bf16 tile of a loaded tile's groups, in channel order.

    Word k of group g holds channels 8g+2k (low half) and 8g+2k+1 (high half). Compressed
    groups go through the format's one restore (``format/triton_restore.py``: high bytes from
    the codes and b/2, escape records XORed in where ``any_esc``, bytes interleaved); ``meta``
    packs b/2 (bits 0..6) and the group's index in its block (bits 8..).
    """
    R: tl.constexpr = p4.shape[0]
    NG: tl.constexpr = p4.shape[1]
    p4 = p4.to(tl.uint32, bitcast=True)
    p_even, p_odd = tl.split(tl.reshape(p4, (R, NG, 2, 2)))       # words (0, 2) and (1, 3)
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
    # words [R, NG] x 4 -> [R, 4·NG] in channel order (word i = channels 2i, 2i+1)
    w = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (R, 4 * NG))
    even = w.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    odd = (w >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return tl.reshape(tl.join(even, odd), (R, 8 * NG))


@triton.jit
def _dot(a, b, acc, INTERPRET: tl.constexpr):
    """acc + a·b with fp32 accumulation (fp32 operands under the interpreter)."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


# ------------------------------------------------------------------------------------------
# Addresses of a tile
# ------------------------------------------------------------------------------------------

@triton.jit
def _role_bytes(hw0, hw1, NB: tl.constexpr):
    """Per row: the packed counts of raw blocks and of blocks with escapes (format v2) before
    each block j (4 bits per j each), [R] int32 twice. Block j starts at
    768·j + 256·raw_before(j) + 16·escaped_before(j) after the record's first block."""
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
    """Per token row of the tile starting at page p0: the page location and, for compressed
    pages, the K and V records of head h (block-0 offset and b/2 bytes)."""
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
    """Uncompressed kernel: every group is plain words at ``off`` (lo, code, plain, escape records, packed,
    escaped, meta as in _tile_load; the unused ones are placeholders of the right shape)."""
    return off, off, off, off, off < 0, off < 0, off.to(tl.uint32)


@triton.jit
def _escaped(byte):
    """Whether a block's metadata byte flags escapes (0x80 | b/2; not 0xFF, raw)."""
    return ((byte & 0x80) != 0) & (byte != 0xFF)


@triton.jit
def _tile_load(p0, ctx, p_end, t, slot, h, arena32, loc, kf, kh0, kh1, vf, vh0, vh1,
               H: tl.constexpr, D: tl.constexpr, COMPRESSED: tl.constexpr):
    """Addresses and loads of one tile of TP pages (R token rows), K and V of head h.

    Returns the valid rows, per role the loads and metadata of ``_restore_tile``, and
    ``any_esc``: whether a block of the tile has escapes (format v2), a scalar: tiles without
    escapes skip the patch."""
    NB: tl.constexpr = D // 32
    NG: tl.constexpr = D // 8
    TPB: tl.constexpr = 512 // D
    page = p0 + slot
    valid = (page < p_end) & (page * PT + t < ctx)
    is_open = _loc_is_open(loc)
    base_w = _loc_offset(loc) // 4                      # page start, in 32-bit words
    g = tl.arange(0, NG)[None, :]
    tt = t[:, None]
    kv_valid = valid[:, None] & (g >= 0)
    # ---- K: group (t, g) lies in block j = g // 4, group t·4 + g % 4 of that block
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
    # ---- V: token row t lies in block j = t // TPB, row t % TPB of that block
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
        any_esc = ctx < 0          # unused by the uncompressed kernel; a scalar tensor like the fused kernel's
    k_p4, k_lo, k_code, k_esc = _group_load(arena32, k_lo, k_code, k_plain, k_esc, k_packed,
                                            k_escaped, kv_valid, COMPRESSED)
    v_p4, v_lo, v_code, v_esc = _group_load(arena32, v_lo, v_code, v_plain, v_esc, v_packed,
                                            v_escaped, kv_valid, COMPRESSED)
    return (valid, k_p4, k_lo, k_code, k_meta, k_esc, k_packed, v_p4, v_lo, v_code, v_meta,
            v_esc, v_packed, any_esc)


# ------------------------------------------------------------------------------------------
# The attention kernel
# ------------------------------------------------------------------------------------------

@triton.jit
def _tile_compute(mask, k_p4, k_lo, k_code, k_meta, k_esc, k_packed, v_p4, v_lo, v_code, v_meta,
                  v_esc, v_packed, any_esc, q, m_i, l_i, acc, qk_scale, COMPRESSED: tl.constexpr, INTERPRET: tl.constexpr,
                  MASKED: tl.constexpr, cap2=0.0):
    """Restore K and V of a loaded tile, S = q·Kᵀ, one online-softmax update (base 2) of the
    running max m_i, sum l_i and accumulator acc [M, D] (M query rows). ``mask`` (broadcast to
    [M, R]) keeps the scores it is true for, where ``MASKED`` (else every score is kept)."""
    k = _restore_tile(k_p4, k_lo, k_code, k_meta, k_esc, k_packed, any_esc, COMPRESSED, INTERPRET)
    v = _restore_tile(v_p4, v_lo, v_code, v_meta, v_esc, v_packed, any_esc, COMPRESSED, INTERPRET)
    return attend_tile(mask, k, v, q, m_i, l_i, acc, qk_scale, INTERPRET, MASKED, cap2)


@triton.jit
def attend_tile(mask, k, v, q, m_i, l_i, acc, qk_scale, INTERPRET: tl.constexpr, MASKED: tl.constexpr, cap2=0.0):
    """The arithmetic after the restore, shared by every kernel that reads pages (the FP8 kernel
    of fp8_attention.py too): k, v [R, D] bf16; S = q·Kᵀ, one online-softmax update. ``cap2`` > 0
    (soft-capping c, times log2 e): S -> cap2·tanh(S / cap2), i.e. c·tanh(s / c) in base 2."""
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
    """Pages per split of a request of ``n_pages`` pages: ``pages_per_split`` if positive, else
    (-T: balanced) its pages over the ``num_splits`` splits in whole tiles of T pages
    (splits.split_size; the attention kernels and the merge agree on it)."""
    tile = tl.maximum(-pages_per_split, 1)
    even = (n_pages + num_splits - 1) // num_splits
    return tl.where(pages_per_split > 0, pages_per_split, tl.maximum(tile, (even + tile - 1) // tile * tile))


@triton.jit
def begin_split(q_ptr, ctx_ptr, b, h, s, pages_per_split, num_splits, H: tl.constexpr, D: tl.constexpr,
                G: tl.constexpr, G_PAD: tl.constexpr, TP: tl.constexpr):
    """Program (b, h, s)'s start, shared by every kernel that reads pages (the FP8 kernel too):
    request b's context and the pages [p_begin, p_end) of split s; the G query rows of KV head h
    (padded to G_PAD) and their row ids; a tile's token t and page slot of each of its TP·16
    rows; the online softmax's state (running max, sum, accumulator), empty."""
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
    # The table width, split size and split count are not specialized on: one binary serves
    # every batch, so a request's pages go through the same instructions in any batch.
    # ``window`` > 0: keys older than the last ``window`` are masked and pages wholly before
    # them skipped; ``cap2``: soft-capping (attend_tile).
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    ctx, p_begin, p_end, q, q_rows, t, slot, m_i, l_i, acc = begin_split(
        q_ptr, ctx_ptr, b, h, s, pages_per_split, num_splits, H, D, G, G_PAD, TP)
    lo = tl.where(window > 0, ctx - window, 0)
    p_begin = tl.maximum(p_begin, tl.maximum(lo, 0) // PT)

    # Software pipeline: the K/V loads of tile i+1 and the page locations and records of tile
    # i+2 are issued before tile i is computed, so memory latency overlaps the restore and the
    # dots (the loop is compiled with num_stages=1: the pipelining is written out here).
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
    """A slice's result: o = acc / l (bf16 into ``out`` when it is the only split), else o and
    lse = m + log2 l into the partials the merge kernel reads. Rows past G are padding."""
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
    """One (request, query head): out = Σ_s 2^(lse_s − M)·o_s / Σ_s 2^(lse_s − M), M = max lse_s,
    over the n splits that hold pages of the request, in split order.

    The splits past the request's last page are left out (not added as zeros), and with n = 1
    the output is o_0 rounded to bf16, exactly what a one-split launch writes: the result does
    not depend on the number of splits of the launch (the batch's other requests, the block
    table's width) when the split size is fixed; balanced splits depend on the count alone.
    """
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


# ------------------------------------------------------------------------------------------
# Host side
# ------------------------------------------------------------------------------------------

def decode_attention_triton(q, arena, page_loc_layer, block_table, context_lens, num_kv_heads,
                            qk_scale, out, *, compressed, num_splits=None, split_pages=None,
                            tile_pages=None, num_warps=None, window=None, softcap=None):
    """Launch the Triton kernel (and the merge when there are several splits). Inputs are
    checked by the caller; ``qk_scale`` is sm_scale·log2(e). ``tile_pages`` (splits.tile_plan)
    and ``num_warps`` tune the kernel; ``window``, ``softcap``: see decode_attention."""
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
        COMPRESSED=compressed, INTERPRET=interp, num_warps=num_warps or 4, num_stages=1)
    if plan.count > 1:
        merge_kernel[(B * Hq,)](plan.part_o, plan.part_lse, out, context_lens, plan.pages,
                                plan.count, HQ=Hq, D=D, num_warps=4)
    return out
