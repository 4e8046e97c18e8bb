"""Paged decode attention over the zipfusion KV arena (Triton), fused with the page decoder.

``decode_attention`` / ``decode_attention_twin`` are the entry points for every backend: on CUDA
tensors they run the CUDA C++ kernel (``cuda_attention.py``, ``cuda/decode_attention.cu``) where
it applies, and this module's Triton kernel otherwise -- which is also the CPU-checkable
reference (Triton interpreter) that the design below was first written in.

One query token per request. The KV cache lives in one ``uint8`` arena (docs/design.md): a page
is either *open* (``[2, 16, H, D]`` bf16, ``page_loc = offset | 1``) or *compressed*
(docs/format.md, ``page_loc = offset``). The fused kernel restores compressed blocks to BF16 in
registers -- nothing decompressed is written to global memory -- and runs flash-decoding on them.

Work split (flash decoding). Program ``(b, h, s)`` takes request ``b``, KV head ``h`` and the
``s``-th slice of that request's pages; it serves all ``G = Hq / H`` query heads of the group at
once (the GQA group is the M dimension of the tensor-core dots, padded to 16). Per tile of
``TP`` pages (``R = 16·TP`` token rows), with ``c = sm_scale·log2(e)``::

    S   = c · q Kᵀ                        [G, R]   (bf16 operands, fp32 accumulate)
    m'  = max(m, rowmax S)
    P   = 2^(S - m')                      masked tokens -> 0
    l   = l · 2^(m - m') + rowsum P
    acc = acc · 2^(m - m') + P_bf16 · V   [G, D]

At the end a slice stores ``o = acc / l`` and ``lse = m + log2 l``; a merge kernel combines the
slices: ``out = Σ_s 2^(lse_s - M) o_s / Σ_s 2^(lse_s - M)``, ``M = max_s lse_s``. The loads are
software-pipelined by hand: the K/V words of tile i+1 and the page locations and records of
tile i+2 are issued before tile i is computed.

Restoring a compressed block (docs/format.md section 2). Work is per *group*: 8 consecutive
channels of one token, i.e. two 32-bit words of low bytes ``lo_0123, lo_4567`` and one word
``w`` of 4-bit codes. Four high bytes at a time::

    hi_0123 = (w & 0x87878787) + (b/2)·0x01010101
    hi_4567 = ((w << 1) & 0x80808080 | (w >> 3) & 0x07070707) + (b/2)·0x01010101

and byte interleaving (``prmt`` selectors 0x5140 and 0x7362) makes four words of bf16 pairs
``(lo_2k, hi_2k, lo_2k+1, hi_2k+1)`` = channels (2k, 2k+1), exactly the words an open page or
a raw block holds at that place. Every source -- open page, raw block, compressed block --
thus yields the same words, which are put back in channel order and split into the same bf16
tile (``CHSETS`` = 1: one [R, D] tile; 2: even/odd channel tiles [R, D/2]; 8: channel sets
[R, D/8]). The arithmetic after that point is shared, so the output is bit-identical whether
a page is open or compressed; the uncompressed *twin* (``decode_attention_twin``) is the same
kernel compiled with ``COMPRESSED=False`` (plain words only) and gives the same bits too.

Under ``TRITON_INTERPRET=1`` (CPU) ``prmt`` is replaced by shifts and masks, and the dots run on
fp32-upcast operands (exact for bf16 products; the interpreter's bf16 dot is wrong).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ..triton_interpreter import interpreted_copy
from ..format.layout import PAGE_TOKENS, PageLayout
from . import cuda_attention

LOG2E = 1.4426950408889634
MODE_TWIN = 0     # open pages only (COMPRESSED=False)
MODE_FUSED = 1    # open or compressed pages (COMPRESSED=True)


def _interpreting() -> bool:
    """True when this module's kernels were created by the Triton interpreter (CPU)."""
    return not isinstance(_decode_attention_kernel, triton.runtime.jit.JITFunction)


LAST_COMPILED = {}     # mode -> the last launched compiled kernel (registers, spills)


def _kernels(device: torch.device):
    """(attention kernel, merge kernel, interpreted?) for tensors on ``device``.

    Whether ``triton.jit`` interprets is fixed when this module is imported (TRITON_INTERPRET);
    for CPU tensors in a compiled import, a second copy of the module is loaded in interpreter
    mode.
    """
    interp = _interpreting()
    if device.type == "cuda":
        if interp:
            raise RuntimeError("zipfusion.kernels was imported with TRITON_INTERPRET=1 and cannot "
                               "run on CUDA tensors; unset TRITON_INTERPRET before importing it")
        return _decode_attention_kernel, _merge_kernel, False
    if device.type != "cpu":
        raise ValueError(f"the attention kernels run on CUDA (or on the CPU through the Triton "
                         f"interpreter), got tensors on {device}")
    if interp:
        return _decode_attention_kernel, _merge_kernel, True
    m = interpreted_copy(__name__, __file__)
    return m._decode_attention_kernel, m._merge_kernel, True


