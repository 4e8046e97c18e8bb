"""Triton kernels of the page format (docs/format.md): analyze, compress and decompress pages, one
program per (page, KV head). They trust our encoder's metadata; ``decompress_pages(validate=True)``
checks it first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels.triton_interpreter import kernel_module, same_mode
from .layout import COMPRESSED_BLOCK_BYTES, PAGE_TOKENS, PageLayout, block_bytes
from . import reference, triton_encode, triton_restore
from .triton_encode import COMPRESSED_C, ESCAPED_C, FLAG_C, RAW_C, RAW_MARK_C
from .triton_checks import check_arena, check_index, check_layout, check_offsets

__all__ = ["analyze_open_pages", "compress_open_pages", "decompress_pages"]

NUM_WARPS = {"analyze": 2, "compress": 4, "decompress": 4}

_restore_group = same_mode(triton_restore).restore_group
_E = same_mode(triton_encode)
_sum, _minr, _maxr, _tile_bases = _E.sum_, _E.minr, _E.maxr, _E.tile_bases
_lo16, _code16, _clean, _escape_words = _E.lo16, _E.code16, _E.clean, _E.escape_words
PT = tl.constexpr(PAGE_TOKENS)
ESC_WORD = tl.constexpr(COMPRESSED_BLOCK_BYTES // 4)  # the escape chunk's first word in a block



@triton.jit
def _group_index(NB: tl.constexpr):
    """j [NB,1,1], g [1,64,1], k [1,1,4]: block, group, word in group."""
    j = tl.arange(0, NB)[:, None, None]
    g = tl.arange(0, 64)[None, :, None]
    k = tl.arange(0, 4)[None, None, :]
    return j, g, k


@triton.jit
def _open_word_offsets(R: tl.constexpr, h, H: tl.constexpr, D: tl.constexpr, NB: tl.constexpr):
    """Word offsets from the open page's start of head h's tile [NB, 64, 4], role R (K or V
    grouping: docs/format.md)."""
    j, g, k = _group_index(NB)
    if R == 0:
        t = g // 4
        cw = 16 * j + 4 * (g % 4) + k
    else:
        t = (512 // D) * j + g // (D // 8)
        cw = 4 * (g % (D // 8)) + k
    return (R * PT + t) * (H * D // 2) + h * (D // 2) + cw


@triton.jit
def _record_starts(first, bh_ptr, NB: tl.constexpr):
    """Byte offsets from the page start [NB] and metadata bytes [NB] of one record's blocks
    (an unrolled prefix sum: NB <= 8)."""
    jj = tl.arange(0, NB)
    start = first + 0 * jj
    for i in tl.static_range(NB - 1):
        start += tl.where(jj > i, _block_size(tl.load(bh_ptr + i)), 0)
    bh = tl.load(bh_ptr + jj).to(tl.uint32)
    return start, bh


@triton.jit
def _block_size(meta):
    return tl.where(meta == RAW_MARK_C, RAW_C, tl.where((meta & FLAG_C) != 0, ESCAPED_C,
                                                           COMPRESSED_C))



@triton.jit
def _analyze_kernel(arena_ptr, src_ptr, base_half_ptr, sizes_ptr,
                    H: tl.constexpr, D: tl.constexpr, NB: tl.constexpr):
    """Program (p, h): each block's b/2 (or 0xFF); adds the blocks' sizes to sizes[p]."""
    pid = tl.program_id(0)
    p = pid // H
    h = pid % H
    words = arena_ptr.to(tl.pointer_type(tl.int32))
    page = words + tl.multiple_of(tl.load(src_ptr + p) // 4, 4)        # 16-byte aligned
    nbytes = 0
    for R in tl.static_range(2):
        bh, tile_bytes = _tile_bases(tl.load(page + _open_word_offsets(R, h, H, D, NB)))
        tl.store(base_half_ptr + p.to(tl.int64) * (2 * H * NB) + (h * 2 + R) * NB
                 + tl.arange(0, NB), bh.to(tl.uint8))
        nbytes += tile_bytes
    tl.atomic_add(sizes_ptr + p, nbytes.to(tl.int64), sem="relaxed")



@triton.jit
def _encode_record(src, dst, bh_ptr, first, R: tl.constexpr, h, H: tl.constexpr,
                   D: tl.constexpr, NB: tl.constexpr, M: tl.constexpr):
    """Write record (h, R): its M metadata bytes and NB block bodies, at word pointer dst."""
    j, g, k = _group_index(NB)
    rec = h * 2 + R
    start, bh = _record_starts(first, bh_ptr, NB)
    # metadata record: u32 offset of block 0, then the metadata bytes, 4 to a word
    tl.store(dst + rec * (M // 4), first)
    for q in tl.static_range(1, M // 4):
        word = 0
        for i in tl.static_range(4):
            if 4 * (q - 1) + i < NB:
                word = word | (tl.load(bh_ptr + 4 * (q - 1) + i).to(tl.int32) << (8 * i))
        tl.store(dst + rec * (M // 4) + q, word)

    w = tl.load(src + _open_word_offsets(R, h, H, D, NB))
    start_w1 = tl.multiple_of(start // 4, 4)                            # blocks 16-aligned
    start_w = start_w1[:, None, None]
    raw1 = bh == RAW_MARK_C
    is_raw = raw1[:, None, None]
    tl.store(dst + start_w + 4 * g + k, w, mask=is_raw)
    u = w.to(tl.uint32, bitcast=True)
    bh7 = bh & 0x7F                                                     # b/2 without the flag
    cu = _clean(u, bh7[:, None, None])
    w02, w13 = tl.split(tl.reshape(cu, (NB, 64, 2, 2)))   # [.., i, o] = w_{2i+o}
    w0, w2 = tl.split(w02)
    w1, w3 = tl.split(w13)
    lo_0123 = _lo16(w0) | (_lo16(w1) << 16)
    lo_4567 = _lo16(w2) | (_lo16(w3) << 16)
    bhc = bh7[:, None]
    code = _code16(w0, w2, bhc) | (_code16(w1, w3, bhc) << 16)
    lo = tl.join(lo_0123, lo_4567).to(tl.int32, bitcast=True)
    m = tl.arange(0, 2)[None, None, :]
    tl.store(dst + start_w + 2 * g + m, lo, mask=~is_raw)
    # contiguity 1: one 4-byte store per thread in the layout the codes were computed in
    code_off = tl.max_contiguous(start_w1[:, None] + 128 + tl.arange(0, 64)[None, :], [1, 1])
    tl.store(dst + code_off, code.to(tl.int32, bitcast=True), mask=~raw1[:, None])
    esc1 = ((bh & FLAG_C) != 0) & ~raw1
    e0, e1 = _escape_words(u, bh7, g, k)
    m4 = tl.arange(0, 4)[None, :]
    chunk = tl.where(m4 == 0, e0[:, None], tl.where(m4 == 1, e1[:, None], 0))
    tl.store(dst + start_w1[:, None] + ESC_WORD + m4, chunk, mask=esc1[:, None])


@triton.jit
def _compress_kernel(arena_ptr, src_ptr, dst_ptr, base_half_ptr, index_ptr,
                     H: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, M: tl.constexpr,
                     NBLK: tl.constexpr, INDEXED: tl.constexpr):
    """Program (i, h): head h of output page i (analyzed page index[i], or i); each record's
    first block offset is summed here from the page's metadata bytes (no prefix-sum pass)."""
    pid = tl.program_id(0)
    i = pid // H
    h = pid % H
    if INDEXED:
        p = tl.load(index_ptr + i)
    else:
        p = i
    words = arena_ptr.to(tl.pointer_type(tl.int32))
    src = words + tl.multiple_of(tl.load(src_ptr + p) // 4, 4)
    dst = words + tl.multiple_of(tl.load(dst_ptr + i) // 4, 4)
    meta = base_half_ptr + p.to(tl.int64) * (2 * H * NB)
    q = tl.arange(0, NBLK)
    size = _block_size(tl.load(meta + q, mask=q < 2 * H * NB, other=0))
    for R in tl.static_range(2):
        rec = h * 2 + R
        first = 2 * H * M + _sum(tl.where(q < rec * NB, size, 0), axis=0)
        _encode_record(src, dst, meta + rec * NB, first, R, h, H, D, NB, M)



@triton.jit
def _decompress_kernel(arena_ptr, offsets_ptr, out_ptr,
                       H: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, M: tl.constexpr,
                       INTERPRET: tl.constexpr):
    """Program (p, h): decodes K and V of head h of compressed page p into out[p]."""
    pid = tl.program_id(0)
    p = pid // H
    h = pid % H
    off = tl.load(offsets_ptr + p)
    words = arena_ptr.to(tl.pointer_type(tl.int32))
    page_w = words + tl.multiple_of(off // 4, 4)
    out = out_ptr.to(tl.pointer_type(tl.int32)) + p.to(tl.int64) * (2 * PT * H * D // 2)
    j, g, k = _group_index(NB)
    for R in tl.static_range(2):
        rec = (h * 2 + R) * M
        first = tl.load(page_w + rec // 4)                                # u32 offset of block 0
        start, bh = _record_starts(first, arena_ptr + off + rec + 4, NB)
        start_w1 = tl.multiple_of(start // 4, 4)
        start_w = start_w1[:, None, None]
        raw1 = bh == RAW_MARK_C
        is_raw = raw1[:, None, None]
        raw = tl.load(page_w + start_w + 4 * g + k, mask=is_raw, other=0)
        # each thread loads the 16 bytes holding its group's code and low bytes and selects its
        # own words in-thread: no data moves between threads
        cw4 = tl.load(page_w + start_w + 128 + 4 * (g // 4) + k, mask=~is_raw, other=0)
        lw4 = tl.load(page_w + start_w + 4 * (g // 2) + k, mask=~is_raw, other=0)
        c = _sum(tl.where(k == g % 4, cw4, 0), axis=2).to(tl.uint32, bitcast=True)
        lo0 = _sum(tl.where(k == 2 * (g % 2), lw4, 0), axis=2).to(tl.uint32, bitcast=True)
        lo1 = _sum(tl.where(k == 2 * (g % 2) + 1, lw4, 0), axis=2).to(tl.uint32, bitcast=True)
        esc1 = ((bh & FLAG_C) != 0) & ~raw1
        e0 = tl.load(page_w + start_w1 + ESC_WORD, mask=esc1, other=0).to(tl.uint32, bitcast=True)
        e1 = tl.load(page_w + start_w1 + ESC_WORD + 1, mask=esc1, other=0).to(tl.uint32, bitcast=True)
        gq = (tl.arange(0, 64)[None, :] + 0 * start[:, None]).to(tl.uint32)
        any_esc = _maxr(esc1.to(tl.int32), axis=0) != 0
        w0, w1, w2, w3 = _restore_group(lo0, lo1, c, (bh & 0x7F)[:, None] + 0 * gq,
                                        e0[:, None] + 0 * gq, e1[:, None] + 0 * gq, gq, any_esc,
                                        INTERPRET)
        y = tl.where(k == 0, w0[:, :, None], tl.where(k == 1, w1[:, :, None],
                     tl.where(k == 2, w2[:, :, None], w3[:, :, None])))
        dst = out + _open_word_offsets(R, h, H, D, NB)
        tl.store(dst, raw, mask=is_raw)
        tl.store(dst, y.to(tl.int32, bitcast=True), mask=~is_raw)



def _kernel(name: str, device: torch.device):
    """The kernel ``name`` for ``device``: compiled on CUDA, interpreted on the CPU."""
    compiled = isinstance(globals()[name], triton.runtime.jit.JITFunction)
    return getattr(kernel_module(device, __name__, __file__, not compiled), name)


def analyze_open_pages(arena: torch.Tensor, src_offsets: torch.Tensor, layout: PageLayout,
                       *, validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Analyze full open pages -> (base_half [P, NB] uint8 metadata bytes, sizes [P] int64).
    ``validate=False`` skips the offsets' value checks (a device sync)."""
    layout = check_layout(layout)
    device = check_arena(arena)
    src = check_offsets("src_offsets", src_offsets, device, arena_bytes=arena.numel(),
                         page_bytes=layout.open_page_bytes, validate=validate)
    P, H, D, nb = src.numel(), layout.num_kv_heads, layout.head_dim, layout.blocks_per_head
    base_half = torch.empty(P, layout.num_blocks, dtype=torch.uint8, device=device)
    sizes = torch.full((P,), layout.header_bytes, dtype=torch.int64, device=device)
    if P:
        kernel = _kernel("_analyze_kernel", device)
        kernel[(P * H,)](arena, src, base_half, sizes, H=H, D=D, NB=nb,
                         num_warps=NUM_WARPS["analyze"])
    return base_half, sizes


def _encoded_sizes(base_half: torch.Tensor, layout: PageLayout) -> torch.Tensor:
    return layout.header_bytes + block_bytes(base_half.to(torch.int32)).sum(1)


def compress_open_pages(arena: torch.Tensor, src_offsets: torch.Tensor, base_half: torch.Tensor,
                        dst_offsets: torch.Tensor, layout: PageLayout, *, index: torch.Tensor | None = None,
                        validate: bool = True) -> None:
    """Write the compressed form of the open pages at ``src_offsets`` to ``dst_offsets``,
    bytes equal to ``reference.encode_pages_into``. With ``index`` only analyzed pages
    ``index[i]`` are written (to ``dst_offsets[i]``). Destinations must not overlap (unchecked)."""
    layout = check_layout(layout)
    device = check_arena(arena)
    if not isinstance(base_half, torch.Tensor):
        raise TypeError(f"base_half must be a torch.uint8 tensor, got {type(base_half).__name__}")
    P = base_half.shape[0] if base_half.dim() == 2 else -1
    if base_half.dtype != torch.uint8 or base_half.dim() != 2 or base_half.shape[1] != layout.num_blocks:
        raise ValueError(f"base_half must be uint8 [P, {layout.num_blocks}] (from analyze_open_pages "
                         f"with the same layout), got {base_half.dtype} {list(base_half.shape)}")
    if base_half.device != device:
        raise ValueError(f"base_half is on {base_half.device} but the arena is on {device}")
    base_half = base_half.contiguous()
    src = check_offsets("src_offsets", src_offsets, device, length=P, arena_bytes=arena.numel(),
                         page_bytes=layout.open_page_bytes, validate=validate)
    if index is not None:
        index = check_index(index, P, device, validate)
    K = P if index is None else index.numel()
    sizes = None
    if validate:
        sizes = _encoded_sizes(base_half if index is None else base_half[index], layout)
    dst = check_offsets("dst_offsets", dst_offsets, device, length=K, arena_bytes=arena.numel(),
                         page_bytes=sizes, validate=validate)
    if K == 0:
        return
    H, D, nb = layout.num_kv_heads, layout.head_dim, layout.blocks_per_head
    kernel = _kernel("_compress_kernel", device)
    kernel[(K * H,)](arena, src, dst, base_half, src if index is None else index, H=H, D=D, NB=nb,
                     M=layout.record_bytes, NBLK=triton.next_power_of_2(layout.num_blocks),
                     INDEXED=index is not None, num_warps=NUM_WARPS["compress"])


def decompress_pages(arena: torch.Tensor, offsets: torch.Tensor, layout: PageLayout,
                     out: torch.Tensor | None = None, *, validate: bool = True) -> torch.Tensor:
    """Decode the compressed pages at ``offsets`` -> ``[P, 2, 16, H, D]`` bf16; ``validate``
    checks every page's metadata first (``CorruptPageError``)."""
    layout = check_layout(layout)
    device = check_arena(arena)
    off = check_offsets("offsets", offsets, device, arena_bytes=arena.numel(),
                         page_bytes=layout.min_page_bytes if validate else None, validate=validate)
    P, H, D = off.numel(), layout.num_kv_heads, layout.head_dim
    shape = (P, 2, PAGE_TOKENS, H, D)
    if out is None:
        out = torch.empty(shape, dtype=torch.bfloat16, device=device)
    elif not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16 or tuple(out.shape) != shape:
        raise ValueError(f"out must be a bfloat16 tensor of shape {list(shape)}, got "
                         f"{getattr(out, 'dtype', type(out).__name__)} {list(getattr(out, 'shape', []))}")
    elif out.device != device or not out.is_contiguous():
        raise ValueError(f"out must be contiguous and on the arena's device {device}")
    if P == 0:
        return out
    if validate:
        base_half, starts = reference.read_headers(arena, off, layout)
        ends = off + starts[:, -1] + block_bytes(base_half.flatten(1)[:, -1])
        if bool((ends > arena.numel()).any()):
            raise reference.CorruptPageError("page metadata describes blocks past the end of the arena")
    kernel = _kernel("_decompress_kernel", device)
    kernel[(P * H,)](arena, off, out, H=H, D=D, NB=layout.blocks_per_head, M=layout.record_bytes,
                     INTERPRET=device.type == "cpu", num_warps=NUM_WARPS["decompress"])
    return out
