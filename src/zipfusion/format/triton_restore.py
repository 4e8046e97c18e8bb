"""The restore of compressed groups (docs/format.md section 2): the one Triton routine of the codec,
decode and prefill kernels, giving the four words an open page holds there.
"""

from __future__ import annotations

import triton
import triton.language as tl


def _interpreting() -> bool:
    return not isinstance(restore_group, triton.runtime.jit.JITFunction)


@triton.jit
def _interleave(lo0, lo1, h0, h1, INTERPRET: tl.constexpr):
    """Words of bf16 pairs (lo_2k, hi_2k, lo_2k+1, hi_2k+1), k = 0..3, of a group."""
    if INTERPRET:  # no inline PTX on the CPU: shifts and masks
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
    """One escape record v | x << 9 applied: x XORed into value v's high byte if v is in group gq."""
    v = rec & 0x1FF
    p = tl.where((v >> 3) == gq, ((rec >> 9) & 0x7F) << (8 * (v & 3)), 0)
    h0 = h0 ^ tl.where((v & 4) == 0, p, 0)
    h1 = h1 ^ tl.where((v & 4) != 0, p, 0)
    return h0, h1


@triton.jit
def restore_group(lo0, lo1, code, bh, esc0, esc1, gq, any_escape, INTERPRET: tl.constexpr):
    """The four words of bf16 pairs of compressed groups; ``any_escape`` (scalar) False skips the
    escape patch."""
    hb = bh * 0x01010101
    h0 = (code & 0x87878787) + hb
    h1 = (((code << 1) & 0x80808080) | ((code >> 3) & 0x07070707)) + hb
    if any_escape:
        h0, h1 = _patch(h0, h1, esc0 & 0xFFFF, gq)
        h0, h1 = _patch(h0, h1, esc0 >> 16, gq)
        h0, h1 = _patch(h0, h1, esc1 & 0xFFFF, gq)
        h0, h1 = _patch(h0, h1, esc1 >> 16, gq)
    return _interleave(lo0, lo1, h0, h1, INTERPRET)
