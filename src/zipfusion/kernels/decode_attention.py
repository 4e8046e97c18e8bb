"""Paged decode attention over the zipfusion KV arena (Triton), fused with the page decoder.

One query token per request. The KV cache lives in one ``uint8`` arena (docs/design.md): a page
is either *open* (``[2, 16, H, D]`` bf16, ``page_loc = offset | 1``) or *compressed*
(docs/format.md, ``page_loc = offset``). The fused kernel restores compressed blocks to BF16 in
registers -- nothing decompressed is written to global memory -- and runs flash-decoding on them.

Work split (flash decoding). Program ``(b, h, s)`` takes request ``b``, KV head ``h`` and the
``s``-th slice of that request's pages; it serves all ``G = Hq / H`` query heads of the group at
once (the GQA group is the M dimension of the tensor-core dots, padded to 16). Per tile of
``TP`` pages (``R = 16·TP`` token rows) it computes, with ``q`` pre-scaled by
``sm_scale·log2(e)`` so that ``exp2`` can be used::

    S   = q · Kᵀ                          [G, R]   (bf16 operands, fp32 accumulate)
    m'  = max(m, rowmax S)
    P   = 2^(S - m')                      masked tokens -> 0
    l   = l · 2^(m - m') + rowsum P
    acc = acc · 2^(m - m') + P_bf16 · V   [G, D]

At the end a slice stores ``o = acc / l`` and ``lse = m + log2 l``; a merge kernel combines the
slices: ``out = Σ_s 2^(lse_s - M) o_s / Σ_s 2^(lse_s - M)``, ``M = max_s lse_s``.

Restoring a compressed block (docs/format.md section 2). A group of 8 values (8 consecutive
channels of one token) is two 32-bit words of low bytes ``lo_0123, lo_4567`` and one word ``w``
of 4-bit codes. Four high bytes at a time::

    hi_0123 = (w & 0x87878787) + (b/2)·0x01010101
    hi_4567 = ((w << 1) & 0x80808080 | (w >> 3) & 0x07070707) + (b/2)·0x01010101

and byte interleaving (``prmt`` selectors 0x5140 and 0x7362) makes bf16 pairs
``(lo_0, hi_0, lo_1, hi_1)`` = channels (c, c+1) as one 32-bit word, exactly the word an open
page or a raw block holds at that place. So every source -- open page, raw block, compressed
block -- yields the same tile of 32-bit words, split into the same bf16 tile: the arithmetic
after that point is shared, and the output is bit-identical whether a page is open or
compressed. The uncompressed *twin* (``decode_attention_twin``) is the same kernel with the
tile loaded straight as bf16 from open pages (same tile, same dots, same order).

Under ``TRITON_INTERPRET=1`` (CPU) ``prmt`` is replaced by shifts and masks, and the dots run on
fp32-upcast operands (exact for bf16 products; the interpreter's bf16 dot is wrong).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ..format.layout import PAGE_TOKENS, PageLayout

LOG2E = 1.4426950408889634
MODE_TWIN = 0     # open pages only, tile loaded as bf16
MODE_FUSED = 1    # open or compressed pages, tile restored from 32-bit words


def _interpreting() -> bool:
    """True when this module's kernels were created by the Triton interpreter (CPU)."""
    return not isinstance(_decode_attention_kernel, triton.runtime.jit.JITFunction)


_INTERPRETED = []
LAST_COMPILED = {}     # mode -> the last launched compiled kernel (registers, spills)


def _kernels(device: torch.device):
    """(attention kernel, merge kernel, interpreted?) for tensors on ``device``.

    Whether ``triton.jit`` interprets is fixed when this module is imported (TRITON_INTERPRET);
    for CPU tensors in a compiled import, a second copy of the module is loaded in interpreter
    mode.
    """
    interp = _interpreting()
    if device.type == "cuda":
        if interp:
            raise RuntimeError("zipfusion.kernels was imported with TRITON_INTERPRET=1 and cannot "
                               "run on CUDA tensors; unset TRITON_INTERPRET before importing it")
        return _decode_attention_kernel, _merge_kernel, False
    if device.type != "cpu":
        raise ValueError(f"the attention kernels run on CUDA (or on the CPU through the Triton "
                         f"interpreter), got tensors on {device}")
    if interp:
        return _decode_attention_kernel, _merge_kernel, True
    if not _INTERPRETED:
        import importlib.util
        spec = importlib.util.spec_from_file_location(__package__ + "._decode_attention_interp",
                                                      __file__)
        module = importlib.util.module_from_spec(spec)
        old = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            spec.loader.exec_module(module)
        finally:
            if old is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = old
        _INTERPRETED.append(module)
    m = _INTERPRETED[0]
    return m._decode_attention_kernel, m._merge_kernel, True


