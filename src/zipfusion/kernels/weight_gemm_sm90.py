"""The fused decompress-GEMM for Hopper (sm_90), in Gluon: ``x @ Wᵀ`` over the weight format with the
restore overlapping the tensor cores, which Triton's own pipeliner does not do for an MMA operand
computed in the loop.

Each program owns BN weight rows, BM rows of x and a run of K tiles. Bulk tensor copies bring the
lo / code planes and x into a ring of STAGES shared-memory stages; the warpgroup restores a tile in
registers into one of two shared-memory buffers and issues an asynchronous wgmma on it, keeping one
in flight, so restoring tile i+1 overlaps the MMA of tile i. Escapes and the split-K reduction are as
in :func:`zipfusion.kernels.weight_linear.fused_linear`, whose Triton kernel is this one's CPU twin
(the same sums up to the order of the fp32 additions).
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..format.triton_restore import _interleave
from .weight_linear import _hi_bytes, _sum_splits

BK = 128        # values of a K tile: one base byte per row


@gluon.jit
def _restore_rows(lo_s, code_s, w_s, base_ptr, rows0, rmax, t, Kp, RC: gl.constexpr, num_warps: gl.constexpr):
    """Rows rows0.. of one staged tile restored into ``w_s`` (int32 words of bf16 pairs), RC at a time."""
    BN: gl.constexpr = lo_s.shape[0]
    G: gl.constexpr = lo_s.shape[1]                  # groups of 8 values a row
    RL: gl.constexpr = gl.BlockedLayout([1, 1], [32 // G, G], [num_warps, 1], [1, 0])
    for r0 in gl.static_range(0, BN, RC):
        lo = lo_s.slice(r0, RC, dim=0).load(RL)
        code = code_s.slice(r0, RC, dim=0).load(RL).to(gl.uint32, bitcast=True)
        rows = rows0 + r0 + gl.arange(0, RC, layout=gl.SliceLayout(1, RL))
        bh = gl.load(base_ptr + rows.to(gl.int64) * (Kp // 128) + t, mask=rows < rmax, other=0).to(gl.uint32)
        h0, h1 = _hi_bytes(code, bh[:, None])
        lo0 = lo.to(gl.uint32)
        lo1 = (lo >> 32).to(gl.uint32)
        w0, w1, w2, w3 = _interleave(lo0, lo1, h0, h1, False)
        w = gl.reshape(gl.join(gl.join(w0, w2), gl.join(w1, w3)), [RC, 4 * G])
        w_s.slice(r0, RC, dim=0).store(w.to(gl.int32, bitcast=True))


@gluon.jit
def _load_stage(x_desc, lo_desc, code_desc, x_s, lo_s, code_s, bar, off_m, off_n, t, pred):
    mbarrier.expect(bar, x_desc.block_type.nbytes + lo_desc.block_type.nbytes + code_desc.block_type.nbytes, pred)
    g = t * (x_desc.block_type.shape[1] // 8)
    tma.async_copy_global_to_shared(lo_desc, [off_n, g], bar, lo_s, pred)
    tma.async_copy_global_to_shared(code_desc, [off_n, g], bar, code_s, pred)
    tma.async_copy_global_to_shared(x_desc, [off_m, t * x_desc.block_type.shape[1]], bar, x_s, pred)


@gluon.jit
def _escape_tile(x_ptr, erow_ptr, ecol_ptr, eval_ptr, w_s, x_s, off_n, off_m, M, stride_xm, e, e1,
                 RC: gl.constexpr, num_warps: gl.constexpr):
    """Escapes e.. (up to TK of them) as one more K tile: W's columns one per escape (its value in its
    row, zeros elsewhere), x's the columns the escapes sit in; RC rows at a time."""
    BN: gl.constexpr = w_s.shape[0]
    TK: gl.constexpr = w_s.shape[1]
    BM: gl.constexpr = x_s.shape[0]
    L: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [num_warps, 1], [1, 0])
    ei = e + gl.arange(0, TK, layout=gl.SliceLayout(0, L))
    em = ei < e1
    er = gl.load(erow_ptr + ei, mask=em, other=-1)
    ev = gl.load(eval_ptr + ei, mask=em, other=0).to(gl.bfloat16, bitcast=True)
    ec = gl.load(ecol_ptr + ei, mask=em, other=0)
    for r0 in gl.static_range(0, BN, RC):
        rows = off_n + r0 + gl.arange(0, RC, layout=gl.SliceLayout(1, L))
        w_s.slice(r0, RC, dim=0).store(gl.where(rows[:, None] == er[None, :], ev[None, :], 0.0).to(gl.bfloat16))
    MC: gl.constexpr = BM if BM < RC else RC
    for m0 in gl.static_range(0, BM, MC):
        ms = off_m + m0 + gl.arange(0, MC, layout=gl.SliceLayout(1, L))
        x_s.slice(m0, MC, dim=0).store(
            gl.load(x_ptr + ms[:, None].to(gl.int64) * stride_xm + ec[None, :], mask=(ms < M)[:, None] & em[None, :],
                    other=0.0))


