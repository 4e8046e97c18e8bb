"""Paged decode attention over the KV arena: the entry points, their checks and the choice of kernel
(CUDA C++ where it applies, else Triton). ``split_pages`` makes results batch-invariant; packed
requests (``spans``) carry several rows behind shared pages (attention/packing.py).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..config import environment
from ..format.layout import PAGE_TOKENS, PageLayout, loc_is_compressed, loc_is_open, loc_offset
from . import cuda_attention
from .splits import check_split_args
from .triton_attention import decode_attention_triton

LOG2E = 1.4426950408889634
BACKENDS = ("auto", "cuda", "triton")


def check_tensors(layout, arena, **tensors):
    """The layout is a PageLayout; every named input is a tensor on the arena's device."""
    if not isinstance(layout, PageLayout):
        raise TypeError(f"layout must be a zipfusion.format.PageLayout, got {type(layout).__name__}")
    for name, x in (("arena", arena), *tensors.items()):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.device != arena.device:
            raise ValueError(f"{name} is on {x.device} but the arena is on {arena.device}; "
                             "move every input to the arena's device")


def check_q_and_arena(q, arena, page_loc_layer, layout, rows: str):
    """q [rows, num_q_heads, D] bf16, the arena and its page locations."""
    H, D = layout.num_kv_heads, layout.head_dim
    if q.dtype != torch.bfloat16:
        raise TypeError(f"q must be torch.bfloat16, got {q.dtype}")
    if q.dim() != 3 or q.shape[2] != D or q.shape[1] % H != 0:
        raise ValueError(f"q must be [{rows}, num_q_heads, {D}] with num_q_heads a multiple of "
                         f"num_kv_heads={H}, got {list(q.shape)}")
    if arena.dtype != torch.uint8 or arena.dim() != 1 or not arena.is_contiguous():
        raise TypeError(f"arena must be a contiguous 1-D torch.uint8 tensor, got {arena.dtype} "
                        f"{list(arena.shape)}")
    if page_loc_layer.dtype != torch.int64 or page_loc_layer.dim() != 1:
        raise TypeError("page_loc_layer must be a 1-D torch.int64 tensor (page_loc[layer]), got "
                        f"{page_loc_layer.dtype} {list(page_loc_layer.shape)}")
    if not page_loc_layer.is_contiguous():
        raise ValueError("page_loc_layer must be contiguous")


def check_block_table(block_table, rows: int, rows_name: str):
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != rows:
        raise TypeError(f"block_table must be torch.int32 [{rows_name}={rows}, "
                        f"max_pages_per_request], got {block_table.dtype} "
                        f"{list(block_table.shape)}")
    if block_table.stride(1) != 1:
        raise ValueError("block_table rows must be contiguous; call .contiguous() first")


def check_scale_and_out(sm_scale, out, q, dtypes=(torch.bfloat16,)):
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (float, int)) \
            or not math.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale must be a positive finite float, got {sm_scale!r}")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype not in dtypes \
                or out.shape != q.shape or out.device != q.device or not out.is_contiguous():
            names = " or ".join(str(t).removeprefix("torch.") for t in dtypes)
            raise ValueError(f"out must be a contiguous {names} tensor of shape {list(q.shape)} on "
                             f"{q.device}")


def _check_inputs(q, arena, page_loc_layer, block_table, context_lens, layout, sm_scale, out):
    check_tensors(layout, arena, q=q, page_loc_layer=page_loc_layer, block_table=block_table,
                  context_lens=context_lens)
    check_q_and_arena(q, arena, page_loc_layer, layout, "batch")
    B = q.shape[0]
    check_block_table(block_table, B, "batch")
    if context_lens.dtype != torch.int32 or tuple(context_lens.shape) != (B,):
        raise TypeError(f"context_lens must be torch.int32 [batch={B}], got "
                        f"{context_lens.dtype} {list(context_lens.shape)}")
    check_scale_and_out(sm_scale, out, q)


