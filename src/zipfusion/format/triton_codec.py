"""Triton kernels of the page format (docs/format.md): analyze, compress and decompress pages.

All three work on pages living in the KV arena, a 1-D ``torch.uint8`` tensor (docs/design.md):

* :func:`analyze_open_pages` reads full open pages ``[2, 16, H, D]`` bf16 and returns each
  block's metadata byte (``b/2``, ``0x80 | b/2`` with escapes, or ``0xFF``) and each page's
  encoded size;
* :func:`compress_open_pages` writes the compressed pages (metadata + block bodies) at the given
  destinations in the same arena, byte-identical to ``reference.encode_pages_into``;
* :func:`decompress_pages` turns compressed pages back into ``[P, 2, 16, H, D]`` bf16,
  bit-identical to ``reference.decode_pages``.

How the work is cut
-------------------
One program handles one (page, KV head): both roles (K, V), each as a tile ``[nb, 64, 4]`` of
32-bit words = ``nb`` blocks x 64 groups x 4 words (a group is 8 values = 8 consecutive channels
of one token = 16 bytes, one vector load). Every thread owns whole groups, so all the bit work
below is register-local integer arithmetic on 32-bit words holding two BF16 values each::

    word w_k of a group = value 2k (bits 0..15) | value 2k+1 (bits 16..31),   k = 0..3

Encoding a group (compressible block with base ``b``, ``bh = b/2``), per word, lane-wise on the
two 16-bit halves (no lane can borrow from the other, see below)::

    hi   = (w >> 8) & 0x00FF00FF            high bytes   s·128 + (e >> 1)
    d    = (hi & 0x007F007F) - bh·0x00010001   (e >> 1) - b/2 = (e - b) >> 1, in 0..7 since b is
                                               even, b <= e and e <= b + 15
    s    = (hi >> 7) & 0x00010001
    code byte j (from w_k holding values j, j+1 and w_{k+2} holding values j+4, j+5):
         s[j] << 7 | s[j+4] << 6 | d[j+4] << 3 | d[j]
    lo_0123 = low bytes of w_0, w_1;  lo_4567 = low bytes of w_2, w_3

Format v2 escapes (a block flagged ``0x80 | b/2``): values outside the window get ``d = 0``
(``triton_encode.clean`` sets their 7 exponent bits to ``b/2`` before the codes are made) and
a record ``v | ((e >> 1) ^ b/2) << 9`` each, the 4 smallest ``v`` by 4 min-reductions
(``triton_encode.escape_words``), stored after the codes.

Decoding is the shared restore (``triton_restore.restore_group``: four high bytes with one add,
the escape records XORed in, bytes interleaved into the four words of the group). Raw blocks
are copied word for word. Which blocks are raw is uniform per block, so it becomes a per-block mask on the
loads/stores (both paths are computed, the stores are predicated).

Trust: the kernels trust metadata written by our encoder. ``decompress_pages(...,
validate=True)`` (the default) checks every page's metadata with the reference parser
(``reference.read_headers``) before launching; with ``validate=False`` a corrupt page can make
the kernel read garbage or out of bounds. Argument dtypes, shapes, devices and offset alignment
are always checked.

On CPU tensors the kernels run under the Triton interpreter (slow: tests only), whether or not
``TRITON_INTERPRET=1`` was set before Triton was imported.
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

# Warps per program of each kernel (benchmarks/codec.py sweeps these on the GPU).
NUM_WARPS = {"analyze": 2, "compress": 4, "decompress": 4}

# The restore (one routine for every reader of the format) and the encoder's bit work, made as
# this module's kernels are.
_restore_group = same_mode(triton_restore).restore_group
_E = same_mode(triton_encode)
_sum, _minr, _maxr, _tile_bases = _E.sum_, _E.minr, _E.maxr, _E.tile_bases
_lo16, _code16, _clean, _escape_words = _E.lo16, _E.code16, _E.clean, _E.escape_words
PT = tl.constexpr(PAGE_TOKENS)                       # tokens per page, as a kernel constant
ESC_WORD = tl.constexpr(COMPRESSED_BLOCK_BYTES // 4)  # the escape chunk's first word in a block


# --------------------------------------------------------------------------------------------
# Index maps (jit helpers shared by the three kernels)
# --------------------------------------------------------------------------------------------

@triton.jit
def _group_index(NB: tl.constexpr):
    """j [NB,1,1], g [1,64,1], k [1,1,4]: block, group of 8 values, word inside the group."""
    j = tl.arange(0, NB)[:, None, None]
    g = tl.arange(0, 64)[None, :, None]
    k = tl.arange(0, 4)[None, None, :]
    return j, g, k


@triton.jit
def _open_word_offsets(R: tl.constexpr, h, H: tl.constexpr, D: tl.constexpr, NB: tl.constexpr):
    """Word offsets, from the open page's start, of the tile [NB, 64, 4] of head h, role R.

    Open page: bf16 [2, 16, H, D], so token t of (R, h) starts at word ((R·16 + t)·H + h)·D/2.
    K block j (channel-grouped): value v = t·32 + c − 32j, group g = v/8 -> token t = g/4,
      channels 32j + 8(g%4) .. +7 -> words 16j + 4(g%4) + k.
    V block j (token-grouped, tpb = 512/D tokens): v = (t − tpb·j)·D + c, group g -> token
      t = tpb·j + g/(D/8), channels 8(g % (D/8)) .. +7 -> words 4(g % (D/8)) + k.
    """
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
    """Byte offsets from the page start of the NB blocks of one record, [NB] int32, and their
    metadata bytes [NB] uint32.

    start(j) = first + Σ_{i < j} size(i), size = 768 for a b/2 byte, 784 for 0x80 | b/2, 1024
    for 0xFF. NB <= 8, so the prefix sum is NB-1 scalar terms (uniform scalar loads; no
    cross-thread reduction).
    """
    jj = tl.arange(0, NB)
    start = first + 0 * jj
    for i in tl.static_range(NB - 1):
        start += tl.where(jj > i, _block_size(tl.load(bh_ptr + i)), 0)
    bh = tl.load(bh_ptr + jj).to(tl.uint32)
    return start, bh


@triton.jit
def _block_size(meta):
    """A block's stored bytes from its metadata byte: 1024 raw, 784 with escapes, else 768."""
    return tl.where(meta == RAW_MARK_C, RAW_C, tl.where((meta & FLAG_C) != 0, ESCAPED_C,
                                                           COMPRESSED_C))