# ------------------------------------------------------------------------------------------
# Restoring 32-bit words of bf16 pairs
# ------------------------------------------------------------------------------------------

@triton.jit
def _pair01(lo, hi, USE_ASM: tl.constexpr):
    """Bytes (lo0, hi0, lo1, hi1): bf16 values 0 and 1 of four, as one 32-bit word."""
    if USE_ASM:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x5140;", "=r,r,r", [lo, hi],
                                         dtype=tl.uint32, is_pure=True, pack=1)
    else:
        return (lo & 0xFF) | ((hi & 0xFF) << 8) | ((lo & 0xFF00) << 8) | ((hi & 0xFF00) << 16)


@triton.jit
def _pair23(lo, hi, USE_ASM: tl.constexpr):
    """Bytes (lo2, hi2, lo3, hi3): bf16 values 2 and 3 of four, as one 32-bit word."""
    if USE_ASM:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x7362;", "=r,r,r", [lo, hi],
                                         dtype=tl.uint32, is_pure=True, pack=1)
    else:
        return ((lo >> 16) & 0xFF) | ((hi >> 8) & 0xFF00) | (lo & 0xFF000000) >> 8 \
            | (hi & 0xFF000000)


@triton.jit
def _restore_words(arena32, lo_w, code_w, plain_w, hb, packed, valid,
                   C: tl.constexpr, USE_ASM: tl.constexpr):
    """Words of bf16 pairs for items of ``8·C`` values (C groups of 8 consecutive channels).

    All index inputs are [R, NI, 1] tensors (one item per row and block): word offsets into the
    arena of the item's low bytes (``2C`` words), codes (``C`` words) and plain bf16 words
    (``4C`` words, used for open pages and raw blocks), ``hb = (b/2)·0x01010101``, whether the
    item is compressed, whether the row is a real token. Returns uint32 [R, NI, 4C]: word ``w``
    holds channels ``2w`` (low half) and ``2w + 1`` (high half) of the item.
    """
    R: tl.constexpr = lo_w.shape[0]
    NI: tl.constexpr = lo_w.shape[1]
    pm = valid & packed
    code = tl.load(arena32 + code_w + tl.arange(0, C)[None, None, :], mask=pm, other=0)
    lo = tl.load(arena32 + lo_w + tl.arange(0, 2 * C)[None, None, :], mask=pm, other=0)
    plain = tl.load(arena32 + plain_w + tl.arange(0, 4 * C)[None, None, :],
                    mask=valid & (packed == 0), other=0)
    code = code.to(tl.uint32, bitcast=True)
    lo = lo.to(tl.uint32, bitcast=True)
    plain = plain.to(tl.uint32, bitcast=True)
    # high bytes of values 0..3 and 4..7 of each group: four at a time, no carries (b/2+d <= 127)
    hi_a = (code & 0x87878787) + hb
    hi_b = (((code << 1) & 0x80808080) | ((code >> 3) & 0x07070707)) + hb
    hi = tl.reshape(tl.join(hi_a, hi_b), (R, NI, 2 * C))       # same word order as lo
    pairs = tl.join(_pair01(lo, hi, USE_ASM), _pair23(lo, hi, USE_ASM))
    restored = tl.reshape(pairs, (R, NI, 4 * C))               # word w = channels 2w, 2w+1
    return tl.where(packed, restored, plain)