def page_faults(arena, page_loc_layer, block_table, context_lens, layout, open_only: str | None):
    """What a kernel would read wrongly (bad context lengths, page ids, locations, a compressed
    partial last page), as (message, device bool) pairs, with no host sync (CUDA-graph safe).
    ``open_only``: the uncompressed entry point's name (every page must be open)."""
    if context_lens.numel() == 0:
        return []
    W, n = block_table.shape[1], page_loc_layer.numel()
    lens = context_lens.to(torch.int64)
    n_pages = ((lens + PAGE_TOKENS - 1) // PAGE_TOKENS).clamp(0, W)
    used = torch.arange(W, device=lens.device)[None, :] < n_pages[:, None]
    ids = block_table.to(torch.int64)
    bad_id = used & ((ids < 0) | (ids >= n))
    loc = page_loc_layer[ids.clamp(0, n - 1)]
    live = used & ~bad_id & (loc >= 0)
    is_open, start = loc_is_open(loc), loc_offset(loc)
    end = torch.where(is_open, start + layout.open_page_bytes, start + layout.min_page_bytes)
    last = loc.gather(1, (n_pages - 1).clamp(min=0)[:, None])[:, 0]
    faults = [
        (lambda: f"context_lens must be in 1..{PAGE_TOKENS * W} (16 x the block_table width); got min "
                 f"{int(lens.min())}, max {int(lens.max())}",
         ((lens < 1) | (lens > PAGE_TOKENS * W)).any()),
        (f"block_table holds page ids outside 0..{n - 1} for pages inside the context", bad_id.any()),
        ("a page inside the context has page_loc = -1 (no page)", (used & ~bad_id & (loc < 0)).any()),
        ("page locations must be 16-byte aligned (format/layout.py: the page-location tag)",
         (live & (start % 16 != 0)).any()),
        ("a page location points past the end of the arena", (live & (end > arena.numel())).any()),
        ("the last, partial page of a request must be open (uncompressed)",
         ((lens % PAGE_TOKENS != 0) & (last >= 0) & loc_is_compressed(last)).any()),
    ]
    if open_only:
        faults.append((f"{open_only} reads open pages only; use the fused kernel for compressed pages",
                       (live & ~is_open).any()))
    return faults


def check_ids(arena, page_loc_layer, block_table, context_lens, layout, open_only: str | None):
    """:func:`page_faults` read on the host (one device sync): ValueError naming the first."""
    for message, fault in page_faults(arena, page_loc_layer, block_table, context_lens, layout, open_only):
        if bool(fault):
            raise ValueError(message() if callable(message) else message)


def check_ids_async(arena, page_loc_layer, block_table, context_lens, layout, open_only: str | None) -> None:
    """:func:`page_faults` asserted on the device (``check_pages``): a device-side assert
    instead of a kernel reading garbage or spinning on a bad address."""
    faults = page_faults(arena, page_loc_layer, block_table, context_lens, layout, open_only)
    if faults:
        torch._assert_async(~torch.stack([f for _, f in faults]).any())


def uses_cuda_kernel(backend, device, layout, group: int) -> bool:
    """Whether the CUDA C++ kernel serves a call on ``device`` (CUDA, head_dim 64, 128 or 256,
    group <= 16, nvcc), else Triton; ``backend`` or $ZIPFUSION_DECODE_KERNEL forces one."""
    backend = backend or environment().decode_kernel
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton":
        return False
    reason = cuda_attention.unsupported_reason(torch.device(device), layout.head_dim, group)
    if backend == "cuda" and reason:
        raise cuda_attention.CudaKernelUnavailable(
            f"backend='cuda' was asked for but {reason}; use backend='triton' or 'auto'")
    return reason is None


def check_spans(spans, slot_heads, q, layout, context_lens, validate: bool) -> None:
    """Check a packed launch's ``spans`` [B, R, 2] and ``slot_heads`` (``validate``: on the host too)."""
    G = q.shape[1] // layout.num_kv_heads
    if isinstance(slot_heads, bool) or not isinstance(slot_heads, int) or slot_heads < 1 or G % slot_heads:
        raise ValueError(f"slot_heads must be a positive int dividing the GQA group of {G}, got {slot_heads!r}")
    R = G // slot_heads
    if not isinstance(spans, torch.Tensor) or spans.dtype != torch.int32 \
            or tuple(spans.shape) != (q.shape[0], R, 2) or not spans.is_contiguous() or spans.device != q.device:
        raise TypeError(f"spans must be a contiguous torch.int32 [{q.shape[0]}, {R}, 2] tensor on {q.device}, "
                        f"got {getattr(spans, 'dtype', type(spans).__name__)} {list(getattr(spans, 'shape', []))}")
    if validate and spans.numel():
        sp, lens = spans.cpu().to(torch.int64), context_lens.cpu().to(torch.int64)
        lo, hi = sp[..., 0], sp[..., 1]
        bad = (lo % PAGE_TOKENS != 0) | (lo > hi) | (hi > lens[:, None]) | ((lo < lo[:, :1]) & (lo < hi))
        if bool(bad.any()):
            b = int(bad.any(1).nonzero()[0])
            raise ValueError(f"spans of packed request {b} are {sp[b].tolist()} (context {int(lens[b])}): each "
                             "slot's own tokens [begin, end) must begin at a page boundary, at or after the "
                             "shared tokens [0, begin_0) (unless empty), and end within the context")


def packed_rows(q, block_table, context_lens, spans, slot_heads: int, num_kv_heads: int):
    """A packed launch's non-empty slots as plain rows (host work):
    ``(which, q, block_table, context_lens)``."""
    B, R = spans.shape[:2]
    H, G, D = num_kv_heads, slot_heads, q.shape[2]
    rows_q = q.view(B, H, R, G, D).transpose(1, 2).reshape(B * R, H * G, D)
    sp, lens, table = spans.cpu().numpy(), context_lens.cpu().numpy(), block_table.cpu().numpy()
    which, tables, ctx = [], [], []
    for b in range(B):
        shared = int(sp[b, 0, 0])
        for r in range(R):
            lo, hi = (int(x) for x in sp[b, r])
            if shared + hi - lo == 0:
                continue
            own = table[b, lo // PAGE_TOKENS:-(-hi // PAGE_TOKENS)] if hi > lo else table[b, :0]
            which.append(b * R + r)
            tables.append(np.concatenate([table[b, :shared // PAGE_TOKENS], own]))
            ctx.append(shared + hi - lo)
    width = max((len(t) for t in tables), default=1)
    rows_table = np.zeros((len(tables), width), dtype=np.int32)
    for i, t in enumerate(tables):
        rows_table[i, :len(t)] = t
    dev = q.device
    idx = torch.tensor(which, dtype=torch.int64, device=dev)
    return (idx, rows_q[idx].contiguous(), torch.from_numpy(rows_table).to(dev),
            torch.tensor(ctx, dtype=torch.int32, device=dev))


def _launch(compressed, q, arena, page_loc_layer, block_table, context_lens, layout, sm_scale,
            out, validate, backend, num_splits, split_pages, tile_pages, num_warps, stages, tma,
            producer=None, spans=None, slot_heads=None, window=None, softcap=None):
    _check_inputs(q, arena, page_loc_layer, block_table, context_lens, layout, sm_scale, out)
    if window is not None or softcap is not None:
        if spans is not None:
            raise ValueError("packed requests (spans) take no sliding window or soft-capping")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be a positive int (keys seen), got {window!r}")
        if softcap is not None and not float(softcap) > 0:
            raise ValueError(f"softcap must be a positive number, got {softcap!r}")
        if backend == "cuda":
            raise ValueError("the CUDA C++ kernel takes no sliding window or soft-capping; use backend='triton' or 'auto'")
        backend = "triton"
    check_split_args(num_splits, split_pages)
    if spans is not None:
        check_spans(spans, slot_heads, q, layout, context_lens, validate)
    if validate:                  # (a packed launch's padding requests have no keys: length 0)
        keep = context_lens > 0 if spans is not None else slice(None)
        check_ids(arena, page_loc_layer, block_table[keep], context_lens[keep], layout,
                  None if compressed else "decode_attention_uncompressed")
    q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    args = (q, arena, page_loc_layer, block_table, context_lens, layout.num_kv_heads,
            float(sm_scale) * LOG2E, out)
    if uses_cuda_kernel(backend, q.device, layout, q.shape[1] // layout.num_kv_heads):
        return cuda_attention.decode_attention_cuda(
            *args, compressed=compressed, num_splits=num_splits, split_pages=split_pages,
            stages=stages, tma=tma, producer=producer, spans=spans, slot_heads=slot_heads or 0)
    triton_args = dict(compressed=compressed, num_splits=num_splits, split_pages=split_pages,
                       tile_pages=tile_pages, num_warps=num_warps, window=window, softcap=softcap)
    if spans is None:
        return decode_attention_triton(*args, **triton_args)
    # packed: each slot as a plain row, back in the packed layout (empty slots: zeros)
    H, R = layout.num_kv_heads, spans.shape[1]
    which, rq, rtable, rlens = packed_rows(q, block_table, context_lens, spans, slot_heads, H)
    rows_out = torch.zeros(q.shape[0] * R, H * slot_heads, q.shape[2], dtype=q.dtype, device=q.device)
    if which.numel():
        rows_out[which] = decode_attention_triton(rq, arena, page_loc_layer, rtable, rlens, H,
                                                  float(sm_scale) * LOG2E, torch.empty_like(rq),
                                                  **triton_args)
    B, G, D = q.shape[0], slot_heads, q.shape[2]
    out.copy_(rows_out.view(B, R, H, G, D).transpose(1, 2).reshape(B, H * R * G, D))
    return out


def decode_attention(q, arena, page_loc_layer, block_table, context_lens, layout, sm_scale,
                     out=None, *, num_splits: int | None = None, split_pages: int | None = None,
                     validate: bool = True, backend: str | None = None,
                     tile_pages: int | None = None, num_warps: int | None = None,
                     stages: int | None = None, tma: bool | None = None,
                     producer: bool | None = None, spans: torch.Tensor | None = None,
                     slot_heads: int | None = None, window: int | None = None, softcap: float | None = None):
    """Paged decode attention over open and compressed pages -> [B, Hq, D] bf16. ``validate`` checks
    ids and locations (a sync); ``split_pages`` fixes each split's pages (batch-invariant);
    ``window`` and ``softcap`` run the Triton kernel; the rest tunes the kernels."""
    return _launch(True, q, arena, page_loc_layer, block_table, context_lens, layout, sm_scale,
                   out, validate, backend, num_splits, split_pages, tile_pages, num_warps,
                   stages, tma, producer, spans, slot_heads, window, softcap)


def decode_attention_uncompressed(q, arena, page_loc_layer, block_table, context_lens, layout, sm_scale,
                          out=None, *, num_splits: int | None = None,
                          split_pages: int | None = None, validate: bool = True,
                          backend: str | None = None, tile_pages: int | None = None,
                          num_warps: int | None = None, stages: int | None = None,
                          tma: bool | None = None, producer: bool | None = None,
                          spans: torch.Tensor | None = None, slot_heads: int | None = None,
                          window: int | None = None, softcap: float | None = None):
    """The uncompressed kernel: every page must be open; :func:`decode_attention`'s arguments
    and bits."""
    return _launch(False, q, arena, page_loc_layer, block_table, context_lens, layout, sm_scale,
                   out, validate, backend, num_splits, split_pages, tile_pages, num_warps,
                   stages, tma, producer, spans, slot_heads, window, softcap)
