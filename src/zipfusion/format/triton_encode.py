"""Bit work of the Triton codec's encoder: the block rule with escapes (``tile_bases``), the code
bytes (``code16``), format v2's escape records and the codec kernels' reductions, on tiles
[NB, 64, 4] of 32-bit words (docs/format.md section 2).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .layout import (COMPRESSED_BLOCK_BYTES, ESCAPE_FLAG, ESCAPED_BLOCK_BYTES, MAX_ESCAPES,
                     RAW_BLOCK_BYTES, RAW_MARK)

RAW_MARK_C = tl.constexpr(RAW_MARK)
FLAG_C = tl.constexpr(ESCAPE_FLAG)
MAX_ESC_C = tl.constexpr(MAX_ESCAPES)
COMPRESSED_C = tl.constexpr(COMPRESSED_BLOCK_BYTES)
ESCAPED_C = tl.constexpr(ESCAPED_BLOCK_BYTES)
RAW_C = tl.constexpr(RAW_BLOCK_BYTES)


def _interpreting() -> bool:
    """True when this module's functions were made by the Triton interpreter."""
    return not isinstance(tile_bases, triton.runtime.jit.JITFunction)


# Reductions with triton.language's own combine functions passed explicitly: the interpreter
# reduces them with numpy (an interpreted copy cannot call tl.sum), and on the GPU they compile
# to what tl.sum/tl.min/tl.max do.

@triton.jit
def sum_(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def minr(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_min)


@triton.jit
def maxr(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)



@triton.jit
def _outside(e_lo, e_hi, b):
    """n(b): values of each block outside its window [b, b+15], [NB] int32."""
    bb = b[:, None, None]
    out = ((e_lo < bb) | (e_lo > bb + 15)).to(tl.int32) + ((e_hi < bb) | (e_hi > bb + 15)).to(tl.int32)
    return sum_(sum_(out, axis=2), axis=1)


@triton.jit
def _min_above(e_lo, e_hi, u):
    """The smallest exponent above u [NB] in each block, [NB] (256 if there is none)."""
    uu = u[:, None, None]
    m = tl.minimum(tl.where(e_lo > uu, e_lo, 256), tl.where(e_hi > uu, e_hi, 256))
    return minr(minr(m, axis=2), axis=1)


@triton.jit
def tile_bases(w):
    """Tile [NB, 64, 4] of words -> per-block metadata byte [NB] and the tile's encoded bytes;
    the v2 base is one of min(u_i, 252) & ~1 for the five smallest distinct exponents u_i."""
    u = w.to(tl.uint32, bitcast=True)
    e_lo = ((u >> 7) & 0xFF).to(tl.int32)
    e_hi = ((u >> 23) & 0xFF).to(tl.int32)
    ui = minr(minr(tl.minimum(e_lo, e_hi), axis=2), axis=1)  # u_0
    b1 = ui & 0xFE
    fits = _outside(e_lo, e_hi, b1) == 0
    best_b = tl.minimum(ui, 252) & 0xFE
    best_n = _outside(e_lo, e_hi, best_b)
    for i in tl.static_range(MAX_ESC_C):
        ui = _min_above(e_lo, e_hi, ui)  # u_1 .. u_4
        c = tl.minimum(ui, 252) & 0xFE
        n = _outside(e_lo, e_hi, c)
        better = (n < best_n) | ((n == best_n) & (c > best_b))
        best_b = tl.where(better, c, best_b)
        best_n = tl.where(better, n, best_n)
    esc = best_n <= MAX_ESC_C
    meta = tl.where(fits, b1 >> 1, tl.where(esc, FLAG_C | (best_b >> 1), RAW_MARK_C))
    size = tl.where(fits, COMPRESSED_C, tl.where(esc, ESCAPED_C, RAW_C))
    return meta, sum_(size, axis=0)



@triton.jit
def lo16(w):
    """Low bytes of a word's two values packed into 16 bits."""
    return (w & 0xFF) | ((w >> 8) & 0xFF00)


@triton.jit
def code16(wa, wb, bh):
    """Code bytes of the value pairs (wa: values j, j+1; wb: values j+4, j+5) -> 16 bits,
    lane-wise on the 16-bit halves (no borrow across lanes in a compressible block)."""
    bh2 = bh * 0x00010001
    ha = (wa >> 8) & 0x00FF00FF
    hb = (wb >> 8) & 0x00FF00FF
    da = (ha & 0x007F007F) - bh2
    db = (hb & 0x007F007F) - bh2
    c = da | (db << 3) | (((hb >> 7) & 0x00010001) << 6) | (((ha >> 7) & 0x00010001) << 7)
    return (c & 0xFF) | ((c >> 8) & 0xFF00)


@triton.jit
def clean(w, bh):
    """Word w with d = 0 for values outside the window (their 7 exponent bits set to b/2)."""
    esc_lo = (((w >> 8) & 0x7F) - bh) > 7
    esc_hi = (((w >> 24) & 0x7F) - bh) > 7
    w = tl.where(esc_lo, (w & 0xFFFF80FF) | (bh << 8), w)
    return tl.where(esc_hi, (w & 0x80FFFFFF) | (bh << 24), w)


@triton.jit
def escape_words(u, bh, g, k):
    """The escape chunk's first two words per block: records r = v | ((e >> 1) ^ b/2) << 9 of
    the values outside the window, in index order (4 min-reductions over keys)."""
    bh3 = bh[:, None, None].to(tl.int32)
    v = 8 * g + 2 * k
    e7_lo = ((u >> 8) & 0x7F).to(tl.int32)
    e7_hi = ((u >> 24) & 0x7F).to(tl.int32)
    BIG: tl.constexpr = 1 << 16
    key_lo = tl.where((e7_lo - bh3 < 0) | (e7_lo - bh3 > 7), (v << 7) | (e7_lo ^ bh3), BIG)
    key_hi = tl.where((e7_hi - bh3 < 0) | (e7_hi - bh3 > 7), ((v + 1) << 7) | (e7_hi ^ bh3), BIG)
    prev = tl.full(bh.shape, -1, tl.int32)
    words0 = tl.full(bh.shape, 0, tl.int32)
    words1 = tl.full(bh.shape, 0, tl.int32)
    for i in tl.static_range(MAX_ESC_C):
        pv = prev[:, None, None]
        m = tl.minimum(tl.where(key_lo > pv, key_lo, BIG), tl.where(key_hi > pv, key_hi, BIG))
        key = minr(minr(m, axis=2), axis=1)
        rec = tl.where(key < BIG, (key >> 7) | ((key & 0x7F) << 9), 0)
        if i < 2:
            words0 = words0 | (rec << (16 * i))
        else:
            words1 = words1 | (rec << (16 * (i - 2)))
        prev = key
    return words0, words1
