"""Linear layers over weights in the lossless BF16 weight format (docs/format.md, "Weights").

:func:`fused_linear` restores W in registers before the tensor-core dot (split-K partials summed
in a fixed order; escapes added as one more small dot): close to ``F.linear``, not bit-equal.
:func:`restore_into` / :func:`gather_rows` restore W or its rows bit for bit; :func:`weight_linear`
dispatches. CPU tensors run the kernels through the Triton interpreter (tests).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..format import triton_restore
from ..format.weights import ESC_ROWS, WEIGHT_BLOCK, CompressedWeight, restore_rows, restore_weight
from .triton_interpreter import kernel_module, same_mode
from . import triton_attention

FUSED_MAX_M = 128          # above this M, weight_linear restores and calls cuBLAS (measured faster)
RESTORE_MAX_VALUES = 1 << 28   # larger weights (vocabulary-sized) run fused in blocks of FUSED_MAX_M rows
_interleave = same_mode(triton_restore)._interleave      # prmt on the GPU, shifts under the interpreter
_dot = same_mode(triton_attention)._dot                  # fp32 operands under the interpreter


def _interpreting() -> bool:
    """True when this module's kernels were made by the Triton interpreter (CPU)."""
    return not isinstance(_fused_kernel, triton.runtime.jit.JITFunction)


def _module(device: torch.device):
    return kernel_module(device, __name__, __file__, _interpreting())


@triton.jit
def _hi_bytes(code, bh):
    """High bytes of values 0..3 and 4..7 of groups (uint32; bh = b/2): s << 7 | (bh + d), or
    s << 7 alone where d = 0 (±0)."""
    t = code & 0x07070707
    h0 = (((t + 0x7F7F7F7F) >> 7) & 0x01010101) * bh + (code & 0x87878787)
    u = (code >> 3) & 0x07070707
    h1 = (((u + 0x7F7F7F7F) >> 7) & 0x01010101) * bh + (((code << 1) & 0x80808080) | u)
    return h0, h1


