"""Paged decode attention over FP8 pages in the lossless block format, restored in registers.

The pages are E4M3 KV pages (``format.fp8.Fp8PageLayout``), each either *open* (``[2, 16, H, D]``
at one byte a value, as ``fp8_attention.py`` reads them) or *encoded*: the byte string of
``format.fp8_blocks.encode_fp8_page`` (records, then block bodies). ``page_loc`` tells them apart
as it tells open from compressed BF16 pages (format/layout.py): bit 0 set, an open page at
``loc_offset(loc)``; bit 0 clear, an encoded one there. A batch may mix the two, and, as for BF16,
a request's last, partial page must be open (the engine encodes full pages only).

Per tile of TP pages and per role (K, V) the kernel rebuilds the tile's E4M3 bytes ``[16·TP, D]``
(head h; token-major, exactly what the open-FP8 kernel loads), then runs *the open-FP8 kernel's
arithmetic*: ``fp8_kv.e4m3_dequant`` and ``triton_attention.begin_split`` / ``attend_tile`` /
``store_split``, the same split plan and merge kernel. So its output is, bit for bit,
``decode_attention_fp8``'s over open pages holding the same bytes, with the same tile, splits
and scales.

The restore (docs/fp8_format.md section 2 has the format) works on *words*: 4 values ``4i .. 4i+3``
of a 512-value block in the 4 byte lanes of a uint32. A tile's blocks are held *block-major*,
``[TP·NB, 128]`` words (NB = D/32 blocks per head and role; block ``b`` = page slot ``b // NB``,
block ``j = b % NB``); K blocks (channel-grouped: 16 tokens x 32 channels) are permuted back to
token-major rows at the end, V blocks (token-grouped: ``512/D`` whole rows each) already are.

1. Where (per block). The (head, role) record at ``page + (2h + role)·R``: u32 ``first``, a u16
   metadata word ``β | mode << 4 | w << 6`` per block. Block j's body starts at::

       body_j = page + first + Σ_{j' < j} (BODY_BYTES[mode_j'] + 4·w_j')

2. Restore (per word i, SWAR: every op acts on the 4 lanes at once). The planes (``b``-bit fields,
   ``p = 8/b`` a byte) put value ``4i + l`` in byte lane ``l`` of word ``i // p``, at bit ``b·(i % p)``::

       n = (nib[i // 2] >> 4·(i % 2)) & 0x0F0F0F0F                 sign | mantissa   (s << 3 | m)
       d = (code[i // 4] >> 2·(i % 4)) & 0x03030303                 2-bit codes
       d |= ((bit[i // 8] >> (i % 8)) & 0x01010101) << 2             blk3: the codes' third bit
       β = β·0x01010101, or col2: (bases[(i % 8) // 2] >> 4·(i % 2)) & 0x0F0F0F0F   (column = v & 31)
       esc = d & d >> 1 [& d >> 2] & 0x01010101                     1 in the lanes whose code is all ones
       d ^= esc · (2^k - 1)                                          escapes' codes zeroed
       byte = n + 15·(n & 0x08080808) + 8·(β + d)                   = s << 7 | (β + d) << 3 | m

   (``n + 15·(n & 8) = 128·s + m``; ``β + d <= 15`` for valid metadata: no lane carries into
   the next.) A raw block's word, and an open page's, is its plain word.

3. Escapes (only in tiles with a block of ``w > 0``: a scalar branch). An escaped value's
   exponent is entry ``r`` of its block's stream of 4-bit exponents (at ``body + BODY_BYTES[mode]``,
   two a byte, low nibble first), ``r`` = escapes before it in the block::

       P = esc · 0x01010101              lane l of P: escapes in lanes 0..l of the word (<= 4)
       r_i = Σ_{i' < i} P_i' >> 24         escapes before word i (an exclusive scan of the block's words)
       win = stream nibbles r_i .. r_i + 3   (two stream words, funnel-shifted)
       e_l = nibble (lane l of P << 8) of win              (escapes in lanes < l)
       byte_l ^= (β_l ^ e_l) << 3          where lane l escaped (its exponent field holds β_l)

Corrupt records. The kernel clamps rather than validates them: the escape counts ``w`` are
taken at most 64 (512 values), every block body is moved inside the arena (``0 <= body`` and
``body + BODY_BYTES[mode] + 4·w <= arena bytes``) and no stream word at or past ``w`` is read,
so no metadata makes it read outside the arena: a corrupt page gives wrong values, never a
fault. Page *locations* are checked on the host as for the other kernels (``validate``: aligned,
the smallest encoded page, ``Fp8PageLayout.min_page_bytes``, inside the arena, the last partial
page open); the reference decoder (``decode_fp8_page``) refuses corrupt records outright.

Triton on any GPU it compiles for and, on CPU tensors, through the interpreter (module
``triton_interpreter``), like ``fp8_attention.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..format.fp8_blocks import BLK2, BLK3, BODY_BYTES, COL2, RAW, record_bytes
from ..format.layout import BLOCK_VALUES, PAGE_TOKENS, loc_is_compressed, loc_offset
from .triton_interpreter import kernel_module, same_mode
from . import fp8_kv, triton_attention
from .decode_attention import LOG2E
from .fp8_attention import NUM_STAGES, run_fp8_decode

_TA = same_mode(triton_attention)                    # the BF16 kernels' arithmetic, in this mode
_begin_split, _attend_tile, _store_split = _TA.begin_split, _TA.attend_tile, _TA.store_split
_add, _sum, _max = _TA._add, _TA._sum, _TA._max      # reductions written with builtins only
_dequant = same_mode(fp8_kv).e4m3_dequant
_loc_offset = triton.jit(loc_offset)
_loc_is_compressed = triton.jit(loc_is_compressed)
PT = tl.constexpr(PAGE_TOKENS)
WORDS = tl.constexpr(BLOCK_VALUES // 4)              # 128 words of 4 values per block
MAX_W = tl.constexpr(BLOCK_VALUES // 8)              # escape-stream words of a block, at most
M_RAW, M_BLK3, M_BLK2, M_COL2 = (tl.constexpr(m) for m in (RAW, BLK3, BLK2, COL2))
B_RAW, B_BLK3, B_BLK2, B_COL2 = (tl.constexpr(BODY_BYTES[m]) for m in (RAW, BLK3, BLK2, COL2))


def _interpreting() -> bool:
    return not isinstance(_fp8_lossless_kernel, triton.runtime.jit.JITFunction)


@triton.jit
def _body_bytes(mode):
    """BODY_BYTES[mode]: a block's body without its escape stream."""
    return tl.where(mode == M_RAW, B_RAW, tl.where(mode == M_BLK3, B_BLK3, tl.where(mode == M_BLK2, B_BLK2, B_COL2)))


