"""The restore of compressed groups (docs/format.md section 2): the one Triton routine that the
codec's decompress kernel (``triton_codec.py``), the decode attention kernel
(``kernels/triton_attention.py``) and the paged prefill kernel (``kernels/prefill_attention.py``)
call; ``reference.decode_blocks`` is its torch counterpart, and ``kernels/cuda/decode_attention.cu``
its CUDA C++ counterpart.

A *group* is 8 consecutive values of a block (8 channels of one token): two 32-bit words of
low bytes ``lo0`` (values 0..3) and ``lo1`` (values 4..7) and one word ``code`` of 4-bit codes
(code byte j: s[j] << 7 | s[j+4] << 6 | d[j+4] << 3 | d[j]). With ``bh = b/2``::

    h0 = (code & 0x87878787) + bh·0x01010101                              high bytes of 0..3
    h1 = ((code << 1) & 0x80808080 | (code >> 3) & 0x07070707) + bh·0x01010101        4..7

(``bh + d <= 127``: no byte carries into the next). Format v2 escapes: a block with escapes
carries 4 u16 records ``r = v | x << 9`` (``esc0`` = records 0, 1; ``esc1`` = records 2, 3);
each XORs ``x`` into the high byte of value ``v`` of the block, which is byte ``v mod 4`` of
``h0`` (``v mod 8 < 4``) or ``h1`` of group ``gq = v >> 3``::

    p   = x << 8·(v mod 4)      where v >> 3 == gq, else 0
    h0 ^= p  (v mod 8 < 4),  h1 ^= p  (otherwise)

A zero record is a no-op, so blocks without escapes (their records loaded as 0) come out right
either way; ``any_escape`` (a scalar, uniform over the tile) skips the patch where no block of
the tile has escapes. Finally the bytes are interleaved into the group's four words of bf16
pairs ``w_k = (lo_2k, hi_2k, lo_2k+1, hi_2k+1)`` (``prmt`` on the GPU, selectors 0x5140 and
0x7362; shifts and masks under the interpreter), exactly the words an open page holds there.

Every tensor argument has the same shape (any shape: one element per group), uint32.
"""

from __future__ import annotations

import triton
import triton.language as tl


def _interpreting() -> bool:
    """True when this module's functions were made by the Triton interpreter."""
    return not isinstance(restore_group, triton.runtime.jit.JITFunction)


@triton.jit
def _interleave(lo0, lo1, h0, h1, INTERPRET: tl.constexpr):
    """Words of bf16 pairs w_k = bytes (lo_2k, hi_2k, lo_2k+1, hi_2k+1), k = 0..3, of a group.

    lo0/lo1: low bytes of values 0..3 / 4..7; h0/h1: their high bytes (uint32 tiles).
    """
    if INTERPRET:           # no inline PTX on the CPU: the same bytes by shifts and masks
        w0 = (lo0 & 0xFF) | ((h0 & 0xFF) << 8) | ((lo0 & 0xFF00) << 8) | ((h0 & 0xFF00) << 16)
        w1 = ((lo0 >> 16) & 0xFF) | ((h0 >> 8) & 0xFF00) | ((lo0 >> 8) & 0xFF0000) \
            | (h0 & 0xFF000000)
        w2 = (lo1 & 0xFF) | ((h1 & 0xFF) << 8) | ((lo1 & 0xFF00) << 8) | ((h1 & 0xFF00) << 16)
        w3 = ((lo1 >> 16) & 0xFF) | ((h1 >> 8) & 0xFF00) | ((lo1 >> 8) & 0xFF0000) \
            | (h1 & 0xFF000000)
    else:
        w0, w1, w2, w3 = tl.inline_asm_elementwise(
            "prmt.b32 $0, $4, $6, 0x5140; prmt.b32 $1, $4, $6, 0x7362; "
            "prmt.b32 $2, $5, $7, 0x5140; prmt.b32 $3, $5, $7, 0x7362;",
            "=r,=r,=r,=r,r,r,r,r", [lo0, lo1, h0, h1],
            dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True, pack=1)
    return w0, w1, w2, w3


@triton.jit
def _patch(h0, h1, rec, gq):
    """One escape record rec = v | x << 9 (low 16 bits; uint32) applied to the high-byte words
    h0, h1 of group gq: x XORed into the high byte of value v if v lies in this group."""
    v = rec & 0x1FF
    p = tl.where((v >> 3) == gq, ((rec >> 9) & 0x7F) << (8 * (v & 3)), 0)
    h0 = h0 ^ tl.where((v & 4) == 0, p, 0)
    h1 = h1 ^ tl.where((v & 4) != 0, p, 0)
    return h0, h1


@triton.jit
def restore_group(lo0, lo1, code, bh, esc0, esc1, gq, any_escape, INTERPRET: tl.constexpr):
    """The four words (w0, w1, w2, w3) of bf16 pairs of compressed groups (module docstring).

    lo0, lo1: low-byte words; code: code word; bh: b/2 (0..127, the metadata byte without the
    escape flag); esc0, esc1: the block's escape records (0 for a block without escapes);
    gq: the group's index in its block (0..63); any_escape: scalar, False where no group of the
    call needs a patch. All uint32 of one shape.
    """
    hb = bh * 0x01010101
    h0 = (code & 0x87878787) + hb
    h1 = (((code << 1) & 0x80808080) | ((code >> 3) & 0x07070707)) + hb
    if any_escape:
        h0, h1 = _patch(h0, h1, esc0 & 0xFFFF, gq)
        h0, h1 = _patch(h0, h1, esc0 >> 16, gq)
        h0, h1 = _patch(h0, h1, esc1 & 0xFFFF, gq)
        h0, h1 = _patch(h0, h1, esc1 >> 16, gq)
    return _interleave(lo0, lo1, h0, h1, INTERPRET)