@gluon.jit(do_not_specialize=["M", "tiles_per_split"])
def _kernel(x_desc, lo_desc, code_desc, x_ptr, base_ptr, eptr_ptr, erow_ptr, ecol_ptr, eval_ptr, bias_ptr,
            out_ptr, ws_ptr, cnt_ptr, M, N, Kp, stride_xm, tiles_per_split,
            HAS_BIAS: gl.constexpr, REDUCE: gl.constexpr, STAGES: gl.constexpr, RC: gl.constexpr,
            num_warps: gl.constexpr):
    BM: gl.constexpr = x_desc.block_type.shape[0]
    TK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = lo_desc.block_type.shape[0]
    G: gl.constexpr = lo_desc.block_type.shape[1]
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    pid_k = gl.program_id(2)
    off_m = pid_m * BM
    off_n = pid_n * BN
    t0 = pid_k * tiles_per_split
    n_t = gl.minimum(t0 + tiles_per_split, Kp // TK) - t0

    x_s = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, TK], x_desc.layout)
    lo_s = gl.allocate_shared_memory(lo_desc.dtype, [STAGES, BN, G], lo_desc.layout)
    code_s = gl.allocate_shared_memory(code_desc.dtype, [STAGES, BN, G], code_desc.layout)
    W32: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    W16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    w_s = gl.allocate_shared_memory(gl.int32, [2, BN, TK // 2], W32)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for q in gl.static_range(STAGES):
        mbarrier.init(bars.index(q), count=1)
    for q in gl.static_range(STAGES - 1):
        _load_stage(x_desc, lo_desc, code_desc, x_s.index(q), lo_s.index(q), code_s.index(q), bars.index(q),
                    off_m, off_n, t0 + q, q < n_t)

    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BM, 16])
    g0 = pid_n * (BN // 16)                          # escapes: program 0 of the K split, TK a tile
    e0 = gl.load(eptr_ptr + g0)
    e1 = gl.load(eptr_ptr + gl.minimum(g0 + BN // 16, (N + 15) // 16))
    n_e = gl.where(pid_k == 0, gl.cdiv(e1 - e0, TK), 0)
    acc = gl.zeros([BN, BM], gl.float32, ACC)
    for i in range(gl.maximum(n_t + n_e, 1)):        # n_t >= 1 (plan leaves no split empty): no zero-trip path
        s = i % STAGES
        wb = w_s.index(i % 2)
        if i < n_t:
            mbarrier.wait(bars.index(s), (i // STAGES) & 1)
            _restore_rows(lo_s.index(s), code_s.index(s), wb, base_ptr, off_n, N, t0 + i, Kp, RC, num_warps)
        else:                                        # its stage's last MMA (tile i - STAGES) is done
            _escape_tile(x_ptr, erow_ptr, ecol_ptr, eval_ptr, wb._reinterpret(gl.bfloat16, [BN, TK], W16),
                         x_s.index(s), off_n, off_m, M, stride_xm, e0 + (i - n_t) * TK, e1, RC, num_warps)
        fence_async_shared()
        gl.thread_barrier()
        acc = warpgroup_mma(wb._reinterpret(gl.bfloat16, [BN, TK], W16), x_s.index(s).permute((1, 0)), acc,
                            is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        j = i + STAGES - 1                           # its stage held tile i - 1, whose MMA is done
        sj = j % STAGES
        _load_stage(x_desc, lo_desc, code_desc, x_s.index(sj), lo_s.index(sj), code_s.index(sj), bars.index(sj),
                    off_m, off_n, t0 + j, j < n_t)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    for q in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(q))
    if REDUCE == 0:
        rows = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, ACC))
        ms = off_m + gl.arange(0, BM, layout=gl.SliceLayout(0, ACC))
        om = (ms < M)[None, :] & (rows < N)[:, None]
        off = ms[None, :].to(gl.int64) * N + rows[:, None]
        if HAS_BIAS:
            acc += gl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(gl.float32)[:, None]
        gl.store(out_ptr + off, acc.to(gl.bfloat16), mask=om)
    else:
        OL: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [1, num_warps], [0, 1])
        r2 = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, OL))
        m2 = off_m + gl.arange(0, BM, layout=gl.SliceLayout(0, OL))
        om2 = (m2 < M)[None, :] & (r2 < N)[:, None]
        off2 = m2[None, :].to(gl.int64) * N + r2[:, None]
        gl.store(ws_ptr + pid_k.to(gl.int64) * M * N + off2, gl.convert_layout(acc, OL), mask=om2)
        if REDUCE == 2:
            gl.thread_barrier()                      # every thread's partial stored first
            _sum_splits(ws_ptr, cnt_ptr + pid_m * gl.num_programs(1) + pid_n, bias_ptr, out_ptr, off2, om2,
                        r2[:, None], M * N, HAS_BIAS, False)


