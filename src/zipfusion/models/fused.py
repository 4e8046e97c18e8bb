"""Fused small ops for the decode step on CUDA (Triton): residual add + RMSNorm, SiLU-and-mul,
and rope + K/V store into the arena.

In a decode step the weight GEMMs and the attention kernel move the bytes; everything else is
tiny elementwise work whose cost is the number of kernels. Written as torch ops, RMSNorm is ~6
kernels, rope ~8 per tensor, the K/V store ~5; these kernels do each in one. The torch
versions stay the reference (CPU, float32 exactness against transformers) and the tests
compare both under the Triton interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl


# ------------------------------------------------------------------------------------------
# RMSNorm:  y = w * (x / sqrt(mean(x^2) + eps)), statistics in fp32, one row per program.
# With a residual the add comes first, in the same kernel:  s = x + r (rounded to bf16, as the
# torch add rounds),  y = RMSNorm(s);  s is the next residual. A decoder layer does this twice,
# so the residual adds cost no kernels of their own.
# ------------------------------------------------------------------------------------------
@triton.jit
def _rmsnorm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, N, eps, HAS_RESIDUAL: tl.constexpr,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(s_ptr.dtype.element_ty)                  # the residual stream, rounded
        tl.store(s_ptr + row * N + cols, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / N                          # mean of squares over the row
    xn = (x * tl.rsqrt(var + eps)).to(y_ptr.dtype.element_ty)  # normalise, round like torch does
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # w * xn in fp32, rounded once (= torch's bf16 multiply; also the interpreter's bf16 math is unreliable)
    tl.store(y_ptr + row * N + cols, (w * xn.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=mask)


def rmsnorm(x, weight, eps, residual=None):
    """x [..., N] -> RMSNorm(x) * weight, same dtype. With ``residual`` (x's shape):
    returns (RMSNorm(x + residual) * weight, x + residual)."""
    import torch
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    N = x2.shape[1]
    y = torch.empty_like(x2)
    if residual is None:
        _rmsnorm_kernel[(x2.shape[0],)](x2, x2, weight, y, y, N, eps, HAS_RESIDUAL=False,
                                        BLOCK=triton.next_power_of_2(N))
        return y.view(x.shape)
    r2 = residual.reshape(-1, N).contiguous()
    s = torch.empty_like(x2)
    _rmsnorm_kernel[(x2.shape[0],)](x2, r2, weight, y, s, N, eps, HAS_RESIDUAL=True,
                                    BLOCK=triton.next_power_of_2(N))
    return y.view(x.shape), s.view(x.shape)


# ------------------------------------------------------------------------------------------
# SiLU and mul:  gate_up = [gate | up] per row  ->  silu(gate) * up = gate * sigmoid(gate) * up
# ------------------------------------------------------------------------------------------
@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(gu_ptr + row * 2 * N + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * N + N + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)     # torch rounds silu(g) first
    tl.store(out_ptr + row * N + cols, (silu.to(tl.float32) * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up):
    import torch
    T, N2 = gate_up.shape
    N = N2 // 2
    out = torch.empty(T, N, dtype=gate_up.dtype, device=gate_up.device)
    BLOCK = 1024
    _silu_mul_kernel[(T, triton.cdiv(N, BLOCK))](gate_up.contiguous(), out, N, BLOCK=BLOCK)
    return out


# ------------------------------------------------------------------------------------------
# Rope + K/V store. Program (t, head): heads 0..Hq-1 rotate q into q_out; heads Hq..Hq+H-1
# rotate k (into k_out when asked: prefill attends over it) and store k and v of KV head h
# into the open page of token t. Rope (RotaryEmbedding's arithmetic, models/layers.py):
#   out1 = x1*cos - x2*sin,  out2 = x2*cos + x1*sin      (x1, x2: halves of the head)
# with cos/sin fp32 and the products and sums in fp64 (exact products, so FMA or not gives the
# same bits), rounded to fp32 and then to the output dtype: the torch version's exact bits.
# Arena addressing: format.layout.open_element (bf16 element of role r, slot s, head h, channel c).
# ------------------------------------------------------------------------------------------
@triton.jit
def _rotate(src, cos, sin, c, HALF: tl.constexpr):
    x1 = tl.load(src + c).to(tl.float64)
    x2 = tl.load(src + HALF + c).to(tl.float64)
    return (x1 * cos - x2 * sin).to(tl.float32), (x2 * cos + x1 * sin).to(tl.float32)


@triton.jit
def _round(x, dtype: tl.constexpr):
    """fp32 -> ``dtype``. bf16: round to nearest even by integer ops, torch's rounding on every
    backend (the Triton interpreter's own cast truncates); NaN -> the canonical bf16 NaN."""
    if dtype == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        b = tl.where(x != x, 0x7FC0, b)
        return b.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def _rope_store_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, arena16_ptr,
                       page_loc_ptr, page_ids_ptr, slots_ptr, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h,
                       HQ: tl.constexpr, H: tl.constexpr, D: tl.constexpr, STORE_K: tl.constexpr):
    t = tl.program_id(0)
    head = tl.program_id(1)
    HALF: tl.constexpr = D // 2
    c = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + t * HALF + c).to(tl.float64)
    sin = tl.load(sin_ptr + t * HALF + c).to(tl.float64)
    if head < HQ:
        o1, o2 = _rotate(q_ptr + t * sq_t + head * sq_h, cos, sin, c, HALF)
        dst = q_out_ptr + (t * HQ + head) * D
        tl.store(dst + c, _round(o1, q_out_ptr.dtype.element_ty))
        tl.store(dst + HALF + c, _round(o2, q_out_ptr.dtype.element_ty))
    else:
        h = head - HQ
        o1, o2 = _rotate(k_ptr + t * sk_t + h * sk_h, cos, sin, c, HALF)
        k1, k2 = _round(o1, tl.bfloat16), _round(o2, tl.bfloat16)
        if STORE_K:
            dst = k_out_ptr + (t * H + h) * D
            tl.store(dst + c, _round(o1, k_out_ptr.dtype.element_ty))
            tl.store(dst + HALF + c, _round(o2, k_out_ptr.dtype.element_ty))
        vsrc = v_ptr + t * sv_t + h * sv_h
        page = tl.load(page_ids_ptr + t)
        slot = tl.load(slots_ptr + t)
        base = tl.load(page_loc_ptr + page) >> 1            # open page: page_loc = byte offset | 1
        k_dst = arena16_ptr + base + (slot * H + h) * D
        v_dst = arena16_ptr + base + ((16 + slot) * H + h) * D
        tl.store(k_dst + c, k1)
        tl.store(k_dst + HALF + c, k2)
        tl.store(v_dst + c, _round(tl.load(vsrc + c).to(tl.float32), tl.bfloat16))
        tl.store(v_dst + HALF + c, _round(tl.load(vsrc + HALF + c).to(tl.float32), tl.bfloat16))


def rope_and_store(q, k, v, cos, sin, arena, page_loc_layer, page_ids, slots, want_k: bool = False):
    """q [T, Hq, D], k, v [T, H, D] (views with unit channel stride), cos/sin [T, D/2] fp32 ->
    (rotated q [T, Hq, D], rotated k [T, H, D] if ``want_k`` else None); rotated k and v are
    written as bf16 into the open pages ``page_ids[t]`` at slot ``slots[t]`` of this layer."""
    import torch
    T, HQ, D = q.shape
    H = k.shape[1]
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(2) != 1:
            raise ValueError(f"rope_and_store: {name} needs unit stride over channels")
    q_out = torch.empty(T, HQ, D, dtype=q.dtype, device=q.device)
    k_out = torch.empty(T, H, D, dtype=k.dtype, device=k.device) if want_k else q_out
    if T:
        n2 = arena.numel() // 2 * 2
        _rope_store_kernel[(T, HQ + H)](
            q, k, v, cos.contiguous(), sin.contiguous(), q_out, k_out, arena[:n2].view(torch.bfloat16),
            page_loc_layer, page_ids, slots, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), HQ=HQ, H=H, D=D, STORE_K=want_k)
    return q_out, (k_out if want_k else None)