@triton.jit
def _blocks(arena32, n_words, loc, enc, h, ROLE: tl.constexpr, NB: tl.constexpr, REC: tl.constexpr):
    """Per block of the tile ([TP·NB]: page slot b // NB, block j = b % NB of head h, role ROLE):
    its body's word address (clamped into the arena), mode, β and escape words w, from the
    record. ``enc``: the block's page is an encoded page of the tile (else all 0: raw)."""
    j = tl.arange(0, loc.shape[0]) % NB
    rec = (_loc_offset(loc) + (2 * h + ROLE) * REC) // 4          # the record, in words
    first = tl.load(arena32 + rec, mask=enc, other=0).to(tl.uint32, bitcast=True).to(tl.int64)
    # all NB metadata words of the record: u16 number jj in word 1 + jj // 2
    jj = tl.arange(0, NB)[None, :]
    mw = tl.load(arena32 + rec[:, None] + 1 + jj // 2, mask=enc[:, None], other=0)
    metas = (mw >> (16 * (jj % 2))) & 0xFFFF
    sizes = _body_bytes((metas >> 4) & 3) + 4 * tl.minimum((metas >> 6) & 127, MAX_W)
    prefix = _sum(tl.where(jj < j[:, None], sizes, 0), 1)        # bytes of the blocks before j
    meta = _sum(tl.where(jj == j[:, None], metas, 0), 1)
    mode = (meta >> 4) & 3
    w = tl.minimum((meta >> 6) & 127, MAX_W)
    size = _body_bytes(mode) + 4 * w
    body = (_loc_offset(loc) + first + prefix) // 4
    body = tl.maximum(tl.minimum(body, n_words - size // 4), 0)   # corrupt records stay inside
    return body, mode, meta & 15, w


@triton.jit
def _restore_words(arena32, plain, body, mode, beta, packed, valid, i):
    """Step 2 of the module docstring: the words [TP·NB, 128] of the tile's blocks, uint32, and
    per word its escape-lane mask and lane bases (β·0x01010101, or col2's). ``plain``: the word
    address of an open page's or a raw block's word; ``packed``: blocks in blk3/blk2/col2."""
    x = tl.load(arena32 + plain, mask=valid, other=0).to(tl.uint32, bitcast=True)
    pk = packed[:, None] & valid
    blk3 = (mode == M_BLK3)[:, None]
    col2 = (mode == M_COL2)[:, None]
    at = body[:, None] + tl.where(col2, 4, 0)                    # col2's 16 bytes of bases first
    c = tl.load(arena32 + at + 64 + i // 4, mask=pk, other=0).to(tl.uint32, bitcast=True)
    b1 = tl.load(arena32 + body[:, None] + 96 + i // 8, mask=pk & blk3, other=0).to(tl.uint32, bitcast=True)
    bw = tl.load(arena32 + body[:, None] + (i % 8) // 2, mask=pk & col2, other=0).to(tl.uint32, bitcast=True)
    n = (x >> (4 * (i % 2))) & 0x0F0F0F0F                        # (x is the nibble word where packed)
    d = ((c >> (2 * (i % 4))) & 0x03030303) | (((b1 >> (i % 8)) & 0x01010101) << 2)
    base = tl.where(col2, (bw >> (4 * (i % 2))) & 0x0F0F0F0F, (beta * 0x01010101).to(tl.uint32)[:, None])
    esc = d & (d >> 1) & tl.where(blk3, d >> 2, 0x01010101) & 0x01010101
    d = d ^ (esc * tl.where(blk3, 7, 3).to(tl.uint32))
    y = n + 15 * (n & 0x08080808) + 8 * (base + d)
    return tl.where(pk, y, x), tl.where(pk, esc, 0), base


@triton.jit
def _patch_escapes(arena32, x, esc, base, body, mode, w):
    """Step 3 of the module docstring: each escaped lane's exponent from its block's stream. The
    escapes of a word have the consecutive ranks r .. r + 3 at most: its window of 4 stream
    nibbles comes from the two stream words r // 8 and r // 8 + 1, read only where it has
    escapes (and the second only where the window crosses into it), and never past ``w`` words."""
    p = esc * 0x01010101                                           # lane l: escapes in lanes 0..l
    cnt = (p >> 24).to(tl.int32)                                   # escapes in the word
    r = tl.associative_scan(cnt, 1, _add) - cnt                    # ... in the block's words before it
    at = (body + _body_bytes(mode) // 4)[:, None] + r // 8         # the stream's word r // 8
    lo = tl.load(arena32 + at, mask=(cnt > 0) & (r // 8 < w[:, None]), other=0)
    hi = tl.load(arena32 + at + 1, mask=(r % 8 + cnt > 8) & (r // 8 + 1 < w[:, None]), other=0)
    win = (((hi.to(tl.uint32, bitcast=True).to(tl.uint64) << 32) | lo.to(tl.uint32, bitcast=True).to(tl.uint64))
           >> (4 * (r % 8))).to(tl.uint32)                         # nibble k: the word's k-th escape
    lanes_before = p << 8                                          # lane l: escapes in lanes < l
    patch = tl.full(x.shape, 0, tl.uint32)
    for lane in tl.static_range(4):
        e = win >> (4 * ((lanes_before >> (8 * lane)) & 0xFF))
        patch = patch | (((e ^ (base >> (8 * lane))) & 15) << (8 * lane + 3))
    return x ^ (patch & (esc * 0x78))                              # exponent bits 3..6 of escaped lanes


@triton.jit
def _role_tile(arena32, n_words, loc, enc, page, ctx, h, ROLE: tl.constexpr,
               H: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, REC: tl.constexpr):
    """The E4M3 bytes [16·TP, D] (uint8, token-major) of role ROLE (0 = K, 1 = V), head h, of a
    tile whose blocks ([TP·NB]) lie in pages ``page`` at ``loc`` (``enc``: encoded); rows past
    the context are 0, as the open-FP8 kernel loads them."""
    NBLK: tl.constexpr = loc.shape[0]
    TP: tl.constexpr = NBLK // NB
    j = (tl.arange(0, NBLK) % NB)[:, None]
    i = tl.arange(0, WORDS)[None, :]
    # token and channel of word i of block j: K blocks are 16 tokens x 32 channels, V blocks 512/D rows
    if ROLE == 0:
        t = i // 8
        ch = 32 * j + 4 * (i % 8)
    else:
        t = j * (512 // D) + i // (D // 4)
        ch = 4 * (i % (D // 4))
    valid = (page * PT)[:, None] + t < ctx
    body, mode, beta, w = _blocks(arena32, n_words, loc, enc, h, ROLE, NB, REC)
    packed = enc & (mode != M_RAW)
    open_w = (_loc_offset(loc)[:, None] + ((ROLE * PT + t) * H + h) * D + ch) // 4
    nib = tl.where(mode == M_COL2, 4, 0)[:, None] + i // 2        # the nibble plane (after col2's bases)
    plain = tl.where(enc[:, None], body[:, None] + tl.where(packed[:, None], nib, i), open_w)
    x, esc, base = _restore_words(arena32, plain, body, mode, beta, packed, valid, i)
    if _max(tl.where(packed & (w > 0), 1, 0), 0) != 0:          # a block of the tile has escapes
        x = _patch_escapes(arena32, x, esc, base, body, mode, w)
    x = tl.where(valid, x, 0)
    if ROLE == 0:             # K: [TP, NB, 16 tokens, 8 words] -> [TP, 16, NB, 8] = token rows
        x = tl.permute(tl.reshape(x, (TP, NB, PT, 8)), (0, 2, 1, 3))
    x = tl.reshape(x, (TP * PT, D // 4))
    # words -> bytes in channel order (lane l of word k = channel 4k + l)
    b0, b1, b2, b3 = x & 0xFF, (x >> 8) & 0xFF, (x >> 16) & 0xFF, x >> 24
    return tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), (TP * PT, D)).to(tl.uint8)


@triton.jit(do_not_specialize=["stride_bt", "pages_per_split", "num_splits", "n_words"])
def _fp8_lossless_kernel(q_ptr, arena32, page_loc_ptr, bt_ptr, ctx_ptr, out_ptr, part_o_ptr,
                         part_lse_ptr, qk_scale, k_scale, v_scale, stride_bt, pages_per_split, num_splits,
                         n_words, H: tl.constexpr, D: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                         TP: tl.constexpr, REC: tl.constexpr, INTERPRET: tl.constexpr):
    """Program (b, h, s): request b, KV head h, split s; the G query heads of the group at once."""
    NB: tl.constexpr = D // 32
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    ctx, p_begin, p_end, q, q_rows, t, slot, m_i, l_i, acc = _begin_split(
        q_ptr, ctx_ptr, b, h, s, pages_per_split, num_splits, H, D, G, G_PAD, TP)
    blk_slot = tl.arange(0, TP * NB) // NB                        # each block's page slot
    for p0 in range(p_begin, p_end, TP):
        valid = (p0 + slot < p_end) & ((p0 + slot) * PT + t < ctx)
        page = p0 + blk_slot
        in_range = page < p_end
        pid = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + page, mask=in_range, other=0)
        loc = tl.load(page_loc_ptr + pid.to(tl.int64), mask=in_range, other=1)
        enc = in_range & _loc_is_compressed(loc)
        page = tl.where(in_range, page, 1 << 24)                  # (rows of no page: past ctx)
        kb = _role_tile(arena32, n_words, loc, enc, page, ctx, h, 0, H, D, NB, REC)
        vb = _role_tile(arena32, n_words, loc, enc, page, ctx, h, 1, H, D, NB, REC)
        m_i, l_i, acc = _attend_tile(valid[None, :], _dequant(kb, k_scale), _dequant(vb, v_scale), q,
                                     m_i, l_i, acc, qk_scale, INTERPRET, True)
    _store_split(acc, m_i, l_i, q_rows, s, num_splits, out_ptr, part_o_ptr, part_lse_ptr, G, D)


def decode_attention_fp8_lossless(q, arena, page_loc_layer, block_table, context_lens, layout, sm_scale,
                                  out=None, *, k_scale: float = 1.0, v_scale: float = 1.0,
                                  num_splits: int | None = None, split_pages: int | None = None,
                                  validate: bool = True, tile_pages: int | None = None,
                                  num_warps: int | None = None, num_stages: int | None = None):
    """Paged decode attention over FP8 pages, open or encoded in the lossless block format
    (module docstring): the arguments and the result of
    :func:`~zipfusion.kernels.fp8_attention.decode_attention_fp8`, bit for bit, where
    ``page_loc_layer`` may also point (bit 0 clear) at pages from
    :func:`~zipfusion.format.fp8_blocks.encode_fp8_page`. ``validate`` checks the page
    locations on the host (one sync); records are clamped in the kernel, not validated.
    """
    def launch(grid, q, out, plan, TP, G, k_scale, v_scale, interp):
        m = kernel_module(arena.device, __name__, __file__, _interpreting())
        arena32 = arena[:arena.numel() // 4 * 4].view(torch.int32)
        m._fp8_lossless_kernel[grid](
            q, arena32, page_loc_layer, block_table, context_lens, out, plan.part_o, plan.part_lse,
            float(sm_scale) * LOG2E, k_scale, v_scale, block_table.stride(0), plan.pages, plan.count,
            arena32.numel(), H=layout.num_kv_heads, D=q.shape[2], G=G, G_PAD=max(16, triton.next_power_of_2(G)),
            TP=TP, REC=record_bytes(layout), INTERPRET=interp, num_warps=num_warps or 4,
            num_stages=num_stages or NUM_STAGES)
    return run_fp8_decode(launch, q, arena, page_loc_layer, block_table, context_lens, layout, sm_scale, out,
                          k_scale, v_scale, num_splits, split_pages, validate, tile_pages, None)