# --------------------------------------------------------------------------------------------
# Analyze (the rule itself: triton_encode.tile_bases)
# --------------------------------------------------------------------------------------------

@triton.jit
def _analyze_kernel(arena_ptr, src_ptr, base_half_ptr, sizes_ptr,
                    H: tl.constexpr, D: tl.constexpr, NB: tl.constexpr):
    """Program (p, h): for K and V of head h of page p, each block's b/2 (or 0xFF), and
    atomically adds the blocks' encoded sizes to sizes[p] (which starts at the header size)."""
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


# --------------------------------------------------------------------------------------------
# Compress
# --------------------------------------------------------------------------------------------

@triton.jit
def _encode_record(src, dst, bh_ptr, first, R: tl.constexpr, h, H: tl.constexpr,
                   D: tl.constexpr, NB: tl.constexpr, M: tl.constexpr):
    """Write record (h, R) of a compressed page at word pointer dst: its M metadata bytes and
    its NB block bodies, from the open page at word pointer src. bh_ptr: the record's NB
    metadata bytes; first: byte offset of its block 0 from the page start."""
    j, g, k = _group_index(NB)
    rec = h * 2 + R
    start, bh = _record_starts(first, bh_ptr, NB)                       # [NB] bytes, [NB]
    # metadata record, M/4 words: u32 offset of block 0, then the NB metadata bytes
    # little-endian 4 to a word, zero padding
    tl.store(dst + rec * (M // 4), first)
    for q in tl.static_range(1, M // 4):
        word = 0
        for i in tl.static_range(4):
            if 4 * (q - 1) + i < NB:
                word = word | (tl.load(bh_ptr + 4 * (q - 1) + i).to(tl.int32) << (8 * i))
        tl.store(dst + rec * (M // 4) + q, word)

    w = tl.load(src + _open_word_offsets(R, h, H, D, NB))               # [NB, 64, 4] int32
    start_w1 = tl.multiple_of(start // 4, 4)                            # blocks 16-aligned
    start_w = start_w1[:, None, None]
    raw1 = bh == RAW_MARK_C
    is_raw = raw1[:, None, None]
    # raw block: the 512 words as they are, group g at word 4g
    tl.store(dst + start_w + 4 * g + k, w, mask=is_raw)
    # compressed block: 2 words of low bytes at word 2g, 1 code word at word 128 + g
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
    lo = tl.join(lo_0123, lo_4567).to(tl.int32, bitcast=True)          # [NB, 64, 2]
    m = tl.arange(0, 2)[None, None, :]
    tl.store(dst + start_w + 2 * g + m, lo, mask=~is_raw)
    # (contiguity hint 1: one 4-byte store per thread in the layout the code words were
    # computed in, instead of moving them between threads for 8-byte stores)
    code_off = tl.max_contiguous(start_w1[:, None] + 128 + tl.arange(0, 64)[None, :], [1, 1])
    tl.store(dst + code_off, code.to(tl.int32, bitcast=True), mask=~raw1[:, None])
    # format v2: blocks with escapes get their 16-byte chunk after the codes (words 192..195)
    esc1 = ((bh & FLAG_C) != 0) & ~raw1
    e0, e1 = _escape_words(u, bh7, g, k)
    m4 = tl.arange(0, 4)[None, :]
    chunk = tl.where(m4 == 0, e0[:, None], tl.where(m4 == 1, e1[:, None], 0))
    tl.store(dst + start_w1[:, None] + ESC_WORD + m4, chunk, mask=esc1[:, None])


@triton.jit
def _compress_kernel(arena_ptr, src_ptr, dst_ptr, base_half_ptr, index_ptr,
                     H: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, M: tl.constexpr,
                     NBLK: tl.constexpr, INDEXED: tl.constexpr):
    """Program (i, h): writes the metadata records and block bodies of head h of output page i.

    Output page i encodes analyzed page p = index[i] (p = i without an index): source
    src[p], metadata base_half[p], destination dst[i]. Record r = 2h + R starts its blocks at

        first(r) = 2·H·M + Σ_{blocks q of records < r} size(q)      (768, 784 or 1024)

    counted here from the page's 2·H·NB metadata bytes (one small vector load, shared in L1/L2
    by the page's H programs): no prefix-sum pass and no gather before the launch.
    """
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


# --------------------------------------------------------------------------------------------
# Decompress
# --------------------------------------------------------------------------------------------

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
        start, bh = _record_starts(first, arena_ptr + off + rec + 4, NB)  # metadata bytes
        start_w1 = tl.multiple_of(start // 4, 4)
        start_w = start_w1[:, None, None]
        raw1 = bh == RAW_MARK_C
        is_raw = raw1[:, None, None]
        raw = tl.load(page_w + start_w + 4 * g + k, mask=is_raw, other=0)
        # Every tensor below has the tile's shape [NB, 64, 4] (or [NB, 64]) and the same
        # register layout (a thread owns the 4 words of a group), so no data moves between
        # threads: each thread loads the 16 bytes that hold its group's code word (codes of
        # groups 4(g/4) .. +3) and the 16 bytes that hold its two low-byte words (groups
        # 2(g/2), +1), then picks its own words with an in-thread select-and-sum over 4 lanes.
        cw4 = tl.load(page_w + start_w + 128 + 4 * (g // 4) + k, mask=~is_raw, other=0)
        lw4 = tl.load(page_w + start_w + 4 * (g // 2) + k, mask=~is_raw, other=0)
        c = _sum(tl.where(k == g % 4, cw4, 0), axis=2).to(tl.uint32, bitcast=True)
        lo0 = _sum(tl.where(k == 2 * (g % 2), lw4, 0), axis=2).to(tl.uint32, bitcast=True)
        lo1 = _sum(tl.where(k == 2 * (g % 2) + 1, lw4, 0), axis=2).to(tl.uint32, bitcast=True)
        # format v2: the escape records of blocks with escapes (0 elsewhere: no patch)
        esc1 = ((bh & FLAG_C) != 0) & ~raw1
        e0 = tl.load(page_w + start_w1 + ESC_WORD, mask=esc1, other=0).to(tl.uint32, bitcast=True)
        e1 = tl.load(page_w + start_w1 + ESC_WORD + 1, mask=esc1, other=0).to(tl.uint32, bitcast=True)
        gq = (tl.arange(0, 64)[None, :] + 0 * start[:, None]).to(tl.uint32)   # group in block
        any_esc = _maxr(esc1.to(tl.int32), axis=0) != 0
        w0, w1, w2, w3 = _restore_group(lo0, lo1, c, (bh & 0x7F)[:, None] + 0 * gq,
                                        e0[:, None] + 0 * gq, e1[:, None] + 0 * gq, gq, any_esc,
                                        INTERPRET)
        y = tl.where(k == 0, w0[:, :, None], tl.where(k == 1, w1[:, :, None],
                     tl.where(k == 2, w2[:, :, None], w3[:, :, None])))
        dst = out + _open_word_offsets(R, h, H, D, NB)
        tl.store(dst, raw, mask=is_raw)
        tl.store(dst, y.to(tl.int32, bitcast=True), mask=~is_raw)


# --------------------------------------------------------------------------------------------
# Python wrappers: checks, then one launch each
# --------------------------------------------------------------------------------------------

def _kernel(name: str, device: torch.device):
    """The kernel ``name`` for tensors on ``device``: compiled for CUDA tensors, under the Triton
    interpreter for CPU tensors (from this module's interpreted copy if it was imported without
    TRITON_INTERPRET=1)."""
    compiled = isinstance(globals()[name], triton.runtime.jit.JITFunction)
    return getattr(kernel_module(device, __name__, __file__, not compiled), name)


def analyze_open_pages(arena: torch.Tensor, src_offsets: torch.Tensor, layout: PageLayout,
                       *, validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Analyze full open pages at ``src_offsets`` (bytes) of ``arena``.

    Returns ``(base_half [P, NB] uint8, sizes [P] int64)``: every block's metadata byte in
    format order (head, K/V, block) -- ``b/2`` for a compressible block, ``0xFF`` for a raw one --
    and every page's encoded size in bytes. ``validate=False`` skips the value checks of the
    offsets (a device sync); dtypes, shapes and devices are always checked.
    """
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
    """Write the compressed form of the open pages at ``src_offsets`` to ``dst_offsets``.

    ``base_half`` is what :func:`analyze_open_pages` returned for these pages. With ``index``
    (int64 [K] on the arena's device) only the analyzed pages ``index[i]`` are written, page
    ``index[i]`` at ``dst_offsets[i]``: one launch for any subset of an analysis, no gather.
    The destination ranges must not overlap the sources or each other (the memory manager
    guarantees it; not checked). The bytes equal ``reference.encode_pages_into``.
    ``validate=False`` skips the value checks (offset alignment/range, index range, metadata
    bytes), which need a device sync.
    """
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
    """Decode the compressed pages at ``offsets`` of ``arena`` -> ``[P, 2, 16, H, D]`` bf16.

    With ``validate=True`` every page's metadata is checked first (``reference.read_headers``,
    raising ``CorruptPageError``) and the pages must end inside the arena; with
    ``validate=False`` the kernel trusts the metadata (pages written by our encoder).
    """
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
