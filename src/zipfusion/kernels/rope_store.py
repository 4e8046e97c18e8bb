"""Rope + K/V store into the arena in one Triton kernel (CUDA), the torch version
(models/layers.py, memory/kv_cache.py) staying the reference it is tested against.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..format.layout import PAGE_TOKENS, loc_offset, open_bf16_index
from .fp8_kv import bf16_rne, e4m3_dequant, e4m3_quant

_open_bf16_index = triton.jit(open_bf16_index)
_loc_offset = triton.jit(loc_offset)
PAGE_TOKENS_C = tl.constexpr(PAGE_TOKENS)


# Program (t, head): heads 0..Hq-1 rotate q; heads Hq.. rotate k and store k and v of KV head h
# into token t's open page, with RotaryEmbedding's arithmetic (fp64 products: the torch bits).
@triton.jit
def _rotate(src, cos, sin, c, HALF: tl.constexpr):
    x1 = tl.load(src + c).to(tl.float64)
    x2 = tl.load(src + HALF + c).to(tl.float64)
    return (x1 * cos - x2 * sin).to(tl.float32), (x2 * cos + x1 * sin).to(tl.float32)


@triton.jit
def _round(x, dtype: tl.constexpr):
    """fp32 -> ``dtype`` (bf16: rounded to nearest even by integer ops)."""
    if dtype == tl.bfloat16:
        return bf16_rne(x)
    return x.to(dtype)


@triton.jit
def _rope_store_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, v_out_ptr, arena_ptr,
                       page_loc_ptr, page_ids_ptr, slots_ptr, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h,
                       k_scale, v_scale,
                       HQ: tl.constexpr, H: tl.constexpr, D: tl.constexpr, STORE_K: tl.constexpr,
                       FP8: tl.constexpr):
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
        vsrc = v_ptr + t * sv_t + h * sv_h
        v1 = _round(tl.load(vsrc + c).to(tl.float32), tl.bfloat16)
        v2 = _round(tl.load(vsrc + HALF + c).to(tl.float32), tl.bfloat16)
        page = tl.load(page_ids_ptr + t)
        slot = tl.load(slots_ptr + t)
        loc = tl.load(page_loc_ptr + page)
        if FP8:  # E4M3 bytes; k_out, v_out: the values as stored
            base = _loc_offset(loc)
            k1, k2 = e4m3_quant(k1, k_scale), e4m3_quant(k2, k_scale)
            v1, v2 = e4m3_quant(v1, v_scale), e4m3_quant(v2, v_scale)
            if STORE_K:
                row = (t * H + h) * D
                tl.store(k_out_ptr + row + c, e4m3_dequant(k1, k_scale))
                tl.store(k_out_ptr + row + HALF + c, e4m3_dequant(k2, k_scale))
                tl.store(v_out_ptr + row + c, e4m3_dequant(v1, v_scale))
                tl.store(v_out_ptr + row + HALF + c, e4m3_dequant(v2, v_scale))
        else:
            base = _open_bf16_index(loc)
            if STORE_K:
                dst = k_out_ptr + (t * H + h) * D
                tl.store(dst + c, _round(o1, k_out_ptr.dtype.element_ty))
                tl.store(dst + HALF + c, _round(o2, k_out_ptr.dtype.element_ty))
        k_dst = arena_ptr + base + (slot * H + h) * D
        v_dst = arena_ptr + base + ((PAGE_TOKENS_C + slot) * H + h) * D
        tl.store(k_dst + c, k1)
        tl.store(k_dst + HALF + c, k2)
        tl.store(v_dst + c, v1)
        tl.store(v_dst + HALF + c, v2)


def rope_and_store(q, k, v, cos, sin, arena, page_loc_layer, page_ids, slots, want_k: bool = False,
                   fp8_scales: tuple[float, float] | None = None):
    """Rotate q and k, write k and v into the open pages ``page_ids[t]`` at ``slots[t]``; returns
    (q, k) rotated (k None unless ``want_k``). ``fp8_scales``: FP8 pages, returning (q, k', v')
    as stored."""
    import torch
    T, HQ, D = q.shape
    H = k.shape[1]
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(2) != 1:
            raise ValueError(f"rope_and_store: {name} needs unit stride over channels")
    q_out = torch.empty(T, HQ, D, dtype=q.dtype, device=q.device)
    k_out = torch.empty(T, H, D, dtype=k.dtype, device=k.device) if want_k else q_out
    v_out = torch.empty(T, H, D, dtype=v.dtype, device=v.device) if want_k and fp8_scales else q_out
    ks, vs = fp8_scales or (1.0, 1.0)
    if T:
        target = arena if fp8_scales else arena[:arena.numel() // 2 * 2].view(torch.bfloat16)
        _rope_store_kernel[(T, HQ + H)](
            q, k, v, cos.contiguous(), sin.contiguous(), q_out, k_out, v_out, target,
            page_loc_layer, page_ids, slots, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), ks, vs, HQ=HQ, H=H, D=D, STORE_K=want_k,
            FP8=fp8_scales is not None)
    if fp8_scales:
        return q_out, (k_out if want_k else None), (v_out if want_k else None)
    return q_out, (k_out if want_k else None)
