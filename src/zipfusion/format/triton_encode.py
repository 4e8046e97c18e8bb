"""Bit work of the Triton codec's encoder (``triton_codec.py``): the block rule with escapes
(``tile_bases``), the code bytes (``code16``), format v2's escape records (``clean``,
``escape_words``), and the reductions the codec's kernels use. Every function works on a tile
``[NB, 64, 4]`` of 32-bit words (``NB`` blocks x 64 groups x 4 words of two BF16 values) or on
per-block vectors ``[NB]``; docs/format.md section 2 has the rules.
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


# --------------------------------------------------------------------------------------------
# Reductions (also used by the codec's kernels)
# --------------------------------------------------------------------------------------------

# Reductions: tl.reduce with triton.language's own combine functions, passed explicitly. The
# Triton interpreter recognises these objects and reduces with numpy (fast); tl.sum/tl.min/
# tl.max would not run under the interpreter copy of this module (see triton_codec._kernel) when Triton was
# imported without TRITON_INTERPRET=1, and our own combine functions would be reduced element
# by element in Python (slow). On the GPU this is exactly what tl.sum/tl.min/tl.max compile to.

@triton.jit
def sum_(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def minr(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_min)


@triton.jit
def maxr(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)


# --------------------------------------------------------------------------------------------
# Analyze: per-block metadata byte and size
# --------------------------------------------------------------------------------------------

@triton.jit
def _outside(e_lo, e_hi, b):
    """n(b): values of each block outside its window [b, b+15], [NB] int32, for bases b [NB]."""
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
    """Tile [NB, 64, 4] of words -> per-block metadata byte [NB] and the tile's encoded bytes.

    Exponents of each half of a word: e = (w >> 7) & 0xFF and (w >> 23) & 0xFF.
    v1 form: b1 = min(e) & ~1 and n(b1) = 0 -> b1/2, 768 bytes. Else (format v2) the largest
    even b <= 252 with the fewest values outside [b, b+15], which is one of the candidates
    min(u_i, 252) & ~1 for the five smallest distinct exponents u_0 < .. < u_4 (docs/format.md
    section 2): <= 4 outside -> 0x80 | b/2, 784 bytes; else raw, 0xFF, 1024 bytes.
    """
    u = w.to(tl.uint32, bitcast=True)
    e_lo = ((u >> 7) & 0xFF).to(tl.int32)
    e_hi = ((u >> 23) & 0xFF).to(tl.int32)
    ui = minr(minr(tl.minimum(e_lo, e_hi), axis=2), axis=1)           # u_0, [NB]
    b1 = ui & 0xFE
    fits = _outside(e_lo, e_hi, b1) == 0
    best_b = tl.minimum(ui, 252) & 0xFE
    best_n = _outside(e_lo, e_hi, best_b)
    for i in tl.static_range(MAX_ESC_C):
        ui = _min_above(e_lo, e_hi, ui)                                   # u_1 .. u_4
        c = tl.minimum(ui, 252) & 0xFE
        n = _outside(e_lo, e_hi, c)
        better = (n < best_n) | ((n == best_n) & (c > best_b))
        best_b = tl.where(better, c, best_b)
        best_n = tl.where(better, n, best_n)
    esc = best_n <= MAX_ESC_C
    meta = tl.where(fits, b1 >> 1, tl.where(esc, FLAG_C | (best_b >> 1), RAW_MARK_C))
    size = tl.where(fits, COMPRESSED_C, tl.where(esc, ESCAPED_C, RAW_C))
    return meta, sum_(size, axis=0)


# --------------------------------------------------------------------------------------------
# Compress: code bytes and escape records
# --------------------------------------------------------------------------------------------

@triton.jit
def lo16(w):
    """Low bytes of the two values of a word, packed into 16 bits: lo(v0) | lo(v1) << 8."""
    return (w & 0xFF) | ((w >> 8) & 0xFF00)


@triton.jit
def code16(wa, wb, bh):
    """Code bytes of the value pairs (wa: values j, j+1; wb: values j+4, j+5) -> 16 bits.

    Lane-wise on the 16-bit halves: hi = high byte, d = (hi & 0x7F) − b/2 in 0..7, s = hi >> 7;
    code = s[j] << 7 | s[j+4] << 6 | d[j+4] << 3 | d[j], then the two lanes' bytes packed.
    The subtraction cannot borrow across lanes because (hi & 0x7F) >= b/2 in every lane of a
    compressible block (raw blocks' codes are never stored).
    """
    bh2 = bh * 0x00010001
    ha = (wa >> 8) & 0x00FF00FF
    hb = (wb >> 8) & 0x00FF00FF
    da = (ha & 0x007F007F) - bh2
    db = (hb & 0x007F007F) - bh2
    c = da | (db << 3) | (((hb >> 7) & 0x00010001) << 6) | (((ha >> 7) & 0x00010001) << 7)
    return (c & 0xFF) | ((c >> 8) & 0xFF00)


@triton.jit
def clean(w, bh):
    """Word w (two values) with d = 0 for the values outside the window [b, b+15] (format v2
    escapes): their high byte's 7 low bits, e >> 1, replaced by b/2. Inside the window
    (e >> 1) - b/2 is 0..7; outside it is negative (wraps, unsigned) or above 7."""
    esc_lo = (((w >> 8) & 0x7F) - bh) > 7
    esc_hi = (((w >> 24) & 0x7F) - bh) > 7
    w = tl.where(esc_lo, (w & 0xFFFF80FF) | (bh << 8), w)
    return tl.where(esc_hi, (w & 0x80FFFFFF) | (bh << 24), w)


@triton.jit
def escape_words(u, bh, g, k):
    """The escape chunk's first two words per block, [NB] each: records r_0..r_3 (u16, index
    order) of the values outside the window, r = v | ((e >> 1) ^ b/2) << 9, zero after the last.

    Each value outside gets a key v << 7 | ((e >> 1) ^ b/2) (v: 9 bits, so keys order by v);
    record i is the i-th smallest key (4 min-reductions, each above the previous key).
    """
    bh3 = bh[:, None, None].to(tl.int32)
    v = 8 * g + 2 * k                                                   # value of the low half
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