# ------------------------------------------------------------------------------------------
# Reductions and fills written with builtins only: the standard-library ones are @jit
# functions, which a second, interpreted copy of this module (CPU tensors in a compiled
# import, see _kernels) cannot call.
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
def _interleave(lo0, lo1, h0, h1, USE_ASM: tl.constexpr):
    """Words of bf16 pairs w_k = bytes (lo_2k, hi_2k, lo_2k+1, hi_2k+1), k = 0..3, of a group.

    lo0/lo1: low bytes of values 0..3 / 4..7; h0/h1: their high bytes (uint32 tiles).
    """
    if USE_ASM:
        w0, w1, w2, w3 = tl.inline_asm_elementwise(
            "prmt.b32 $0, $4, $6, 0x5140; prmt.b32 $1, $4, $6, 0x7362; "
            "prmt.b32 $2, $5, $7, 0x5140; prmt.b32 $3, $5, $7, 0x7362;",
            "=r,=r,=r,=r,r,r,r,r", [lo0, lo1, h0, h1],
            dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True, pack=1)
    else:
        w0 = (lo0 & 0xFF) | ((h0 & 0xFF) << 8) | ((lo0 & 0xFF00) << 8) | ((h0 & 0xFF00) << 16)
        w1 = ((lo0 >> 16) & 0xFF) | ((h0 >> 8) & 0xFF00) | ((lo0 >> 8) & 0xFF0000) \
            | (h0 & 0xFF000000)
        w2 = (lo1 & 0xFF) | ((h1 & 0xFF) << 8) | ((lo1 & 0xFF00) << 8) | ((h1 & 0xFF00) << 16)
        w3 = ((lo1 >> 16) & 0xFF) | ((h1 >> 8) & 0xFF00) | ((lo1 >> 8) & 0xFF0000) \
            | (h1 & 0xFF000000)
    return w0, w1, w2, w3


@triton.jit
def _group_load(arena32, lo_off, code_off, plain_off, packed, valid, COMPRESSED: tl.constexpr):
    """Loads for the groups (row, g) of a tile: plain words [R, NG, 4] (open page or raw
    block), and for compressed groups low-byte words [R, NG, 2] and code words [R, NG]."""
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
    else:
        lo = p4
        code = p4
    return p4, lo, code


@triton.jit
def _group_restore(p4, lo, code, hb, packed, COMPRESSED: tl.constexpr, USE_ASM: tl.constexpr):
    """The four words of bf16 pairs of every group (row, g): [R, NG] tiles w0..w3.

    Word k of group g holds channels 8g+2k (low half) and 8g+2k+1 (high half). Compressed
    groups (docs/format.md section 2)::

        h0 = (code & 0x87878787) + hb                                 high bytes, values 0..3
        h1 = ((code << 1) & 0x80808080 | (code >> 3) & 0x07070707) + hb        values 4..7
        w_k = interleave(lo, h)                                       (prmt on the GPU)
    """
    R: tl.constexpr = p4.shape[0]
    NG: tl.constexpr = p4.shape[1]
    p4 = p4.to(tl.uint32, bitcast=True)
    p_even, p_odd = tl.split(tl.reshape(p4, (R, NG, 2, 2)))       # words (0, 2) and (1, 3)
    p0, p2 = tl.split(p_even)
    p1, p3 = tl.split(p_odd)
    if COMPRESSED:
        lo0, lo1 = tl.split(lo.to(tl.uint32, bitcast=True))
        code = code.to(tl.uint32, bitcast=True)
        h0 = (code & 0x87878787) + hb
        h1 = (((code << 1) & 0x80808080) | ((code >> 3) & 0x07070707)) + hb
        r0, r1, r2, r3 = _interleave(lo0, lo1, h0, h1, USE_ASM)
        p0 = tl.where(packed, r0, p0)
        p1 = tl.where(packed, r1, p1)
        p2 = tl.where(packed, r2, p2)
        p3 = tl.where(packed, r3, p3)
    return p0, p1, p2, p3


@triton.jit
def _natural_words(w0, w1, w2, w3):
    """Group words [R, NG] x 4 -> [R, 4·NG] in channel order (word i = channels 2i, 2i+1)."""
    R: tl.constexpr = w0.shape[0]
    NG: tl.constexpr = w0.shape[1]
    return tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (R, 4 * NG))


