"""FP8 (E4M3) KV in Triton: the quantizer and dequantizer the store and decode kernels inline,
format/fp8.py's functions bit for bit (NaNs' sign and payload aside).
"""

from __future__ import annotations

try:  # the Triton interpreter runs a @jit function only where triton.language is visible
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


def _interpreting() -> bool:
    return not isinstance(e4m3_dequant_bits, triton.runtime.jit.JITFunction)


if triton is not None:
    @triton.jit
    def e4m3_dequant_bits(b, scale):
        """E4M3 bytes -> bf16 of fp32(E4M3(b)) * scale in integer and fp32 arithmetic (the
        interpreter's :func:`e4m3_dequant`; -0 stays -0)."""
        x = b.to(tl.int32) & 0xFF
        e = (x >> 3) & 15
        m = x & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
        mag = tl.where((x & 0x7F) == 0x7F, float("nan"), mag)
        val = (mag.to(tl.int32, bitcast=True) | ((x >> 7) << 31)).to(tl.float32, bitcast=True)
        return bf16_rne(val * scale)

    @triton.jit
    def e4m3_dequant_native(b, scale):
        """:func:`e4m3_dequant_bits` with the GPU's own conversions (the compiled kernels'), the
        same bits in fewer instructions; not for the interpreter (its casts truncate)."""
        return (b.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale).to(tl.bfloat16)

    e4m3_dequant = e4m3_dequant_bits if _interpreting() else e4m3_dequant_native

    @triton.jit
    def e4m3_quant(x, scale):
        """Values -> E4M3 bytes of fp32(x) / scale, clamped to ±448 and rounded to nearest even on
        the fp32 bits (subnormals by round_half_even(|y|·2^9)); :func:`quantize_e4m3`'s bytes."""
        y = tl.math.div_rn(x.to(tl.float32), scale)
        sign = (y.to(tl.uint32, bitcast=True) >> 31) << 7
        a = tl.where(tl.abs(y) < 448.0, tl.abs(y), 448.0)
        ab = a.to(tl.uint32, bitcast=True)
        normal = ((ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20) - (120 << 3)
        q = a * 512.0
        fl = q.to(tl.uint32)  # floor (q >= 0)
        frac = q - fl.to(tl.float32)
        sub = fl + ((frac > 0.5) | ((frac == 0.5) & ((fl & 1) == 1))).to(tl.uint32)
        byte = tl.where(a < 0.015625, sub, normal) | sign
        return tl.where(y != y, 0x7F, byte).to(tl.uint8)

    @triton.jit
    def bf16_rne(v):
        """fp32 -> bf16 rounded to nearest even by integer ops (the interpreter's cast truncates)."""
        bits = v.to(tl.uint32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        r = tl.where(v != v, 0x7FC0, r)
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