@triton.jit
def _tile_words(lo_ptr, code_ptr, base_ptr, rows, rmask, k0, Kp, BK: tl.constexpr,
                NATURAL: tl.constexpr, MODE: tl.constexpr, INTERPRET: tl.constexpr):
    """The [BN, BK/8, 4] words of bf16 pairs of rows ``rows`` at K offset k0. NATURAL: word k
    holds values (2k, 2k+1), else (0, 2), (1, 3), ... (x's columns permuted to match). MODE 1-3:
    measurements only (see fused_linear)."""
    BN: tl.constexpr = rows.shape[0]
    NB: tl.constexpr = BK // 128
    Kp = tl.multiple_of(Kp, 128)                       # the format pads K: 16-byte plane loads
    r = rows[:, None, None].to(tl.int64)
    m = rmask[:, None, None]
    if MODE == 2:
        off = r * (Kp // 2) + k0 // 2 + tl.arange(0, BK // 2)[None, None, :]
        w = tl.load(lo_ptr + off, mask=m, other=0).to(tl.uint32, bitcast=True)
        return tl.reshape(w, (BN, BK // 8, 4))
    blk = tl.arange(0, NB)[None, :, None]
    gi = tl.arange(0, 16)[None, None, :]
    code = tl.load(code_ptr + r * (Kp // 8) + k0 // 8 + blk * 16 + gi, mask=m, other=0)
    lo = tl.load(lo_ptr + r * (Kp // 4) + k0 // 4 + blk * 32 + tl.arange(0, 32)[None, None, :],
                 mask=m, other=0)
    lo0, lo1 = tl.split(tl.reshape(lo.to(tl.uint32, bitcast=True), (BN, NB, 16, 2)))
    code = code.to(tl.uint32, bitcast=True)
    if MODE == 1:
        h0 = code
        h1 = code ^ lo0
    elif MODE == 3:                                    # no d = 0 test (the KV format's restore)
        bh = tl.load(base_ptr + r * (Kp // 128) + k0 // 128 + blk, mask=m, other=0).to(tl.uint32) * 0x01010101
        h0 = (code & 0x87878787) + bh
        h1 = (((code << 1) & 0x80808080) | ((code >> 3) & 0x07070707)) + bh
    else:
        bh = tl.load(base_ptr + r * (Kp // 128) + k0 // 128 + blk, mask=m, other=0).to(tl.uint32)
        h0, h1 = _hi_bytes(code, bh)
    if NATURAL:
        w0, w1, w2, w3 = _interleave(lo0, lo1, h0, h1, INTERPRET)
    else:
        w0 = (lo0 & 0x00FF00FF) | ((h0 & 0x00FF00FF) << 8)
        w1 = ((lo0 >> 8) & 0x00FF00FF) | (h0 & 0xFF00FF00)
        w2 = (lo1 & 0x00FF00FF) | ((h1 & 0x00FF00FF) << 8)
        w3 = ((lo1 >> 8) & 0x00FF00FF) | (h1 & 0xFF00FF00)
    return tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (BN, BK // 8, 4))


@triton.jit
def _to_bf16(words, BK: tl.constexpr):
    """[BN, BK/8, 4] words of bf16 pairs -> [BN, BK] bf16 (low half first)."""
    BN: tl.constexpr = words.shape[0]
    even = words.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    odd = (words >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return tl.reshape(tl.join(even, odd), (BN, BK))


@triton.jit
def _to_out(acc, INTERPRET: tl.constexpr):
    """fp32 -> bf16 rounded to nearest even (the interpreter's cast truncates: rounded by hand)."""
    if INTERPRET:
        b = acc.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        b = tl.where(acc != acc, 0x7FC0, b)
        return b.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return acc.to(tl.bfloat16)


@triton.jit(do_not_specialize=["M", "tiles_per_split"])
def _fused_kernel(x_ptr, lo_ptr, code_ptr, base_ptr, eptr_ptr, erow_ptr, ecol_ptr, eval_ptr,
                  bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, Kp, stride_xm, tiles_per_split,
                  HAS_BIAS: tl.constexpr, REDUCE: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, NATURAL: tl.constexpr,
                  SWAP: tl.constexpr, MODE: tl.constexpr, EVEN_K: tl.constexpr,
                  ECH: tl.constexpr, INTERPRET: tl.constexpr):
    """x [M, K] @ restored W [N, Kp]ᵀ over this program's K tiles -> out (REDUCE 0), or fp32
    partials summed by _reduce_kernel (1) or by the tile's last program (2: a per-tile counter)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_n * BN + tl.arange(0, BN)
    rmask = rows < N
    ms = pid_m * BM + tl.arange(0, BM)
    mmask = ms < M
    x_row = x_ptr + ms[:, None].to(tl.int64) * stride_xm
    kk = tl.arange(0, BK)
    if not NATURAL:                                    # the words' value order: swap bits 0 and 1
        kk = (kk & ~3) | ((kk >> 1) & 1) | ((kk & 1) << 1)
    if SWAP:
        acc = tl.full((BN, BM), 0.0, tl.float32)
    else:
        acc = tl.full((BM, BN), 0.0, tl.float32)
    t0 = pid_k * tiles_per_split
    t1 = tl.minimum(t0 + tiles_per_split, Kp // BK)
    for t in range(t0, t1):
        k0 = t * BK
        w = _to_bf16(_tile_words(lo_ptr, code_ptr, base_ptr, rows, rmask, k0, Kp, BK, NATURAL,
                                 MODE, INTERPRET), BK)
        cols = k0 + kk
        if EVEN_K:                                   # no column mask: 16-byte loads of x
            xt = tl.load(x_row + cols[None, :], mask=mmask[:, None], other=0.0)
        else:
            xt = tl.load(x_row + cols[None, :], mask=mmask[:, None] & (cols < K)[None, :], other=0.0)
        if SWAP:
            acc = _dot(w, tl.trans(xt), acc, INTERPRET)
        else:
            acc = _dot(xt, tl.trans(w), acc, INTERPRET)
    if pid_k == 0 and MODE == 0:                       # escapes of this program's row groups
        g0 = pid_n * (BN // 16)
        g1 = tl.minimum(g0 + BN // 16, (N + 15) // 16)
        e0 = tl.load(eptr_ptr + g0)
        e1 = tl.load(eptr_ptr + g1)
        for e in range(e0, e1, ECH):
            ei = e + tl.arange(0, ECH)
            em = ei < e1
            er = tl.load(erow_ptr + ei, mask=em, other=-1)
            ec = tl.load(ecol_ptr + ei, mask=em, other=0)
            ev = tl.load(eval_ptr + ei, mask=em, other=0).to(tl.bfloat16, bitcast=True)
            xe = tl.load(x_row + ec[None, :], mask=mmask[:, None] & em[None, :], other=0.0)
            we = tl.where(rows[:, None] == er[None, :], ev[None, :], 0.0).to(tl.bfloat16)
            if SWAP:
                acc = _dot(we, tl.trans(xe), acc, INTERPRET)
            else:
                acc = _dot(xe, tl.trans(we), acc, INTERPRET)
    if SWAP:
        acc = tl.trans(acc)
    om = mmask[:, None] & rmask[None, :]
    off = ms[:, None].to(tl.int64) * N + rows[None, :]
    if REDUCE == 0:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + off, _to_out(acc, INTERPRET), mask=om)
    else:
        tl.store(ws_ptr + pid_k.to(tl.int64) * M * N + off, acc, mask=om)
        if REDUCE == 2:
            tl.debug_barrier()                         # every thread's partial stored first
            _sum_splits(ws_ptr, cnt_ptr + pid_m * tl.num_programs(1) + pid_n, bias_ptr, out_ptr, off, om,
                        rows[None, :], M * N, HAS_BIAS, INTERPRET)


@triton.jit
def _sum_splits(ws_ptr, tile, bias_ptr, out_ptr, off, om, brow, MN, HAS_BIAS: tl.constexpr,
                INTERPRET: tl.constexpr):
    """In the split-K tile's last program to count itself in (``tile``: its counter): out = the
    partials summed in split order (+ bias at ``brow``), whoever is last; the counter back to 0."""
    if tl.atomic_add(tile, 1, sem="acq_rel", scope="gpu") == tl.num_programs(2) - 1:
        acc = tl.load(ws_ptr + off, mask=om, other=0.0, cache_modifier=".cg")
        for s in range(1, tl.num_programs(2)):
            acc += tl.load(ws_ptr + s * MN + off, mask=om, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            acc += tl.load(bias_ptr + brow, mask=om, other=0.0).to(tl.float32)
        tl.store(out_ptr + off, _to_out(acc, INTERPRET), mask=om)
        tl.atomic_xchg(tile, 0)


@triton.jit(do_not_specialize=["total"])
def _reduce_kernel(ws_ptr, bias_ptr, out_ptr, total, N, HAS_BIAS: tl.constexpr,
                   SPLIT: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    """out = Σ_s ws[s] (+ bias) in s order, as bf16."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < total
    acc = tl.load(ws_ptr + i, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(ws_ptr + s * total + i, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + i % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, _to_out(acc, INTERPRET), mask=mask)


@triton.jit(do_not_specialize=["T"])
def _restore_kernel(lo_ptr, code_ptr, base_ptr, eptr_ptr, erow_ptr, ecol_ptr, eval_ptr, ids_ptr,
                    out_ptr, T, N, K, Kp, GATHER: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, INTERPRET: tl.constexpr):
    """out[i, :K] = row src(i) of W, bit for bit: src(i) = ids[i] (GATHER, BN = 1) or i (BN = 16
    rows of one escape group). The planes first, then the escapes of the rows' groups."""
    i = tl.program_id(0) * BN + tl.arange(0, BN)
    imask = i < T
    if GATHER:
        src = tl.load(ids_ptr + i, mask=imask, other=0).to(tl.int32)
    else:
        src = i
    dst = out_ptr + i[:, None].to(tl.int64) * K
    for k0 in range(0, Kp, BK):
        w = _tile_words(lo_ptr, code_ptr, base_ptr, src, imask, k0, Kp, BK, True, 0, INTERPRET)
        w = tl.reshape(tl.join(w.to(tl.uint16), (w >> 16).to(tl.uint16)), (BN, BK))
        cols = k0 + tl.arange(0, BK)
        tl.store(dst + cols[None, :], w.to(tl.int16, bitcast=True),
                 mask=imask[:, None] & (cols < K)[None, :])
    tl.debug_barrier()                  # escapes overwrite what this program's threads stored
    if GATHER:                                          # one escape group: BN = 1, or 16 aligned rows
        grp = tl.load(ids_ptr + tl.program_id(0)).to(tl.int32) // 16
    else:
        grp = tl.program_id(0)
    e0 = tl.load(eptr_ptr + grp)
    e1 = tl.load(eptr_ptr + grp + 1)
    for e in range(e0, e1, 16):
        ei = e + tl.arange(0, 16)
        em = ei < e1
        er = tl.load(erow_ptr + ei, mask=em, other=-1)
        ec = tl.load(ecol_ptr + ei, mask=em, other=0)
        ev = tl.load(eval_ptr + ei, mask=em, other=0)
        hit = (src[:, None] == er[None, :]) & imask[:, None]
        tl.store(dst + ec[None, :], tl.broadcast_to(ev[None, :], (BN, 16)), mask=hit)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _bucket(M: int) -> int:
    return 16 if M <= 16 else 32 if M <= 32 else 64 if M <= 64 else 128


# (M bucket, wide: at least 2 tiles of 64 rows per SM) -> tile config and programs per SM, from
# sweeps (scripts/gpu/weights_tune.py).
_NARROW16 = dict(BN=32, BK=256, warps=4, stages=4, natural=True, swap=False, per_sm=2)
_SWAPPED = dict(BN=64, BK=128, warps=4, stages=3, natural=True, swap=True)
CONFIGS = {
    (16, False): _NARROW16, (16, True): dict(_SWAPPED, per_sm=2),
    (32, False): dict(_SWAPPED, per_sm=4), (32, True): dict(_SWAPPED, per_sm=8),
    (64, False): dict(_SWAPPED, per_sm=4), (64, True): dict(_SWAPPED, per_sm=2),
    (128, False): dict(_SWAPPED, per_sm=2), (128, True): dict(_SWAPPED, BN=128, warps=8, per_sm=1),
}
# the same for the Hopper kernel (weight_gemm_sm90, Gluon), from scripts/gpu/weights_round2.py's round 3
_G = dict(sm90=True, BN=64, BK=128, warps=4, stages=3, per_sm=2, natural=True, swap=True)
CONFIGS_SM90 = {
    (16, False): dict(_G, stages=4), (16, True): dict(_G, stages=4),
    (32, False): _G, (32, True): _G,
    (64, False): dict(_G, per_sm=1), (64, True): dict(_G, BN=128, warps=8, per_sm=1),
    (128, False): dict(_G, per_sm=1), (128, True): dict(_G, per_sm=1),
}


def plan(M: int, N: int, Kp: int, sms: int, hopper: bool = False, **override) -> dict:
    """The launch of ``fused_linear`` for x [M, ·] and W [N, Kp]: the config of M's bucket and
    N's width (CONFIGS, or CONFIGS_SM90 for the Hopper kernel; ``override`` wins) and a K split
    giving at most ``per_sm`` programs per SM: one wave (a partial second one leaves SMs idle)."""
    bm = _bucket(override.get("BM", M))
    table = CONFIGS_SM90 if hopper and override.get("sm90", True) else CONFIGS
    cfg = dict(table[bm, triton.cdiv(N, 64) >= 2 * sms], BM=bm, reduce=2)
    cfg.update(override)
    if Kp % cfg["BK"]:
        cfg["BK"] = WEIGHT_BLOCK
    k_tiles = Kp // cfg["BK"]
    tiles = triton.cdiv(M, cfg["BM"]) * triton.cdiv(N, cfg["BN"])
    if "split" not in cfg:
        cfg["split"] = max(1, min(k_tiles // 2, 16, (cfg["per_sm"] * sms) // tiles))
    per = triton.cdiv(k_tiles, cfg["split"])
    cfg["split"] = triton.cdiv(k_tiles, per)              # no empty splits
    cfg["tiles_per_split"] = per
    return cfg


@functools.lru_cache(maxsize=None)
def _sm90():
    """The Hopper kernel's module (Gluon), imported on first use."""
    from . import weight_gemm_sm90
    return weight_gemm_sm90


def _check(x: torch.Tensor, cw: CompressedWeight, bias):
    if not isinstance(cw, CompressedWeight):
        raise TypeError(f"cw must be a zipfusion.format.weights.CompressedWeight, got {type(cw).__name__}")
    N, K = cw.shape
    if x.dtype != torch.bfloat16 or x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"x must be a bfloat16 tensor [..., {K}] for a weight of shape {cw.shape}, "
                         f"got {x.dtype} {list(x.shape)}")
    if x.device != cw.device:
        raise ValueError(f"x is on {x.device} but the weight is on {cw.device}; move both to one device")
    if bias is not None and (bias.shape != (N,) or bias.device != x.device):
        raise ValueError(f"bias must be a tensor [{N}] on {x.device}, got {list(bias.shape)} on {bias.device}")


def fused_linear(x: torch.Tensor, cw: CompressedWeight, bias: torch.Tensor | None = None,
                 *, mode: int = 0, plain: torch.Tensor | None = None, compile_only: bool = False,
                 out: torch.Tensor | None = None, **override) -> torch.Tensor:
    """``x @ Wᵀ (+ bias)`` -> bf16, deterministic for a given M; into ``out`` (contiguous [M, N]) if
    given. ``mode`` 1-3: measurements only (1, 3 cut the restore; 2 reads ``plain`` BF16);
    ``override``: launch parameters (:func:`plan`)."""
    _check(x, cw, bias)
    lead, (N, K), Kp = x.shape[:-1], cw.shape, cw.padded_k
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if out is None:
        out = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    if M == 0 or N == 0:
        return out.view(*lead, N)
    interp = x.device.type == "cpu"
    sms = 4 if interp else _sm_count(x.device.index if x.device.index is not None else torch.cuda.current_device())
    if interp:                                       # tiny tiles: the interpreter is slow
        override = dict(dict(BN=16, BK=WEIGHT_BLOCK, BM=16), **override)
    hopper = mode == 0 and not interp and _sm90().supported(x2, cw)
    cfg = plan(M, N, Kp, sms, hopper, **override)
    m = _module(x.device)
    lo = plain.view(torch.int32) if mode == 2 else cw.lo.view(torch.int32)
    codes = cw.codes.view(torch.int32)
    split = cfg["split"]
    grid = (triton.cdiv(M, cfg["BM"]), triton.cdiv(N, cfg["BN"]), split)
    reduce = 0 if split == 1 else cfg["reduce"] if grid[0] * grid[1] <= COUNTERS else 1
    ws = torch.empty((split, M, N) if split > 1 else (1,), dtype=torch.float32, device=x.device)
    b = bias if bias is not None else out
    if hopper and cfg.get("sm90"):
        if not compile_only:         # built by its first launch (warmup runs each variant once)
            _sm90().launch(x2, cw, bias, out, ws, _counters(x.device), cfg, reduce)
    else:
        kernel = m._fused_kernel[grid]
        if compile_only:
            kernel = functools.partial(m._fused_kernel.warmup, grid=grid)
        kernel(x2, lo, codes, cw.base, cw.esc_ptr, cw.esc_row,
               cw.esc_col, cw.esc_val, b, out, ws, _counters(x.device), M, N, K, Kp,
               x2.stride(0), cfg["tiles_per_split"], HAS_BIAS=bias is not None,
               REDUCE=reduce, BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"],
               NATURAL=cfg["natural"], SWAP=cfg["swap"], MODE=mode,
               EVEN_K=K % cfg["BK"] == 0, ECH=cfg.get("ech", 16), INTERPRET=interp,
               num_warps=cfg["warps"], num_stages=cfg["stages"])
    if reduce == 1 and not compile_only:
        total, block = M * N, 1024
        m._reduce_kernel[(triton.cdiv(total, block),)](ws, b, out, total, N, HAS_BIAS=bias is not None,
                                                      SPLIT=split, BLOCK=block, INTERPRET=interp)
    return out.view(*lead, N)


def _restore_launch(cw: CompressedWeight, out: torch.Tensor, ids: torch.Tensor | None):
    T = out.shape[0]
    if T == 0:
        return out
    N, K = cw.shape
    gather = ids is not None
    bn = 1 if gather else ESC_ROWS
    m = _module(out.device)
    m._restore_kernel[(triton.cdiv(T, bn),)](
        cw.lo.view(torch.int32), cw.codes.view(torch.int32), cw.base, cw.esc_ptr, cw.esc_row,
        cw.esc_col, cw.esc_val, ids if gather else out, out.view(torch.int16), T, N, K, cw.padded_k,
        GATHER=gather, BN=bn, BK=next(b for b in (512, 256, 128) if cw.padded_k % b == 0),
        INTERPRET=out.device.type == "cpu",
        num_warps=4 if gather else 8)
    return out


def restore_into(cw: CompressedWeight, out: torch.Tensor) -> torch.Tensor:
    """W restored into ``out`` (bf16 [N, K] contiguous on cw's device), bit for bit; returns out."""
    if out.dtype != torch.bfloat16 or tuple(out.shape) != tuple(cw.shape) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous bfloat16 tensor of shape {list(cw.shape)}, "
                         f"got {out.dtype} {list(out.shape)}")
    if out.device != cw.device:
        raise ValueError(f"out is on {out.device} but the weight is on {cw.device}")
    return _restore_launch(cw, out, None)


def gather_rows(cw: CompressedWeight, ids: torch.Tensor, *, kernel: bool | None = None) -> torch.Tensor:
    """Rows ``ids`` of W restored bit for bit (bf16 [T, K]): the kernel on CUDA or with ``kernel=True``."""
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be a 1-D int32/int64 tensor, got {ids.dtype} {list(ids.shape)}")
    ids = ids.to(cw.device)
    if not (kernel if kernel is not None else cw.device.type == "cuda"):
        return restore_rows(cw, ids)
    out = torch.empty(ids.numel(), cw.shape[1], dtype=torch.bfloat16, device=cw.device)
    return _restore_launch(cw, out, ids.contiguous())


_BUFFERS: dict[torch.device, torch.Tensor] = {}
_COUNTERS: dict[torch.device, torch.Tensor] = {}
COUNTERS = 1 << 16       # split-K tiles one launch can count (more: the separate reduce kernel)


def _counters(device: torch.device) -> torch.Tensor:
    """The split-K tile counters of ``device``, left zero by each launch (one stream at a time)."""
    c = _COUNTERS.get(device)
    if c is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("weight_linear's split-K counters are made during CUDA graph capture; call "
                               "zipfusion.kernels.weight_linear.warmup first")
        c = _COUNTERS[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return c


def restore_buffer(cw: CompressedWeight) -> torch.Tensor:
    """W restored into the device's reused buffer (grown by :func:`warmup`, never during capture)."""
    n = cw.shape[0] * cw.shape[1]
    buf = _BUFFERS.get(cw.device)
    if buf is None or buf.numel() < n:
        if cw.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"weight_linear's restore buffer must grow to {n} values during CUDA "
                               "graph capture; call zipfusion.kernels.weight_linear.warmup first")
        buf = _BUFFERS[cw.device] = torch.empty(n, dtype=torch.bfloat16, device=cw.device)
    return restore_into(cw, buf[:n].view(cw.shape))


def weight_linear(x: torch.Tensor, cw: CompressedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for W stored in the weight format: on CUDA the fused kernel up to
    :data:`FUSED_MAX_M` rows, else a restore into a reused buffer and cuBLAS; on the CPU the torch
    restore and ``F.linear`` (bit for bit the uncompressed result)."""
    _check(x, cw, bias)
    if x.device.type != "cuda":
        return torch.nn.functional.linear(x, restore_weight(cw), bias)
    M = x.numel() // max(1, x.shape[-1])
    if M <= FUSED_MAX_M:
        return fused_linear(x, cw, bias)
    if cw.shape[0] * cw.shape[1] > RESTORE_MAX_VALUES:     # LM head, tied embedding: no buffer that large
        x2 = x.reshape(-1, x.shape[-1])
        out = torch.empty(M, cw.shape[0], dtype=torch.bfloat16, device=x.device)
        for i in range(0, M, FUSED_MAX_M):
            fused_linear(x2[i:i + FUSED_MAX_M], cw, bias, out=out[i:i + FUSED_MAX_M])
        return out.view(*x.shape[:-1], cw.shape[0])
    return torch.nn.functional.linear(x, restore_buffer(cw), bias)


def warmup(layers, max_m: int) -> None:
    """Build every fused-kernel variant for ``(weight, bias)`` pairs up to ``max_m`` rows (the
    Triton kernel's in parallel threads, then each launched once), with the restore buffer and
    counters, so CUDA graph capture builds nothing."""
    calls, seen = [], set()
    top = max(1, min(max_m, FUSED_MAX_M))
    for cw, bias in layers:
        key = (cw.shape, cw.device, bias is not None)
        if cw.device.type != "cuda" or key in seen:
            continue
        seen.add(key)
        b = None if bias is None else torch.zeros_like(bias)
        for m in sorted({_bucket(m) for m in (1, 32, 64, 128) if m <= top}):
            calls.append((torch.zeros(m, cw.shape[1], dtype=torch.bfloat16, device=cw.device), cw, b))
    if not calls:
        return
    from concurrent.futures import ThreadPoolExecutor
    from triton.runtime._async_compile import AsyncCompileMode
    with ThreadPoolExecutor(max_workers=min(16, len(calls))) as pool, AsyncCompileMode(pool):
        for x, cw, b in calls:
            fused_linear(x, cw, b, compile_only=True)
    for x, cw, b in calls:
        fused_linear(x, cw, b)
    if max_m > FUSED_MAX_M:
        for cw in {id(cw): cw for _, cw, _ in calls}.values():
            if cw.shape[0] * cw.shape[1] <= RESTORE_MAX_VALUES:
                restore_buffer(cw)
    torch.cuda.empty_cache()             # the build's scratch back: the KV budget is sized from what is free