@triton.jit
def _halves(w):
    """uint32 tile of bf16 pairs -> (low-half bf16 tile, high-half bf16 tile)."""
    lo = w.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    hi = (w >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return lo, hi


@triton.jit
def _dot(a, b, acc, FP32_DOT: tl.constexpr):
    """acc + a·b with fp32 accumulation (fp32 operands under the interpreter)."""
    if FP32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _role_bytes(hw0, hw1, NB: tl.constexpr):
    """Per row: the packed count of raw blocks before each block j (4 bits per j), [R] int32."""
    cum = tl.full(hw0.shape, 0, hw0.dtype)
    rb = tl.full(hw0.shape, 0, hw0.dtype)
    for j in tl.static_range(NB):
        if j < 4:
            byte = (hw0 >> (8 * j)) & 0xFF
        else:
            byte = (hw1 >> (8 * (j - 4))) & 0xFF
        cum = cum | (rb << (4 * j))
        rb = rb + (byte == 0xFF).to(tl.int32)
    return cum


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
        cm = in_range & ((loc & 1) == 0)
        rec = (loc - (loc & 1)) // 4 + h * (2 * REC_W)
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
def _tile_load(p0, ctx, p_end, t, slot, h, arena32, loc, kf, kh0, kh1, vf, vh0, vh1,
               H: tl.constexpr, D: tl.constexpr, COMPRESSED: tl.constexpr):
    """Addresses and loads of one tile of TP pages (R token rows), K and V of head h."""
    NB: tl.constexpr = D // 32
    NG: tl.constexpr = D // 8
    TPB: tl.constexpr = 512 // D
    page = p0 + slot
    valid = (page < p_end) & (page * 16 + t < ctx)
    is_open = (loc & 1) != 0
    base_w = (loc - (loc & 1)) // 4                      # page start, in 32-bit words
    g = tl.arange(0, NG)[None, :]
    tt = t[:, None]
    # ---- K: group (t, g) lies in block j = g // 4, group t·4 + g % 4 of that block
    k_open = base_w[:, None] + (tt * H + h) * (D // 2) + 4 * g
    if COMPRESSED:
        j = g // 4
        cum = _role_bytes(kh0, kh1, NB)
        byte = _select_byte(kh0[:, None], kh1[:, None], j, NB)
        blk = base_w[:, None] + (kf[:, None] + 768 * j + 256 * ((cum[:, None] >> (4 * j)) & 0xF)) // 4
        gi = g % 4
        k_lo = blk + 8 * tt + 2 * gi
        k_code = blk + 128 + 4 * tt + gi
        k_plain = tl.where(is_open[:, None], k_open, blk + 16 * tt + 4 * gi)
        k_packed = (byte != 0xFF) & (is_open[:, None] == 0)
        k_hb = byte.to(tl.uint32) * 0x01010101
    else:
        k_lo = k_open
        k_code = k_open
        k_plain = k_open
        k_packed = k_open < 0
        k_hb = k_open.to(tl.uint32)
    kv_valid = valid[:, None] & (g >= 0)
    # ---- V: token row t lies in block j = t // TPB, row t % TPB of that block
    v_open = base_w[:, None] + ((16 + tt) * H + h) * (D // 2) + 4 * g
    if COMPRESSED:
        jv = t // TPB
        cumv = _role_bytes(vh0, vh1, NB)
        bytev = _select_byte(vh0, vh1, jv, NB)
        blkv = base_w + (vf + 768 * jv + 256 * ((cumv >> (4 * jv)) & 0xF)) // 4
        tr = (t % TPB)[:, None]
        v_lo = blkv[:, None] + tr * (D // 4) + 2 * g
        v_code = blkv[:, None] + 128 + tr * (D // 8) + g
        v_plain = tl.where(is_open[:, None], v_open, blkv[:, None] + tr * (D // 2) + 4 * g)
        v_packed = ((bytev != 0xFF) & (is_open == 0))[:, None] & (g >= 0)
        v_hb = (bytev.to(tl.uint32) * 0x01010101)[:, None] + tl.full(g.shape, 0, tl.uint32)
    else:
        v_lo = v_open
        v_code = v_open
        v_plain = v_open
        v_packed = v_open < 0
        v_hb = v_open.to(tl.uint32)
    k_p4, k_lo, k_code = _group_load(arena32, k_lo, k_code, k_plain, k_packed, kv_valid,
                                     COMPRESSED)
    v_p4, v_lo, v_code = _group_load(arena32, v_lo, v_code, v_plain, v_packed, kv_valid,
                                     COMPRESSED)
    return valid, k_p4, k_lo, k_code, k_hb, k_packed, v_p4, v_lo, v_code, v_hb, v_packed


@triton.jit
def _tile_compute(valid, k_p4, k_lo, k_code, k_hb, k_packed, v_p4, v_lo, v_code, v_hb, v_packed,
                  t, qE0, qE1, qE2, qE3, qO0, qO1, qO2, qO3,
                  m_i, l_i, aE0, aE1, aE2, aE3, aO0, aO1, aO2, aO3, qk_scale,
                  COMPRESSED: tl.constexpr, USE_ASM: tl.constexpr, FP32_DOT: tl.constexpr,
                  CHSETS: tl.constexpr):
    """Restore K and V of a loaded tile, S = q·Kᵀ, one online-softmax update of the
    accumulators. CHSETS = 8: eight [R, D/8] tiles (channels 8g + c); 2: even / odd channels
    [R, D/2]; 1: one [R, D] tile in channel order."""
    w0, w1, w2, w3 = _group_restore(k_p4, k_lo, k_code, k_hb, k_packed, COMPRESSED, USE_ASM)
    qk = tl.full([qE0.shape[0], t.shape[0]], 0.0, tl.float32)
    if CHSETS == 8:
        # 8 tiles [R, D/8]: channels 8g + c
        kE0, kO0 = _halves(w0)
        kE1, kO1 = _halves(w1)
        kE2, kO2 = _halves(w2)
        kE3, kO3 = _halves(w3)
        qk = _dot(qE0, tl.trans(kE0), qk, FP32_DOT)
        qk = _dot(qO0, tl.trans(kO0), qk, FP32_DOT)
        qk = _dot(qE1, tl.trans(kE1), qk, FP32_DOT)
        qk = _dot(qO1, tl.trans(kO1), qk, FP32_DOT)
        qk = _dot(qE2, tl.trans(kE2), qk, FP32_DOT)
        qk = _dot(qO2, tl.trans(kO2), qk, FP32_DOT)
        qk = _dot(qE3, tl.trans(kE3), qk, FP32_DOT)
        qk = _dot(qO3, tl.trans(kO3), qk, FP32_DOT)
    else:
        kw = _natural_words(w0, w1, w2, w3)                 # [R, D/2]: channels 2i, 2i+1
        kE, kO = _halves(kw)
        if CHSETS == 2:
            # even and odd channels: 2 tiles [R, D/2]
            qk = _dot(qE0, tl.trans(kE), qk, FP32_DOT)
            qk = _dot(qO0, tl.trans(kO), qk, FP32_DOT)
        else:
            # one tile [R, D] in channel order
            k = tl.reshape(tl.join(kE, kO), (kE.shape[0], 2 * kE.shape[1]))
            qk = _dot(qE0, tl.trans(k), qk, FP32_DOT)
    u0, u1, u2, u3 = _group_restore(v_p4, v_lo, v_code, v_hb, v_packed, COMPRESSED, USE_ASM)
    # online softmax in base 2
    qk = tl.where(valid[None, :], qk * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, _max(qk, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + _sum(p, axis=1)
    pb = p.to(tl.bfloat16)
    al = alpha[:, None]
    if CHSETS == 8:
        vE0, vO0 = _halves(u0)
        vE1, vO1 = _halves(u1)
        vE2, vO2 = _halves(u2)
        vE3, vO3 = _halves(u3)
        aE0 = _dot(pb, vE0, aE0 * al, FP32_DOT)
        aO0 = _dot(pb, vO0, aO0 * al, FP32_DOT)
        aE1 = _dot(pb, vE1, aE1 * al, FP32_DOT)
        aO1 = _dot(pb, vO1, aO1 * al, FP32_DOT)
        aE2 = _dot(pb, vE2, aE2 * al, FP32_DOT)
        aO2 = _dot(pb, vO2, aO2 * al, FP32_DOT)
        aE3 = _dot(pb, vE3, aE3 * al, FP32_DOT)
        aO3 = _dot(pb, vO3, aO3 * al, FP32_DOT)
    else:
        vw = _natural_words(u0, u1, u2, u3)
        vE, vO = _halves(vw)
        if CHSETS == 2:
            aE0 = _dot(pb, vE, aE0 * al, FP32_DOT)
            aO0 = _dot(pb, vO, aO0 * al, FP32_DOT)
        else:
            v = tl.reshape(tl.join(vE, vO), (vE.shape[0], 2 * vE.shape[1]))
            aE0 = _dot(pb, v, aE0 * al, FP32_DOT)
    return m_new, l_i, aE0, aE1, aE2, aE3, aO0, aO1, aO2, aO3




@triton.jit
def _tile(p0, ctx, p_end, t, slot, h, arena32, qE0, qE1, qE2, qE3, qO0, qO1, qO2, qO3,
          m_i, l_i, aE0, aE1, aE2, aE3, aO0, aO1, aO2, aO3,
          loc, kf, kh0, kh1, vf, vh0, vh1, qk_scale,
          H: tl.constexpr, D: tl.constexpr, COMPRESSED: tl.constexpr, USE_ASM: tl.constexpr,
          FP32_DOT: tl.constexpr, CHSETS: tl.constexpr):
    """Load and compute one tile (no data prefetch)."""
    valid, k_p4, k_lo, k_code, k_hb, k_packed, v_p4, v_lo, v_code, v_hb, v_packed = _tile_load(
        p0, ctx, p_end, t, slot, h, arena32, loc, kf, kh0, kh1, vf, vh0, vh1, H, D, COMPRESSED)
    return _tile_compute(valid, k_p4, k_lo, k_code, k_hb, k_packed, v_p4, v_lo, v_code, v_hb,
                         v_packed, t, qE0, qE1, qE2, qE3, qO0, qO1, qO2, qO3,
                         m_i, l_i, aE0, aE1, aE2, aE3, aO0, aO1, aO2, aO3, qk_scale,
                         COMPRESSED, USE_ASM, FP32_DOT, CHSETS)


# ------------------------------------------------------------------------------------------
# The attention kernel
# ------------------------------------------------------------------------------------------

@triton.jit
def _store_out(ptr, rows, a, l_i, STRIDE: tl.constexpr, OFF: tl.constexpr, D: tl.constexpr,
               mask, TO_BF16: tl.constexpr):
    """Output channels STRIDE·i + OFF from the accumulator a [G_PAD, D / STRIDE], normalized."""
    o = a / tl.maximum(l_i, 1e-30)[:, None]
    if TO_BF16:
        o = o.to(tl.bfloat16)
    i = tl.arange(0, D // STRIDE)
    tl.store(ptr + rows[:, None] * D + STRIDE * i[None, :] + OFF, o, mask=mask)


@triton.jit
def _load_q(q_ptr, rows, STRIDE: tl.constexpr, OFF: tl.constexpr, D: tl.constexpr, mask):
    i = tl.arange(0, D // STRIDE)
    return tl.load(q_ptr + rows[:, None] * D + STRIDE * i[None, :] + OFF, mask=mask, other=0.0)


@triton.jit
def _decode_attention_kernel(
        q_ptr, arena32, page_loc_ptr, bt_ptr, ctx_ptr, out_ptr, part_o_ptr, part_lse_ptr,
        qk_scale, stride_bt, pages_per_split, num_splits,
        H: tl.constexpr, D: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
        TP: tl.constexpr, SINGLE: tl.constexpr, COMPRESSED: tl.constexpr,
        USE_ASM: tl.constexpr, FP32_DOT: tl.constexpr, CHSETS: tl.constexpr,
        PREFETCH: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    R: tl.constexpr = TP * 16
    NG: tl.constexpr = D // 8

    ctx = tl.load(ctx_ptr + b)
    n_pages = (ctx + 15) // 16
    p_begin = s * pages_per_split
    p_end = tl.minimum(p_begin + pages_per_split, n_pages)

    gq = tl.arange(0, G_PAD)
    g = tl.arange(0, NG)
    q_rows = (b * H * G + h * G + gq).to(tl.int64)
    qmask = (gq < G)[:, None]
    W: tl.constexpr = D // CHSETS           # accumulator width per channel set
    if CHSETS == 8:
        qE0 = _load_q(q_ptr, q_rows, 8, 0, D, qmask)
        qO0 = _load_q(q_ptr, q_rows, 8, 1, D, qmask)
        qE1 = _load_q(q_ptr, q_rows, 8, 2, D, qmask)
        qO1 = _load_q(q_ptr, q_rows, 8, 3, D, qmask)
        qE2 = _load_q(q_ptr, q_rows, 8, 4, D, qmask)
        qO2 = _load_q(q_ptr, q_rows, 8, 5, D, qmask)
        qE3 = _load_q(q_ptr, q_rows, 8, 6, D, qmask)
        qO3 = _load_q(q_ptr, q_rows, 8, 7, D, qmask)
    else:
        if CHSETS == 2:
            qE0 = _load_q(q_ptr, q_rows, 2, 0, D, qmask)
            qO0 = _load_q(q_ptr, q_rows, 2, 1, D, qmask)
        else:
            qE0 = _load_q(q_ptr, q_rows, 1, 0, D, qmask)
            qO0 = qE0
        qE1 = qE0
        qE2 = qE0
        qE3 = qE0
        qO1 = qE0
        qO2 = qE0
        qO3 = qE0

    r = tl.arange(0, R)
    t = r % 16                      # token inside its page
    slot = r // 16                  # page inside the tile
    m_i = tl.full([G_PAD], -1.0e30, tl.float32)
    l_i = tl.full([G_PAD], 0.0, tl.float32)
    aE0 = tl.full([G_PAD, W], 0.0, tl.float32)
    aE1 = aE0
    aE2 = aE0
    aE3 = aE0
    aO0 = aE0
    aO1 = aE0
    aO2 = aE0
    aO3 = aE0

    # the page locations and records of the next tile are loaded one tile ahead
    loc, kf, kh0, kh1, vf, vh0, vh1 = _load_meta(arena32, page_loc_ptr, bt_ptr, b, stride_bt,
                                                 p_begin, slot, p_end, h, D, COMPRESSED)
    if PREFETCH:
        # software pipeline: the K/V loads of tile i+1 and the records of tile i+2 are issued
        # before tile i is computed, so memory latency overlaps the restore and the dots
        d_valid, dk_p4, dk_lo, dk_code, dk_hb, dk_packed, dv_p4, dv_lo, dv_code, dv_hb, \
            dv_packed = _tile_load(p_begin, ctx, p_end, t, slot, h, arena32, loc, kf, kh0, kh1,
                                   vf, vh0, vh1, H, D, COMPRESSED)
        loc, kf, kh0, kh1, vf, vh0, vh1 = _load_meta(arena32, page_loc_ptr, bt_ptr, b,
                                                     stride_bt, p_begin + TP, slot, p_end, h, D,
                                                     COMPRESSED)
        if FP32_DOT:
            p0 = p_begin
            while p0 < p_end:
                d_next = _tile_load(p0 + TP, ctx, p_end, t, slot, h, arena32, loc, kf, kh0, kh1, vf,
                                    vh0, vh1, H, D, COMPRESSED)
                loc, kf, kh0, kh1, vf, vh0, vh1 = _load_meta(arena32, page_loc_ptr, bt_ptr, b, stride_bt,
                                                             p0 + 2 * TP, slot, p_end, h, D, COMPRESSED)
                m_i, l_i, aE0, aE1, aE2, aE3, aO0, aO1, aO2, aO3 = _tile_compute(
                    d_valid, dk_p4, dk_lo, dk_code, dk_hb, dk_packed, dv_p4, dv_lo, dv_code, dv_hb,
                    dv_packed, t, qE0, qE1, qE2, qE3, qO0, qO1, qO2, qO3,
                    m_i, l_i, aE0, aE1, aE2, aE3, aO0, aO1, aO2, aO3, qk_scale,
                    COMPRESSED, USE_ASM, FP32_DOT, CHSETS)
                d_valid, dk_p4, dk_lo, dk_code, dk_hb, dk_packed, dv_p4, dv_lo, dv_code, dv_hb, \
                    dv_packed = d_next
                p0 += TP
        else:
            for p0 in range(p_begin, p_end, TP):
                d_next = _tile_load(p0 + TP, ctx, p_end, t, slot, h, arena32, loc, kf, kh0, kh1, vf,
                                    vh0, vh1, H, D, COMPRESSED)
                loc, kf, kh0, kh1, vf, vh0, vh1 = _load_meta(arena32, page_loc_ptr, bt_ptr, b, stride_bt,
                                                             p0 + 2 * TP, slot, p_end, h, D, COMPRESSED)
                m_i, l_i, aE0, aE1, aE2, aE3, aO0, aO1, aO2, aO3 = _tile_compute(
                    d_valid, dk_p4, dk_lo, dk_code, dk_hb, dk_packed, dv_p4, dv_lo, dv_code, dv_hb,
                    dv_packed, t, qE0, qE1, qE2, qE3, qO0, qO1, qO2, qO3,
                    m_i, l_i, aE0, aE1, aE2, aE3, aO0, aO1, aO2, aO3, qk_scale,
                    COMPRESSED, USE_ASM, FP32_DOT, CHSETS)
                d_valid, dk_p4, dk_lo, dk_code, dk_hb, dk_packed, dv_p4, dv_lo, dv_code, dv_hb, \
                    dv_packed = d_next
    else:
        if FP32_DOT:
            # interpreter: its scalars are 1-element arrays, which range() does not take
            p0 = p_begin
            while p0 < p_end:
                nloc, nkf, nkh0, nkh1, nvf, nvh0, nvh1 = _load_meta(
                    arena32, page_loc_ptr, bt_ptr, b, stride_bt, p0 + TP, slot, p_end, h, D,
                    COMPRESSED)
                m_i, l_i, aE0, aE1, aE2, aE3, aO0, aO1, aO2, aO3 = _tile(
                    p0, ctx, p_end, t, slot, h, arena32, qE0, qE1, qE2, qE3, qO0, qO1, qO2, qO3,
                    m_i, l_i, aE0, aE1, aE2, aE3, aO0, aO1, aO2, aO3,
                    loc, kf, kh0, kh1, vf, vh0, vh1, qk_scale, H, D, COMPRESSED, USE_ASM, FP32_DOT,
                    CHSETS)
                loc, kf, kh0, kh1, vf, vh0, vh1 = nloc, nkf, nkh0, nkh1, nvf, nvh0, nvh1
                p0 += TP
        else:
            for p0 in range(p_begin, p_end, TP):
                nloc, nkf, nkh0, nkh1, nvf, nvh0, nvh1 = _load_meta(
                    arena32, page_loc_ptr, bt_ptr, b, stride_bt, p0 + TP, slot, p_end, h, D,
                    COMPRESSED)
                m_i, l_i, aE0, aE1, aE2, aE3, aO0, aO1, aO2, aO3 = _tile(
                    p0, ctx, p_end, t, slot, h, arena32, qE0, qE1, qE2, qE3, qO0, qO1, qO2, qO3,
                    m_i, l_i, aE0, aE1, aE2, aE3, aO0, aO1, aO2, aO3,
                    loc, kf, kh0, kh1, vf, vh0, vh1, qk_scale, H, D, COMPRESSED, USE_ASM, FP32_DOT,
                    CHSETS)
                loc, kf, kh0, kh1, vf, vh0, vh1 = nloc, nkf, nkh0, nkh1, nvf, nvh0, nvh1

    if SINGLE:
        dst = out_ptr
        rows = q_rows
    else:
        dst = part_o_ptr
        rows = q_rows * num_splits + s
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        tl.store(part_lse_ptr + rows, lse, mask=gq < G)
    if CHSETS == 8:
        _store_out(dst, rows, aE0, l_i, 8, 0, D, qmask, SINGLE)
        _store_out(dst, rows, aO0, l_i, 8, 1, D, qmask, SINGLE)
        _store_out(dst, rows, aE1, l_i, 8, 2, D, qmask, SINGLE)
        _store_out(dst, rows, aO1, l_i, 8, 3, D, qmask, SINGLE)
        _store_out(dst, rows, aE2, l_i, 8, 4, D, qmask, SINGLE)
        _store_out(dst, rows, aO2, l_i, 8, 5, D, qmask, SINGLE)
        _store_out(dst, rows, aE3, l_i, 8, 6, D, qmask, SINGLE)
        _store_out(dst, rows, aO3, l_i, 8, 7, D, qmask, SINGLE)
    elif CHSETS == 2:
        _store_out(dst, rows, aE0, l_i, 2, 0, D, qmask, SINGLE)
        _store_out(dst, rows, aO0, l_i, 2, 1, D, qmask, SINGLE)
    else:
        _store_out(dst, rows, aE0, l_i, 1, 0, D, qmask, SINGLE)


@triton.jit
def _merge_kernel(part_o_ptr, part_lse_ptr, out_ptr,
                  NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, D: tl.constexpr):
    """out = Σ_s 2^(lse_s − M)·o_s / Σ_s 2^(lse_s − M) for one (request, query head)."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D)
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + s, mask=s < NUM_SPLITS, other=float("-inf"))
    mx = _max(lse, axis=0)
    w = tl.exp2(lse - mx)
    o = tl.load(part_o_ptr + (row * NUM_SPLITS + s)[:, None] * D + d[None, :],
                mask=(s < NUM_SPLITS)[:, None], other=0.0)
    res = _sum(w[:, None] * o, axis=0) / _sum(w, axis=0)
    tl.store(out_ptr + row * D + d, res.to(tl.bfloat16))


# ------------------------------------------------------------------------------------------
# Host side
# ------------------------------------------------------------------------------------------

def _check_inputs(q, arena, page_loc_layer, block_table, context_lens, layout, sm_scale, out):
    if not isinstance(layout, PageLayout):
        raise TypeError(f"layout must be a zipfusion.format.PageLayout, got {type(layout).__name__}")
    for name, x in (("q", q), ("arena", arena), ("page_loc_layer", page_loc_layer),
                    ("block_table", block_table), ("context_lens", context_lens)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.device != arena.device:
            raise ValueError(f"{name} is on {x.device} but the arena is on {arena.device}; "
                             "move every input to the arena's device")
    H, D = layout.num_kv_heads, layout.head_dim
    if q.dtype != torch.bfloat16:
        raise TypeError(f"q must be torch.bfloat16, got {q.dtype}")
    if q.dim() != 3 or q.shape[2] != D or q.shape[1] % H != 0:
        raise ValueError(f"q must be [batch, num_q_heads, {D}] with num_q_heads a multiple of "
                         f"num_kv_heads={H}, got {list(q.shape)}")
    if arena.dtype != torch.uint8 or arena.dim() != 1 or not arena.is_contiguous():
        raise TypeError(f"arena must be a contiguous 1-D torch.uint8 tensor, got {arena.dtype} "
                        f"{list(arena.shape)}")
    if page_loc_layer.dtype != torch.int64 or page_loc_layer.dim() != 1:
        raise TypeError("page_loc_layer must be a 1-D torch.int64 tensor (page_loc[layer]), got "
                        f"{page_loc_layer.dtype} {list(page_loc_layer.shape)}")
    if not page_loc_layer.is_contiguous():
        raise ValueError("page_loc_layer must be contiguous")
    B = q.shape[0]
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != B:
        raise TypeError(f"block_table must be torch.int32 [batch={B}, max_pages_per_request], "
                        f"got {block_table.dtype} {list(block_table.shape)}")
    if block_table.stride(1) != 1:
        raise ValueError("block_table rows must be contiguous; call .contiguous() first")
    if context_lens.dtype != torch.int32 or tuple(context_lens.shape) != (B,):
        raise TypeError(f"context_lens must be torch.int32 [batch={B}], got "
                        f"{context_lens.dtype} {list(context_lens.shape)}")
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (float, int)) \
            or not math.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale must be a positive finite float, got {sm_scale!r}")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16 \
                or out.shape != q.shape or out.device != q.device or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous bf16 tensor of shape {list(q.shape)} on "
                             f"{q.device}")


def _check_ids(arena, page_loc_layer, block_table, context_lens, layout, twin: bool):
    """Checks that need the values (one device sync): context lengths, page ids, locations."""
    if context_lens.numel() == 0:
        return
    max_pages = block_table.shape[1]
    lens = context_lens.to(torch.int64)
    if int(lens.min()) < 1 or int(lens.max()) > PAGE_TOKENS * max_pages:
        raise ValueError(f"context_lens must be in 1..{PAGE_TOKENS * max_pages} (16 x the "
                         f"block_table width), got min {int(lens.min())} max {int(lens.max())}")
    n_pages = (lens + PAGE_TOKENS - 1) // PAGE_TOKENS
    used = torch.arange(max_pages, device=lens.device)[None, :] < n_pages[:, None]
    ids = block_table.to(torch.int64)[used]
    if int(ids.min()) < 0 or int(ids.max()) >= page_loc_layer.numel():
        raise ValueError(f"block_table holds page ids outside 0..{page_loc_layer.numel() - 1} "
                         "for pages inside the context")
    loc = page_loc_layer[ids]
    if int(loc.min()) < 0:
        raise ValueError("a page inside the context has page_loc = -1 (no page)")
    is_open = (loc & 1) == 1
    start = loc & ~1
    if bool(((start % 16) != 0).any()):
        raise ValueError("page locations must be 16-byte aligned (offset | 1 for open pages)")
    end = torch.where(is_open, start + layout.open_page_bytes, start + layout.min_page_bytes)
    if int(end.max()) > arena.numel():
        raise ValueError("a page location points past the end of the arena")
    last = block_table.to(torch.int64).gather(1, (n_pages - 1)[:, None])[:, 0]
    partial = (lens % PAGE_TOKENS) != 0
    if bool((partial & ((page_loc_layer[last] & 1) == 0)).any()):
        raise ValueError("the last, partial page of a request must be open (uncompressed)")
    if twin and not bool(is_open.all()):
        raise ValueError("decode_attention_twin reads open pages only; use decode_attention "
                         "for compressed pages")


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


BACKENDS = ("auto", "cuda", "triton")


def _use_cuda(backend, q, layout) -> bool:
    """Which kernel serves this call: the CUDA C++ kernel (``cuda_attention``) where it can
    (CUDA tensors, head_dim 128, group <= 16, nvcc present), else the Triton kernel.
    ``backend`` (or $ZIPFUSION_ATTENTION_BACKEND) forces one."""
    backend = backend or os.environ.get("ZIPFUSION_ATTENTION_BACKEND", "auto")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton":
        return False
    G = q.shape[1] // layout.num_kv_heads
    reason = cuda_attention.unsupported_reason(q.device, layout.head_dim, G)
    if backend == "cuda" and reason:
        raise cuda_attention.CudaKernelUnavailable(
            f"backend='cuda' was asked for but {reason}; use backend='triton' or 'auto'")
    return reason is None


def _launch(mode, q, arena, page_loc_layer, block_table, context_lens, layout, sm_scale, out,
            num_splits, tile_pages, num_warps, validate, use_asm=None, chsets=None,
            num_stages=None, prefetch=None, backend=None, stages=None, tma=None):
    _check_inputs(q, arena, page_loc_layer, block_table, context_lens, layout, sm_scale, out)
    if validate:
        _check_ids(arena, page_loc_layer, block_table, context_lens, layout, mode == MODE_TWIN)
    B, Hq, D = q.shape
    H = layout.num_kv_heads
    G = Hq // H
    q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    qk_scale = float(sm_scale) * LOG2E
    if _use_cuda(backend, q, layout):
        return cuda_attention.decode_attention_cuda(
            q, arena, page_loc_layer, block_table, context_lens, H, qk_scale, out,
            compressed=mode == MODE_FUSED, num_splits=num_splits, stages=stages, tma=tma)
    attn_kernel, merge_kernel, interp = _kernels(arena.device)
    if B == 0:
        return out
    TP = tile_pages or (1 if interp else 2)
    max_pages = block_table.shape[1]
    S = num_splits or default_num_splits(B, H, max_pages, TP, q.device)
    pps = -(-max_pages // S)
    pps = -(-pps // TP) * TP                 # pages per split: whole tiles
    S = -(-max_pages // pps)
    n4 = arena.numel() // 4 * 4
    arena32 = arena[:n4].view(torch.int32)
    if S > 1:
        part_o = torch.empty(B * Hq * S * D, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(B * Hq * S, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out
    LAST_COMPILED[mode] = attn_kernel[(B, H, S)](
        q, arena32, page_loc_layer, block_table, context_lens, out, part_o, part_lse,
        qk_scale, block_table.stride(0), pps, S,
        H=H, D=D, G=G, G_PAD=max(16, triton.next_power_of_2(G)), TP=TP, SINGLE=S == 1,
        COMPRESSED=mode == MODE_FUSED, USE_ASM=(not interp) if use_asm is None else use_asm,
        FP32_DOT=interp, CHSETS=chsets or 1, PREFETCH=True if prefetch is None else prefetch,
        num_warps=num_warps or 4,
        num_stages=num_stages or 1)
    if S > 1:
        merge_kernel[(B * Hq,)](part_o, part_lse, out, NUM_SPLITS=S,
                                 S_PAD=triton.next_power_of_2(S), D=D, num_warps=4)
    return out


def decode_attention(q, arena, page_loc_layer, block_table, context_lens, layout, sm_scale,
                     out=None, *, num_splits=None, tile_pages=None, num_warps=None,
                     validate=True, use_asm=None, chsets=None, num_stages=None,
                     prefetch=None, backend=None, stages=None, tma=None):
    """Paged decode attention reading open and compressed pages as ``page_loc_layer`` says.

    q [B, Hq, D] bf16; arena 1-D uint8; page_loc_layer int64 [max_pages]; block_table int32
    [B, max_pages_per_request]; context_lens int32 [B] -> [B, Hq, D] bf16 (written into ``out``
    if given). ``validate`` checks ids and locations (one device sync; pass False inside CUDA
    graphs). ``backend``: "auto" (the CUDA C++ kernel where it applies, else Triton), "cuda"
    or "triton". ``num_splits`` overrides the split-KV default (both kernels); ``stages``
    (copy depth) and ``tma`` (bulk copies) tune the CUDA kernel; ``tile_pages``, ``num_warps``, ``chsets``,
    ``num_stages``, ``prefetch`` and ``use_asm`` (False: pure-Triton byte interleave instead of
    ``prmt``) tune the Triton kernel.
    """
    return _launch(MODE_FUSED, q, arena, page_loc_layer, block_table, context_lens, layout,
                   sm_scale, out, num_splits, tile_pages, num_warps, validate, use_asm, chsets,
                   num_stages, prefetch, backend, stages, tma)


def decode_attention_twin(q, arena, page_loc_layer, block_table, context_lens, layout, sm_scale,
                          out=None, *, num_splits=None, tile_pages=None, num_warps=None,
                          validate=True, chsets=None, num_stages=None, prefetch=None,
                          backend=None, stages=None, tma=None):
    """The uncompressed twin: same tiling and arithmetic, every page must be open."""
    return _launch(MODE_TWIN, q, arena, page_loc_layer, block_table, context_lens, layout,
                   sm_scale, out, num_splits, tile_pages, num_warps, validate, None, chsets,
                   num_stages, prefetch, backend, stages, tma)
