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
# rotate k and store k and v of KV head h into the open page of token t:
#   out1 = x1 * cos - x2 * sin,  out2 = x2 * cos + x1 * sin      (x1, x2: halves of the head)
#   arena bf16 element of (role r, slot s, head h, channel c) = (page_loc >> 1) + ((r*16 + s)*H + h)*D + c
# (page_loc = byte offset | 1 for an open page, so page_loc >> 1 is the bf16 element index.)
# ------------------------------------------------------------------------------------------
@triton.jit
def _rope_store_kernel(qkv_ptr, cos_ptr, sin_ptr, q_out_ptr, arena16_ptr, page_loc_ptr, page_ids_ptr,
                       slots_ptr, qkv_stride, HQ: tl.constexpr, H: tl.constexpr, D: tl.constexpr):
    t = tl.program_id(0)
    head = tl.program_id(1)
    HALF: tl.constexpr = D // 2
    c = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + t * D + c).to(tl.float32)
    sin = tl.load(sin_ptr + t * D + c).to(tl.float32)
    row = qkv_ptr + t * qkv_stride
    if head < HQ:
        x1 = tl.load(row + head * D + c).to(tl.float32)
        x2 = tl.load(row + head * D + HALF + c).to(tl.float32)
        dst = q_out_ptr + (t * HQ + head) * D
        tl.store(dst + c, (x1 * cos - x2 * sin).to(q_out_ptr.dtype.element_ty))
        tl.store(dst + HALF + c, (x2 * cos + x1 * sin).to(q_out_ptr.dtype.element_ty))
    else:
        h = head - HQ
        k_off = HQ * D + h * D
        v_off = HQ * D + H * D + h * D
        x1 = tl.load(row + k_off + c).to(tl.float32)
        x2 = tl.load(row + k_off + HALF + c).to(tl.float32)
        v1 = tl.load(row + v_off + c)
        v2 = tl.load(row + v_off + HALF + c)
        page = tl.load(page_ids_ptr + t)
        slot = tl.load(slots_ptr + t)
        base = tl.load(page_loc_ptr + page) >> 1
        k_dst = arena16_ptr + base + (slot * H + h) * D
        v_dst = arena16_ptr + base + ((16 + slot) * H + h) * D
        tl.store(k_dst + c, (x1 * cos - x2 * sin).to(tl.bfloat16))
        tl.store(k_dst + HALF + c, (x2 * cos + x1 * sin).to(tl.bfloat16))
        tl.store(v_dst + c, v1.to(tl.bfloat16))
        tl.store(v_dst + HALF + c, v2.to(tl.bfloat16))


def rope_and_store(qkv, cos, sin, num_heads, num_kv_heads, head_dim, arena, page_loc_layer, page_ids, slots):
    """qkv [T, (Hq + 2H)·D] (q, k not yet rotated), cos/sin [T, D] -> rotated q [T, Hq, D];
    rotated k and v written into the arena at (page_ids[t], slots[t]) of this layer."""
    import torch
    T = qkv.shape[0]
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    q_out = torch.empty(T, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    n4 = arena.numel() // 2 * 2
    _rope_store_kernel[(T, num_heads + num_kv_heads)](
        qkv, cos.contiguous(), sin.contiguous(), q_out, arena[:n4].view(torch.bfloat16), page_loc_layer,
        page_ids, slots, qkv.stride(0), HQ=num_heads, H=num_kv_heads, D=head_dim)
    return q_out
