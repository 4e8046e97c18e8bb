"""Triton kernels of the page format (docs/format.md): analyze, compress and decompress pages.

All three work on pages living in the KV arena, a 1-D ``torch.uint8`` tensor (docs/design.md):

* :func:`analyze_open_pages` reads full open pages ``[2, 16, H, D]`` bf16 and returns each
  block's metadata byte (``b/2`` or ``0xFF``) and each page's encoded size;
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

Decoding restores four high bytes with one add (docs/format.md section 2)::

    hi_0123 = (c & 0x87878787) + bh·0x01010101
    hi_4567 = ((c << 1) & 0x80808080 | (c >> 3) & 0x07070707) + bh·0x01010101

and re-interleaves low and high bytes into the four words of the group. Raw blocks are copied
word for word. Which blocks are raw is uniform per block, so it becomes a per-block mask on the
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

from ..triton_interpreter import kernel_module
from .layout import COMPRESSED_BLOCK_BYTES, PAGE_TOKENS, RAW_BLOCK_BYTES, RAW_MARK, PageLayout
from . import reference
from .triton_checks import check_arena, check_index, check_layout, check_offsets

__all__ = ["analyze_open_pages", "compress_open_pages", "decompress_pages"]

# Warps per program of each kernel (benchmarks/codec.py sweeps these on the GPU).
NUM_WARPS = {"analyze": 2, "compress": 4, "decompress": 4}


# --------------------------------------------------------------------------------------------
# Index maps (jit helpers shared by the three kernels)
# --------------------------------------------------------------------------------------------

# Reductions: tl.reduce with triton.language's own combine functions, passed explicitly. The
# Triton interpreter recognises these objects and reduces with numpy (fast); tl.sum/tl.min/
# tl.max would not run under the interpreter copy of this module (see _kernel) when Triton was
# imported without TRITON_INTERPRET=1, and our own combine functions would be reduced element
# by element in Python (slow). On the GPU this is exactly what tl.sum/tl.min/tl.max compile to.

@triton.jit
def _sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def _minr(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_min)


@triton.jit
def _maxr(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)


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
    return (R * 16 + t) * (H * D // 2) + h * (D // 2) + cw


@triton.jit
def _record_starts(first, bh_ptr, NB: tl.constexpr):
    """Byte offsets from the page start of the NB blocks of one record, [NB] int32, and their
    metadata bytes [NB] uint32.

    start(j) = first + Σ_{i < j} size(i), size = 768 for a b/2 byte, 1024 for 0xFF. NB <= 8, so
    the prefix sum is NB-1 scalar terms (uniform scalar loads; no cross-thread reduction).
    """
    jj = tl.arange(0, NB)
    start = first + 0 * jj
    for i in tl.static_range(NB - 1):
        size_i = tl.where(tl.load(bh_ptr + i) == RAW_MARK_C, 1024, 768)
        start += tl.where(jj > i, size_i, 0)
    bh = tl.load(bh_ptr + jj).to(tl.uint32)
    return start, bh


RAW_MARK_C = tl.constexpr(RAW_MARK)


# --------------------------------------------------------------------------------------------
# Analyze: per-block base and per-page size
# --------------------------------------------------------------------------------------------

@triton.jit
def _tile_bases(w):
    """Tile [NB, 64, 4] of words -> per-block metadata byte b/2 or 0xFF [NB], and the tile's
    encoded bytes (scalar).

    Exponent of each half of a word: e = (w >> 7) & 0xFF and (w >> 23) & 0xFF.
    b = min(e) & ~1; compressible iff max(e) <= b + 15; 768 bytes if so, else 1024.
    """
    u = w.to(tl.uint32, bitcast=True)
    e_lo = (u >> 7) & 0xFF
    e_hi = (u >> 23) & 0xFF
    mn = _minr(_minr(tl.minimum(e_lo, e_hi), axis=2), axis=1)          # [NB]
    mx = _maxr(_maxr(tl.maximum(e_lo, e_hi), axis=2), axis=1)
    b = mn & 0xFE
    ok = mx <= b + 15
    return tl.where(ok, b >> 1, RAW_MARK_C), _sum(tl.where(ok, 768, 1024), axis=0)


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
def _lo16(w):
    """Low bytes of the two values of a word, packed into 16 bits: lo(v0) | lo(v1) << 8."""
    return (w & 0xFF) | ((w >> 8) & 0xFF00)


@triton.jit
def _code16(wa, wb, bh):
    """Code bytes of the value pairs (wa: values j, j+1; wb: values j+4, j+5) -> 16 bits.

    Lane-wise on the 16-bit halves: hi = high byte, d = (hi & 0x7F) − b/2 in 0..7, s = hi >> 7;
    code = s[j] << 7 | s[j+4] << 6 | d[j+4] << 3 | d[j], then the two lanes' bytes packed.
    The subtraction cannot borrow across lanes because (hi & 0x7F) >= b/2 in every lane of a
    compressible block (raw blocks' codes are never stored).
    """
    bh2 = bh * 0x00010001
    ha = (wa >> 8) & 0x00FF00FF
    hb = (wb >> 8) & 0x00FF00FF
    da = (ha & 0x007F007F) - bh2
    db = (hb & 0x007F007F) - bh2
    c = da | (db << 3) | (((hb >> 7) & 0x00010001) << 6) | (((ha >> 7) & 0x00010001) << 7)
    return (c & 0xFF) | ((c >> 8) & 0xFF00)


@triton.jit
def _encode_record(src, dst, bh_ptr, first, R: tl.constexpr, h, H: tl.constexpr,
                   D: tl.constexpr, NB: tl.constexpr, M: tl.constexpr):
    """Write record (h, R) of a compressed page at word pointer dst: its M metadata bytes and
    its NB block bodies, from the open page at word pointer src. bh_ptr: the record's NB
    metadata bytes; first: byte offset of its block 0 from the page start."""
    j, g, k = _group_index(NB)
    rec = h * 2 + R
    start, bh = _record_starts(first, bh_ptr, NB)                       # [NB] bytes, [NB]
    # metadata record, M/4 words: u32 offset of block 0, then the NB bytes b/2|0xFF
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
    w02, w13 = tl.split(tl.reshape(u, (NB, 64, 2, 2)))   # [.., i, o] = w_{2i+o}
    w0, w2 = tl.split(w02)
    w1, w3 = tl.split(w13)
    lo_0123 = _lo16(w0) | (_lo16(w1) << 16)
    lo_4567 = _lo16(w2) | (_lo16(w3) << 16)
    bhc = bh[:, None]
    code = _code16(w0, w2, bhc) | (_code16(w1, w3, bhc) << 16)
    lo = tl.join(lo_0123, lo_4567).to(tl.int32, bitcast=True)          # [NB, 64, 2]
    m = tl.arange(0, 2)[None, None, :]
    tl.store(dst + start_w + 2 * g + m, lo, mask=~is_raw)
    # (contiguity hint 1: one 4-byte store per thread in the layout the code words were
    # computed in, instead of moving them between threads for 8-byte stores)
    code_off = tl.max_contiguous(start_w1[:, None] + 128 + tl.arange(0, 64)[None, :], [1, 1])
    tl.store(dst + code_off, code.to(tl.int32, bitcast=True), mask=~raw1[:, None])


@triton.jit
def _compress_kernel(arena_ptr, src_ptr, dst_ptr, base_half_ptr, index_ptr,
                     H: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, M: tl.constexpr,
                     NBLK: tl.constexpr, INDEXED: tl.constexpr):
    """Program (i, h): writes the metadata records and block bodies of head h of output page i.

    Output page i encodes analyzed page p = index[i] (p = i without an index): source
    src[p], metadata base_half[p], destination dst[i]. Record r = 2h + R starts its blocks at

        first(r) = 2·H·M + r·NB·768 + 256 · #{raw blocks of records < r}

    (every block is 768 bytes plus 256 if raw), counted here from the page's 2·H·NB metadata
    bytes (one small vector load, shared in L1/L2 by the page's H programs): no prefix-sum pass
    and no gather before the launch.
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
    raw = tl.load(meta + q, mask=q < 2 * H * NB, other=0) == RAW_MARK_C
    for R in tl.static_range(2):
        rec = h * 2 + R
        n_raw = _sum(tl.where(raw & (q < rec * NB), 1, 0), axis=0)
        first = 2 * H * M + rec * (NB * COMPRESSED_C) + n_raw * (RAW_C - COMPRESSED_C)
        _encode_record(src, dst, meta + rec * NB, first, R, h, H, D, NB, M)


COMPRESSED_C = tl.constexpr(COMPRESSED_BLOCK_BYTES)
RAW_C = tl.constexpr(RAW_BLOCK_BYTES)


# --------------------------------------------------------------------------------------------
# Decompress
# --------------------------------------------------------------------------------------------

@triton.jit
def _decompress_kernel(arena_ptr, offsets_ptr, out_ptr,
                       H: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, M: tl.constexpr):
    """Program (p, h): decodes K and V of head h of compressed page p into out[p]."""
    pid = tl.program_id(0)
    p = pid // H
    h = pid % H
    off = tl.load(offsets_ptr + p)
    words = arena_ptr.to(tl.pointer_type(tl.int32))
    page_w = words + tl.multiple_of(off // 4, 4)
    out = out_ptr.to(tl.pointer_type(tl.int32)) + p.to(tl.int64) * (16 * H * D)
    j, g, k = _group_index(NB)
    for R in tl.static_range(2):
        rec = (h * 2 + R) * M
        first = tl.load(page_w + rec // 4)                                # u32 offset of block 0
        start, bh = _record_starts(first, arena_ptr + off + rec + 4, NB)  # b/2 or 0xFF bytes
        start_w1 = tl.multiple_of(start // 4, 4)
        start_w = start_w1[:, None, None]
        raw1 = bh == RAW_MARK_C
        is_raw = raw1[:, None, None]
        raw = tl.load(page_w + start_w + 4 * g + k, mask=is_raw, other=0)
        # Every tensor below has the tile's shape [NB, 64, 4] and the same register layout
        # (a thread owns the 4 words of a group), so no data moves between threads: each
        # thread loads the 16 bytes that hold its group's code word (codes of groups
        # 4(g/4) .. +3) and the 16 bytes that hold its two low-byte words (groups 2(g/2), +1),
        # then picks its own words with an in-thread select-and-sum over the 4 lanes.
        cw4 = tl.load(page_w + start_w + 128 + 4 * (g // 4) + k, mask=~is_raw, other=0)
        lw4 = tl.load(page_w + start_w + 4 * (g // 2) + k, mask=~is_raw, other=0)
        c = _sum(tl.where(k == g % 4, cw4, 0), axis=2)[:, :, None].to(tl.uint32, bitcast=True)
        lo_a = _sum(tl.where(k == 2 * (g % 2), lw4, 0), axis=2)[:, :, None]       # values 0..3
        lo_b = _sum(tl.where(k == 2 * (g % 2) + 1, lw4, 0), axis=2)[:, :, None]   # values 4..7
        lo = tl.where(k < 2, lo_a, lo_b).to(tl.uint32, bitcast=True)    # word k: lo word k//2
        # one add restores four high bytes; b/2 + d <= 127 so no byte carries into the next
        base4 = (bh & 0x7F)[:, None, None] * 0x01010101
        hi_0123 = (c & 0x87878787) + base4
        hi_4567 = (((c << 1) & 0x80808080) | ((c >> 3) & 0x07070707)) + base4
        hi = tl.where(k < 2, hi_0123, hi_4567)          # words 0,1: values 0..3; words 2,3: 4..7
        sh = 16 * (k % 2)                                # word k takes bytes 2(k%2), 2(k%2)+1
        y = (((lo >> sh) & 0xFF) | (((hi >> sh) & 0xFF) << 8)
             | (((lo >> (sh + 8)) & 0xFF) << 16) | (((hi >> (sh + 8)) & 0xFF) << 24))
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
    n_raw = (base_half == RAW_MARK).sum(1)
    return layout.min_page_bytes + n_raw * (RAW_BLOCK_BYTES - COMPRESSED_BLOCK_BYTES)


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
    if validate and P and bool(((base_half > 127) & (base_half != RAW_MARK)).any()):
        raise ValueError("base_half holds bytes that are neither b/2 (0..127) nor 0xFF; pass the "
                         "base_half returned by analyze_open_pages")
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
        last = base_half.flatten(1)[:, -1]
        ends = off + starts[:, -1] + torch.where(last == RAW_MARK, RAW_BLOCK_BYTES, COMPRESSED_BLOCK_BYTES)
        if bool((ends > arena.numel()).any()):
            raise reference.CorruptPageError("page metadata describes blocks past the end of the arena")
    kernel = _kernel("_decompress_kernel", device)
    kernel[(P * H,)](arena, off, out, H=H, D=D, NB=layout.blocks_per_head, M=layout.record_bytes,
                     num_warps=NUM_WARPS["decompress"])
    return out