@triton.jit
def _words_to_bf16(words):
    """uint32 [R, NI, W] of bf16 pairs -> bf16 [R, NI·2W] in channel order."""
    R: tl.constexpr = words.shape[0]
    NI: tl.constexpr = words.shape[1]
    W: tl.constexpr = words.shape[2]
    lo = words.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    hi = (words >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return tl.reshape(tl.join(lo, hi), (R, NI * 2 * W))


@triton.jit
def _block_bases(arena32, rec_w, cmask, base, NB: tl.constexpr):
    """Per row, for one (head, K or V) record: block byte starts, b/2 bytes and raw flags [R, NB].

    Record (docs/format.md section 3): u32 offset of block 0, then one byte per block
    (b/2, or 0xFF for raw). Block j starts at ``base + offset + 768·j + 256·(raw blocks before j)``.
    """
    j = tl.arange(0, NB)[None, :]
    first = tl.load(arena32 + rec_w, mask=cmask, other=0).to(tl.int64)
    bw = tl.load(arena32 + rec_w[:, None] + 1 + j // 4, mask=cmask[:, None], other=0)
    half = (bw >> (8 * (j % 4))) & 0xFF
    raw = (half == 0xFF).to(tl.int32)
    raw_before = tl.cumsum(raw, axis=1) - raw
    start = base[:, None] + first[:, None] + 768 * j + 256 * raw_before.to(tl.int64)
    return start, half, raw


@triton.jit
def _restore_kv(arena32, base, is_open, in_range, valid, t, h, H: tl.constexpr, D: tl.constexpr,
                USE_ASM: tl.constexpr):
    """K and V tiles [R, D] bf16 of head ``h`` for token rows ``t`` of pages at byte ``base``.

    Rows of open pages (``is_open``) read the [2, 16, H, D] layout; rows of compressed pages
    read the page's records and blocks. Rows that are not ``valid`` give zeros.
    """
    NB: tl.constexpr = D // 32            # blocks per head and role
    TPB: tl.constexpr = 512 // D          # tokens per V block
    REC_W: tl.constexpr = 2 if D <= 128 else 4   # record size in 32-bit words
    cmask = in_range & (is_open == 0)
    open_w = base // 4                               # open page, in 32-bit words
    rec_w = base // 4 + h * (2 * REC_W)              # K record; V record follows
    jj = tl.arange(0, NB)[None, :]
    # K: item = (token row, block j) = 32 channels of one token
    k_start, k_half, k_raw = _block_bases(arena32, rec_w, cmask, base, NB)
    k_packed = (k_raw == 0) & cmask[:, None]
    k_lo = k_start // 4 + 8 * t[:, None]
    k_code = k_start // 4 + 128 + 4 * t[:, None]
    k_plain = tl.where(is_open[:, None], open_w[:, None] + ((t * H + h) * D)[:, None] // 2
                       + 16 * jj, k_start // 4 + 16 * t[:, None])
    k_hb = k_half.to(tl.uint32) * 0x01010101
    k_words = _restore_words(arena32, k_lo[:, :, None], k_code[:, :, None],
                             k_plain[:, :, None], k_hb[:, :, None],
                             k_packed[:, :, None], valid[:, None, None], 4, USE_ASM)
    k = _words_to_bf16(k_words)                      # [R, D]
    # V: item = one token row (all D channels) inside block t // TPB
    v_start, v_half, v_raw = _block_bases(arena32, rec_w + REC_W, cmask, base, NB)
    sel = jj == (t // TPB)[:, None]
    v_start = tl.sum(tl.where(sel, v_start, 0), axis=1)
    v_half = tl.sum(tl.where(sel, v_half, 0), axis=1)
    v_raw = tl.sum(tl.where(sel, v_raw, 0), axis=1)
    v_packed = (v_raw == 0) & cmask
    tr = t % TPB
    v_lo = v_start // 4 + tr * (D // 4)
    v_code = v_start // 4 + 128 + tr * (D // 8)
    v_plain = tl.where(is_open, open_w + ((16 + t) * H + h) * D // 2,
                       v_start // 4 + tr * (D // 2))
    v_hb = v_half.to(tl.uint32) * 0x01010101
    v_words = _restore_words(arena32, v_lo[:, None, None], v_code[:, None, None],
                             v_plain[:, None, None], v_hb[:, None, None],
                             v_packed[:, None, None], valid[:, None, None],
                             D // 8, USE_ASM)
    v = _words_to_bf16(v_words)                      # [R, D]
    return k, v


# ------------------------------------------------------------------------------------------
# The attention kernel
# ------------------------------------------------------------------------------------------

@triton.jit
def _tile_step(p0, q, m_i, l_i, acc, arena32, arena16, page_loc_ptr, bt_ptr, b, h, ctx, p_end,
               t, slot, d, qk_scale, stride_bt, H: tl.constexpr, D: tl.constexpr,
               MODE: tl.constexpr, USE_ASM: tl.constexpr, FP32_DOT: tl.constexpr):
    """One tile of TP pages: load (or restore) K and V, then one online-softmax update."""
    page = p0 + slot
    in_range = page < p_end
    valid = in_range & (page * 16 + t < ctx)
    pid = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + page, mask=in_range, other=0)
    loc = tl.load(page_loc_ptr + pid.to(tl.int64), mask=in_range, other=1)
    is_open = (loc & 1) != 0
    base = loc - (loc & 1)                               # byte offset of the page
    if MODE == 0:
        # twin: open pages only, bf16 tiles straight from [2, 16, H, D]
        k_off = base // 2 + (t * H + h) * D
        v_off = base // 2 + ((16 + t) * H + h) * D
        k = tl.load(arena16 + k_off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(arena16 + v_off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    else:
        k, v = _restore_kv(arena32, base, is_open, in_range, valid, t, h, H, D, USE_ASM)

    # S = q Kᵀ · sm_scale · log2(e)   [G_PAD, R]
    if FP32_DOT:
        qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = tl.where(valid[None, :], qk * qk_scale, float("-inf"))
    # online softmax in base 2
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    # acc = acc·alpha + P V   [G_PAD, D]
    if FP32_DOT:
        pv = tl.dot(p.to(tl.bfloat16).to(tl.float32), v.to(tl.float32))
    else:
        pv = tl.dot(p.to(tl.bfloat16), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _decode_attention_kernel(
        q_ptr, arena32, arena16, page_loc_ptr, bt_ptr, ctx_ptr, out_ptr, part_o_ptr, part_lse_ptr,
        qk_scale, stride_bt, pages_per_split, num_splits,
        H: tl.constexpr, D: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
        TP: tl.constexpr, SINGLE: tl.constexpr, MODE: tl.constexpr,
        USE_ASM: tl.constexpr, FP32_DOT: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    R: tl.constexpr = TP * 16

    ctx = tl.load(ctx_ptr + b)
    n_pages = (ctx + 15) // 16
    p_begin = s * pages_per_split
    p_end = tl.minimum(p_begin + pages_per_split, n_pages)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    q_rows = (b * H * G + h * G + g).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * D + d[None, :], mask=(g < G)[:, None], other=0.0)

    r = tl.arange(0, R)
    t = r % 16                      # token inside its page
    slot = r // 16                  # page inside the tile
    m_i = tl.full([G_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)

    if FP32_DOT:
        # interpreter: its scalars are 1-element arrays, which range() does not take
        p0 = p_begin
        while p0 < p_end:
            m_i, l_i, acc = _tile_step(p0, q, m_i, l_i, acc, arena32, arena16, page_loc_ptr,
                                       bt_ptr, b, h, ctx, p_end, t, slot, d, qk_scale, stride_bt,
                                       H, D, MODE, USE_ASM, FP32_DOT)
            p0 += TP
    else:
        for p0 in range(p_begin, p_end, TP):
            m_i, l_i, acc = _tile_step(p0, q, m_i, l_i, acc, arena32, arena16, page_loc_ptr,
                                       bt_ptr, b, h, ctx, p_end, t, slot, d, qk_scale, stride_bt,
                                       H, D, MODE, USE_ASM, FP32_DOT)

    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    if SINGLE:
        tl.store(out_ptr + q_rows[:, None] * D + d[None, :], o.to(tl.bfloat16),
                 mask=(g < G)[:, None])
    else:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        part = q_rows * num_splits + s
        tl.store(part_o_ptr + part[:, None] * D + d[None, :], o, mask=(g < G)[:, None])
        tl.store(part_lse_ptr + part, lse, mask=g < G)


@triton.jit
def _merge_kernel(part_o_ptr, part_lse_ptr, out_ptr,
                  NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, D: tl.constexpr):
    """out = Σ_s 2^(lse_s − M)·o_s / Σ_s 2^(lse_s − M) for one (request, query head)."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D)
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + s, mask=s < NUM_SPLITS, other=float("-inf"))
    mx = tl.max(lse, axis=0)
    w = tl.exp2(lse - mx)
    o = tl.load(part_o_ptr + (row * NUM_SPLITS + s)[:, None] * D + d[None, :],
                mask=(s < NUM_SPLITS)[:, None], other=0.0)
    res = tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + row * D + d, res.to(tl.bfloat16))


# ------------------------------------------------------------------------------------------
# Host side
# ------------------------------------------------------------------------------------------

def _check_inputs(q, arena, page_loc_layer, block_table, context_lens, layout, sm_scale, out):
    if not isinstance(layout, PageLayout):
        raise TypeError(f"layout must be a zipfusion.format.PageLayout, got {type(layout).__name__}")
    for name, x in (("q", q), ("arena", arena), ("page_loc_layer", page_loc_layer),
                    ("block_table", block_table), ("context_lens", context_lens)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.device != arena.device:
            raise ValueError(f"{name} is on {x.device} but the arena is on {arena.device}; "
                             "move every input to the arena's device")
    H, D = layout.num_kv_heads, layout.head_dim
    if q.dtype != torch.bfloat16:
        raise TypeError(f"q must be torch.bfloat16, got {q.dtype}")
    if q.dim() != 3 or q.shape[2] != D or q.shape[1] % H != 0:
        raise ValueError(f"q must be [batch, num_q_heads, {D}] with num_q_heads a multiple of "
                         f"num_kv_heads={H}, got {list(q.shape)}")
    if arena.dtype != torch.uint8 or arena.dim() != 1 or not arena.is_contiguous():
        raise TypeError(f"arena must be a contiguous 1-D torch.uint8 tensor, got {arena.dtype} "
                        f"{list(arena.shape)}")
    if page_loc_layer.dtype != torch.int64 or page_loc_layer.dim() != 1:
        raise TypeError("page_loc_layer must be a 1-D torch.int64 tensor (page_loc[layer]), got "
                        f"{page_loc_layer.dtype} {list(page_loc_layer.shape)}")
    if not page_loc_layer.is_contiguous():
        raise ValueError("page_loc_layer must be contiguous")
    B = q.shape[0]
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != B:
        raise TypeError(f"block_table must be torch.int32 [batch={B}, max_pages_per_request], "
                        f"got {block_table.dtype} {list(block_table.shape)}")
    if block_table.stride(1) != 1:
        raise ValueError("block_table rows must be contiguous; call .contiguous() first")
    if context_lens.dtype != torch.int32 or tuple(context_lens.shape) != (B,):
        raise TypeError(f"context_lens must be torch.int32 [batch={B}], got "
                        f"{context_lens.dtype} {list(context_lens.shape)}")
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (float, int)) \
            or not math.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale must be a positive finite float, got {sm_scale!r}")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16 \
                or out.shape != q.shape or out.device != q.device or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous bf16 tensor of shape {list(q.shape)} on "
                             f"{q.device}")


def _check_ids(arena, page_loc_layer, block_table, context_lens, layout, twin: bool):
    """Checks that need the values (one device sync): context lengths, page ids, locations."""
    if context_lens.numel() == 0:
        return
    max_pages = block_table.shape[1]
    lens = context_lens.to(torch.int64)
    if int(lens.min()) < 1 or int(lens.max()) > PAGE_TOKENS * max_pages:
        raise ValueError(f"context_lens must be in 1..{PAGE_TOKENS * max_pages} (16 x the "
                         f"block_table width), got min {int(lens.min())} max {int(lens.max())}")
    n_pages = (lens + PAGE_TOKENS - 1) // PAGE_TOKENS
    used = torch.arange(max_pages, device=lens.device)[None, :] < n_pages[:, None]
    ids = block_table.to(torch.int64)[used]
    if int(ids.min()) < 0 or int(ids.max()) >= page_loc_layer.numel():
        raise ValueError(f"block_table holds page ids outside 0..{page_loc_layer.numel() - 1} "
                         "for pages inside the context")
    loc = page_loc_layer[ids]
    if int(loc.min()) < 0:
        raise ValueError("a page inside the context has page_loc = -1 (no page)")
    is_open = (loc & 1) == 1
    start = loc & ~1
    if bool(((start % 16) != 0).any()):
        raise ValueError("page locations must be 16-byte aligned (offset | 1 for open pages)")
    end = torch.where(is_open, start + layout.open_page_bytes, start + layout.min_page_bytes)
    if int(end.max()) > arena.numel():
        raise ValueError("a page location points past the end of the arena")
    last = block_table.to(torch.int64).gather(1, (n_pages - 1)[:, None])[:, 0]
    partial = (lens % PAGE_TOKENS) != 0
    if bool((partial & ((page_loc_layer[last] & 1) == 0)).any()):
        raise ValueError("the last, partial page of a request must be open (uncompressed)")
    if twin and not bool(is_open.all()):
        raise ValueError("decode_attention_twin reads open pages only; use decode_attention "
                         "for compressed pages")


def default_num_splits(batch: int, num_kv_heads: int, max_pages: int, tile_pages: int,
                       device: torch.device) -> int:
    """Split-KV factor: about 4 programs per SM, each with at least 4 tiles of work."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = 4
    want = -(-4 * sms // max(1, batch * num_kv_heads))
    most = max(1, max_pages // (4 * tile_pages))
    return int(max(1, min(want, most, 64)))


def _launch(mode, q, arena, page_loc_layer, block_table, context_lens, layout, sm_scale, out,
            num_splits, tile_pages, num_warps, validate, use_asm=None):
    _check_inputs(q, arena, page_loc_layer, block_table, context_lens, layout, sm_scale, out)
    attn_kernel, merge_kernel, interp = _kernels(arena.device)
    if validate:
        _check_ids(arena, page_loc_layer, block_table, context_lens, layout, mode == MODE_TWIN)
    B, Hq, D = q.shape
    H = layout.num_kv_heads
    G = Hq // H
    q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    if B == 0:
        return out
    TP = tile_pages or (1 if interp else 2)
    max_pages = block_table.shape[1]
    S = num_splits or default_num_splits(B, H, max_pages, TP, q.device)
    pps = -(-max_pages // S)
    pps = -(-pps // TP) * TP                 # pages per split: whole tiles
    S = -(-max_pages // pps)
    n4 = arena.numel() // 4 * 4
    arena32 = arena[:n4].view(torch.int32)
    arena16 = arena[:n4].view(torch.bfloat16)
    if S > 1:
        part_o = torch.empty(B * Hq * S * D, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(B * Hq * S, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out
    LAST_COMPILED[mode] = attn_kernel[(B, H, S)](
        q, arena32, arena16, page_loc_layer, block_table, context_lens, out, part_o, part_lse,
        float(sm_scale) * LOG2E, block_table.stride(0), pps, S,
        H=H, D=D, G=G, G_PAD=max(16, triton.next_power_of_2(G)), TP=TP, SINGLE=S == 1,
        MODE=mode, USE_ASM=(not interp) if use_asm is None else use_asm, FP32_DOT=interp, num_warps=num_warps or 4)
    if S > 1:
        merge_kernel[(B * Hq,)](part_o, part_lse, out, NUM_SPLITS=S,
                                 S_PAD=triton.next_power_of_2(S), D=D, num_warps=4)
    return out


def decode_attention(q, arena, page_loc_layer, block_table, context_lens, layout, sm_scale,
                     out=None, *, num_splits=None, tile_pages=None, num_warps=None,
                     validate=True, use_asm=None):
    """Paged decode attention reading open and compressed pages as ``page_loc_layer`` says.

    q [B, Hq, D] bf16; arena 1-D uint8; page_loc_layer int64 [max_pages]; block_table int32
    [B, max_pages_per_request]; context_lens int32 [B] -> [B, Hq, D] bf16 (written into ``out``
    if given). ``validate`` checks ids and locations (one device sync; pass False inside CUDA
    graphs). ``num_splits``, ``tile_pages``, ``num_warps`` override the tuning defaults;
    ``use_asm=False`` uses the pure-Triton byte interleave instead of ``prmt`` (for timing).
    """
    return _launch(MODE_FUSED, q, arena, page_loc_layer, block_table, context_lens, layout,
                   sm_scale, out, num_splits, tile_pages, num_warps, validate, use_asm)


def decode_attention_twin(q, arena, page_loc_layer, block_table, context_lens, layout, sm_scale,
                          out=None, *, num_splits=None, tile_pages=None, num_warps=None,
                          validate=True):
    """The uncompressed twin: same tiling and arithmetic, every page must be open."""
    return _launch(MODE_TWIN, q, arena, page_loc_layer, block_table, context_lens, layout,
                   sm_scale, out, num_splits, tile_pages, num_warps, validate)