@functools.lru_cache(maxsize=None)
def _layout(block: tuple, dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), dtype)


@functools.lru_cache(maxsize=None)
def _hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


def supported(x2: torch.Tensor, cw) -> bool:
    """Whether this kernel can take x [M, K] and W: a Hopper GPU and bulk-copy-aligned rows."""
    N, K = cw.shape
    return (x2.is_cuda and _hopper(x2.device) and K % 8 == 0
            and x2.stride(0) % 8 == 0 and x2.data_ptr() % 16 == 0 and cw.padded_k % BK == 0
            and cw.lo.data_ptr() % 16 == 0 and cw.codes.data_ptr() % 16 == 0)


def launch(x2, cw, bias, out, ws, counters, cfg, reduce):
    """Runs the kernel for x2 [M, K] -> out [M, N] under ``cfg`` (weight_linear.plan's keys BM, BN,
    warps, stages, split, tiles_per_split; BK is this kernel's)."""
    M, K = x2.shape
    N, Kp = cw.shape[0], cw.padded_k
    bm, bn, g = cfg["BM"], cfg["BN"], BK // 8
    xd = TensorDescriptor(x2, [M, K], [x2.stride(0), 1], [bm, BK], _layout((bm, BK), gl.bfloat16))
    lo = cw.lo.view(torch.int64)
    codes = cw.codes.view(torch.int32)
    lod = TensorDescriptor(lo, [N, Kp // 8], [Kp // 8, 1], [bn, g], _layout((bn, g), gl.int64))
    cd = TensorDescriptor(codes, [N, Kp // 8], [Kp // 8, 1], [bn, g], _layout((bn, g), gl.int32))
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn), cfg["split"])
    args = (xd, lod, cd, x2, cw.base, cw.esc_ptr, cw.esc_row, cw.esc_col, cw.esc_val,
            bias if bias is not None else out, out, ws, counters, M, N, Kp, x2.stride(0), cfg["tiles_per_split"])
    kw = dict(HAS_BIAS=bias is not None, REDUCE=reduce, STAGES=cfg["stages"], RC=cfg.get("rc", 32),
              num_warps=cfg["warps"])
    _kernel[grid](*args, **kw)
