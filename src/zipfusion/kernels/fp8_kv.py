"""FP8 (E4M3) KV pages in Triton: the quantizer and dequantizer the store and decode kernels inline.

The Triton twins of format/fp8.py's ``quantize_e4m3`` / ``dequantize_e4m3`` (the one definition
of the store and read arithmetic, its special inputs and the one-byte page layout), equal to
them bit for bit but for NaNs' sign and payload: the quantizer in integer and fp32 arithmetic;
the dequantizer too under the interpreter (:func:`e4m3_dequant_bits`), and with the GPU's
conversions compiled (:func:`e4m3_dequant_native`, the same bits).
"""

from __future__ import annotations

try:       # the Triton interpreter runs a @jit function only where triton.language is visible to it
    import triton
    import triton.language as tl
except ImportError:                    # no Triton: the torch functions still work
    triton = tl = None


def _interpreting() -> bool:
    """Whether this module's @jit helpers were made by the Triton interpreter (same_mode asks)."""
    return not isinstance(e4m3_dequant_bits, triton.runtime.jit.JITFunction)


if triton is not None:
    @triton.jit
    def e4m3_dequant_bits(b, scale):
        """E4M3 bytes (any integer tensor, values 0..255) -> bf16 of fp32(E4M3(b)) * scale, in
        integer and fp32 arithmetic (the interpreter's :func:`e4m3_dequant`).

        s = b >> 7, e = (b >> 3) & 15, m = b & 7; |x| = m·2^-9 when e = 0 (subnormal), else the
        fp32 with exponent field e - 7 + 127 and mantissa m << 20; NaN where b & 0x7F = 0x7F; the
        sign is set as a bit (so -0 stays -0). Equal to :func:`dequantize_e4m3` bit for bit but
        for the NaNs' payloads."""
        x = b.to(tl.int32) & 0xFF
        e = (x >> 3) & 15
        m = x & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
        mag = tl.where((x & 0x7F) == 0x7F, float("nan"), mag)
        val = (mag.to(tl.int32, bitcast=True) | ((x >> 7) << 31)).to(tl.float32, bitcast=True)   # sign; -0 too
        return bf16_rne(val * scale)

    @triton.jit
    def e4m3_dequant_native(b, scale):
        """:func:`e4m3_dequant_bits` with the GPU's own conversions (the compiled kernels'
        :func:`e4m3_dequant`): the byte read as E4M3 and converted to fp32 (exact: every E4M3 value
        is an fp32 value), the product with the scale rounded to bf16 by the hardware's
        round-to-nearest-even. The same bits (NaNs' payloads aside) in a few instructions instead
        of ~20 integer ones a value. Not for the interpreter (its casts truncate, it has no E4M3)."""
        return (b.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale).to(tl.bfloat16)

    # what the kernels call: the GPU's conversions compiled, the integer arithmetic interpreted
    e4m3_dequant = e4m3_dequant_bits if _interpreting() else e4m3_dequant_native

    @triton.jit
    def e4m3_quant(x, scale):
        """Values -> E4M3 bytes (uint8) of y = fp32(x) / scale (division rounded to nearest, as
        :func:`quantize_e4m3`'s: the same bytes, a NaN's sign aside): |y| clamped to 448;
        normals (|y| >= 2^-6) rounded to 3 mantissa bits to nearest even on the fp32 bits
        (bits + 0x7FFFF + bit 20, >> 20, less the exponent bias difference 120 << 3); subnormals
        m = round_half_even(|y|·2^9) (m = 8 is the smallest normal, byte 0x08); the sign as a bit
        (-0 and negative values rounding to 0 give 0x80); NaN -> 0x7F."""
        y = tl.math.div_rn(x.to(tl.float32), scale)
        sign = (y.to(tl.uint32, bitcast=True) >> 31) << 7
        a = tl.where(tl.abs(y) < 448.0, tl.abs(y), 448.0)
        ab = a.to(tl.uint32, bitcast=True)
        normal = ((ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20) - (120 << 3)
        q = a * 512.0                                   # exact; < 8 where it is used
        fl = q.to(tl.uint32)                            # floor (q >= 0)
        frac = q - fl.to(tl.float32)
        sub = fl + ((frac > 0.5) | ((frac == 0.5) & ((fl & 1) == 1))).to(tl.uint32)
        byte = tl.where(a < 0.015625, sub, normal) | sign
        return tl.where(y != y, 0x7F, byte).to(tl.uint8)

    @triton.jit
    def bf16_rne(v):
        """fp32 -> bf16 rounded to nearest even by integer ops, torch's rounding on every backend
        (the Triton interpreter's own cast truncates): bits + 0x7FFF + (bit 16), the high half;
        NaN -> the canonical bf16 NaN 0x7FC0. (rope_store.py rounds with it too.)"""
        bits = v.to(tl.uint32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        r = tl.where(v != v, 0x7FC0, r)
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
