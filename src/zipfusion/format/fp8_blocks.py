"""Lossless block format for FP8 E4M3 KV pages (docs/fp8_format.md), the torch reference codec: each
block keeps sign and mantissa and codes exponents against a base in the smallest allowed mode.
"""

from __future__ import annotations

import torch

from .layout import BLOCK_VALUES, PAGE_TOKENS, PageLayout, from_blocks, to_blocks
from .reference import CorruptPageError

RAW, BLK3, BLK2, COL2 = 0, 1, 2, 3
MODE_NAMES = ("raw", "blk3", "blk2", "col2")
BODY_BYTES = (512, 448, 384, 400)       # per mode, without the escape stream
CODE_BITS = (0, 3, 2, 2)
COLUMNS = 32
DESIGNS = {"blk3": (BLK3,), "blk2": (BLK2,), "col2": (COL2,), "adaptive": (BLK3, BLK2, COL2)}
DEFAULT_DESIGN = "adaptive"
MAX_BODY = 512 + 4 * (BLOCK_VALUES // 8)  # a body buffer that holds any mode's escapes
PAGE_ALIGN = 16                           # a stored page's size is a multiple of this (the arena's copy rows)


def exponent_field(codes: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes -> their 4-bit exponent fields ``(x >> 3) & 15`` (int64)."""
    return (codes.to(torch.int64) >> 3) & 15


def pack_fields(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` [..., n] of ``bits``-bit fields -> a plane [..., n·bits/8] uint8 (docs/fp8_format.md)."""
    p = 8 // bits
    x = x.to(torch.int64).unflatten(-1, (-1, p, 4))
    shift = (bits * torch.arange(p, device=x.device)).view(p, 1)
    return (x << shift).sum(-2).flatten(-2).to(torch.uint8)


def unpack_fields(plane: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_fields`: [..., m] bytes -> [..., m·8/bits] int64 fields."""
    p = 8 // bits
    y = plane.to(torch.int64).unflatten(-1, (-1, 1, 4))
    shift = (bits * torch.arange(p, device=plane.device)).view(p, 1)
    return ((y >> shift) & ((1 << bits) - 1)).flatten(-3)


def _best_window(e: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e [..., n] exponent fields -> (β, values outside the window) for the β with the fewest
    outside (the smallest such), each [...]."""
    hist = torch.zeros(*e.shape[:-1], 17, dtype=torch.int64, device=e.device)
    hist.scatter_add_(-1, e + 1, torch.ones_like(e))
    below = torch.cumsum(hist, -1)
    b = torch.arange(0, 17 - width, device=e.device)
    outside = e.shape[-1] - (below[..., b + width] - below[..., b])
    n, beta = outside.min(-1)
    return beta, n


def _mode_plan(e: torch.Tensor, mode: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks' exponent fields [N, 512] -> (per-value base [N, 512], escapes [N]) in ``mode``."""
    width = (1 << CODE_BITS[mode]) - 1
    if mode == COL2:
        beta, n = _best_window(e.view(-1, BLOCK_VALUES // COLUMNS, COLUMNS).transpose(1, 2), width)
        return beta.repeat(1, BLOCK_VALUES // COLUMNS), n.sum(-1)
    beta, n = _best_window(e, width)
    return beta[:, None].expand_as(e), n


def _escape_words(n: torch.Tensor) -> torch.Tensor:
    return (n + 7) // 8


def choose_modes(codes: torch.Tensor, design: str = DEFAULT_DESIGN) -> torch.Tensor:
    """E4M3 blocks [..., 512] -> each block's u16 metadata word of the smallest allowed mode."""
    modes = _design(design)
    e = exponent_field(codes).reshape(-1, BLOCK_VALUES)
    best_size = torch.full(e.shape[:1], BODY_BYTES[RAW], dtype=torch.int64, device=e.device)
    best_meta = torch.zeros_like(best_size)
    for mode in modes:
        base, n = _mode_plan(e, mode)
        w = _escape_words(n)
        size = BODY_BYTES[mode] + 4 * w
        beta = base[:, 0] if mode != COL2 else torch.zeros_like(n)
        better = size < best_size
        best_size = torch.where(better, size, best_size)
        best_meta = torch.where(better, beta | (mode << 4) | (w << 6), best_meta)
    return best_meta.view(codes.shape[:-1])


def block_sizes(meta: torch.Tensor) -> torch.Tensor:
    """Stored bytes of each block from its metadata word."""
    mode = (meta >> 4) & 3
    return torch.tensor(BODY_BYTES, device=meta.device)[mode] + 4 * (meta >> 6)


def _design(design: str) -> tuple[int, ...]:
    if design not in DESIGNS:
        raise ValueError(f"unknown FP8 block design {design!r}; use one of {sorted(DESIGNS)}")
    return DESIGNS[design]


def encode_blocks(codes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """E4M3 blocks [N, 512] and their metadata [N] -> bodies [N, MAX_BODY] uint8. Every mode is
    built for every block and the block's own kept: no data-dependent shape, no host sync."""
    x = codes.to(torch.int64)
    e = (x >> 3) & 15
    nib = ((x >> 4) & 8) | (x & 7)
    mode_of = ((meta >> 4) & 3)[:, None]
    out = torch.nn.functional.pad(x, (0, MAX_BODY - BLOCK_VALUES))
    for mode in (BLK3, BLK2, COL2):
        base, _ = _mode_plan(e, mode)
        k = CODE_BITS[mode]
        d = e - base
        esc = (d < 0) | (d >= (1 << k) - 1)
        d = torch.where(esc, (1 << k) - 1, d)
        parts = [pack_fields(base[:, :COLUMNS], 4)] if mode == COL2 else []
        parts.append(pack_fields(nib, 4))
        parts += [pack_fields(d & 3, 2), pack_fields(d >> 2, 1)] if k == 3 else [pack_fields(d, 2)]
        body = torch.cat(parts + [_pack_escapes(e, esc)], -1).to(torch.int64)
        out = torch.where(mode_of == mode, torch.nn.functional.pad(body, (0, MAX_BODY - body.shape[1])), out)
    return out.to(torch.uint8)


def _pack_escapes(e: torch.Tensor, esc: torch.Tensor) -> torch.Tensor:
    """Escaped exponents in value order, two per byte (low nibble first)."""
    order = torch.sort((~esc).to(torch.int8), dim=-1, stable=True).indices
    rank = torch.arange(BLOCK_VALUES, device=e.device)
    vals = torch.where(rank < esc.sum(-1, keepdim=True), e.gather(-1, order), 0)
    return vals[:, 0::2] | (vals[:, 1::2] << 4)


def decode_blocks(bodies: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`encode_blocks` (every mode decoded, the block's own kept: no host sync)."""
    b = torch.nn.functional.pad(bodies.to(torch.int64), (0, max(0, MAX_BODY - bodies.shape[1])))
    mode_of, beta = ((meta >> 4) & 3)[:, None], (meta & 15)[:, None]
    out = b[:, :BLOCK_VALUES]
    for mode in (BLK3, BLK2, COL2):
        k, at = CODE_BITS[mode], 0
        if mode == COL2:
            base = unpack_fields(b[:, :COLUMNS // 2], 4).repeat(1, BLOCK_VALUES // COLUMNS)
            at = COLUMNS // 2
        else:
            base = beta
        nib = unpack_fields(b[:, at:at + 256], 4)
        d = unpack_fields(b[:, at + 256:at + 384], 2)
        if k == 3:
            d = d | (unpack_fields(b[:, at + 384:at + 448], 1) << 2)
        esc = d == (1 << k) - 1
        rank = (torch.cumsum(esc, -1) - 1).clamp(min=0)
        stream = b[:, BODY_BYTES[mode]:]
        esc_e = (stream.gather(-1, (rank >> 1).clamp(max=stream.shape[1] - 1)) >> (4 * (rank & 1))) & 15
        e = torch.where(esc, esc_e, base + d)
        out = torch.where(mode_of == mode, ((nib & 8) << 4) | (e << 3) | (nib & 7), out)
    return out.to(torch.uint8)


def check_meta(meta: torch.Tensor, bodies: torch.Tensor | None = None) -> None:
    """Raise :class:`CorruptPageError` for metadata no encoder writes (and, given the bodies, an
    escape-stream length that does not match the escape codes)."""
    mode, beta = (meta >> 4) & 3, meta & 15
    if bool((meta >> 13).any()) or bool((meta < 0).any()):
        raise CorruptPageError("FP8 block metadata has bits above bit 12 set")
    limit = torch.tensor([0, 9, 13, 0], device=meta.device)[mode]
    if bool((beta > limit).any()):
        raise CorruptPageError("FP8 block metadata: base out of range for its mode")
    if bodies is None:
        return
    e_codes = _escape_counts(bodies.to(torch.int64), mode)
    if not torch.equal(_escape_words(e_codes), meta >> 6):
        raise CorruptPageError("FP8 block metadata: escape-stream length does not match the escape codes")


def _escape_counts(b: torch.Tensor, mode: torch.Tensor) -> torch.Tensor:
    count = torch.zeros_like(mode)
    for m in (BLK3, BLK2, COL2):
        at = COLUMNS // 2 if m == COL2 else 0
        d = unpack_fields(b[:, at + 256:at + 384], 2)
        if CODE_BITS[m] == 3:
            d = d | (unpack_fields(b[:, at + 384:at + 448], 1) << 2)
        count = torch.where(mode == m, (d == (1 << CODE_BITS[m]) - 1).sum(-1), count)
    return count



def _check_fp8_pages(pages: torch.Tensor) -> PageLayout:
    if not isinstance(pages, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor of E4M3 KV pages, got {type(pages).__name__}")
    if pages.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise TypeError(f"FP8 KV pages must be uint8 E4M3 codes or torch.float8_e4m3fn, got {pages.dtype}")
    if pages.dim() != 5 or pages.shape[1] != 2 or pages.shape[2] != PAGE_TOKENS:
        raise ValueError("expected pages of shape [num_pages, 2, 16, num_kv_heads, head_dim] "
                         f"(K then V, 16 tokens), got {list(pages.shape)}")
    return PageLayout(int(pages.shape[3]), int(pages.shape[4]))


def record_bytes(layout: PageLayout) -> int:
    return 8 * -(-(4 + 2 * layout.blocks_per_head) // 8)


def header_bytes(layout: PageLayout) -> int:
    return 2 * layout.num_kv_heads * record_bytes(layout)


def _round_up(n):
    return (n + PAGE_ALIGN - 1) // PAGE_ALIGN * PAGE_ALIGN


def _page_plan(meta: torch.Tensor, layout: PageLayout):
    """Metadata words [P, NB] -> (block sizes, block starts, padded page sizes)."""
    sizes = block_sizes(meta)
    header = header_bytes(layout)
    starts = header + torch.cumsum(sizes, 1) - sizes
    return sizes, starts, _round_up(header + sizes.sum(1))


def fp8_block_meta(pages: torch.Tensor, design: str = DEFAULT_DESIGN) -> torch.Tensor:
    _check_fp8_pages(pages)
    return choose_modes(to_blocks(pages.contiguous().view(torch.uint8)), design)


def fp8_page_sizes(pages: torch.Tensor, design: str = DEFAULT_DESIGN) -> torch.Tensor:
    """Encoded bytes of each E4M3 page, [P] int64, without encoding."""
    layout = _check_fp8_pages(pages)
    return _page_plan(fp8_block_meta(pages, design).flatten(1), layout)[2]


def encode_fp8_pages(pages: torch.Tensor, design: str = DEFAULT_DESIGN) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 pages [P, 2, 16, H, D] -> (bytes [P, W] uint8, sizes [P] int64), no host sync."""
    layout = _check_fp8_pages(pages)
    P, nb = pages.shape[0], layout.blocks_per_head
    blocks = to_blocks(pages.contiguous().view(torch.uint8)).reshape(P, -1, BLOCK_VALUES)
    meta = choose_modes(blocks, design)
    sizes, starts, total = _page_plan(meta, layout)
    first = starts.view(P, -1, nb)[..., 0]
    m = meta.view(P, -1, nb)
    rec = torch.cat([torch.stack([(first >> (8 * i)) & 0xFF for i in range(4)], -1),
                     torch.stack([m & 0xFF, m >> 8], -1).flatten(-2),
                     first.new_zeros(*first.shape, record_bytes(layout) - 4 - 2 * nb)], -1)
    header = header_bytes(layout)
    W = header + meta.shape[1] * MAX_BODY
    bodies = encode_blocks(blocks.reshape(-1, BLOCK_VALUES), meta.reshape(-1)).view(P, -1, MAX_BODY)
    j = torch.arange(MAX_BODY, device=pages.device)
    pos = torch.where(j < sizes[..., None], starts[..., None] + j, W)     # past a body: the dropped column W
    out = torch.zeros(P, W + PAGE_ALIGN, dtype=torch.uint8, device=pages.device)
    out[:, :header] = rec.flatten(1).to(torch.uint8)
    out.scatter_(1, pos.flatten(1), bodies.flatten(1))
    out[:, W] = 0
    return out, total


def decode_fp8_pages(buf: torch.Tensor, offsets: torch.Tensor, sizes: torch.Tensor | None,
                     num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Encoded pages at byte ``offsets`` of ``buf`` -> E4M3 codes [P, 2, 16, H, D], bit-exact.
    Given ``sizes``, every page is checked first (:class:`CorruptPageError`, host syncs);
    ``sizes=None`` trusts the bytes."""
    layout = PageLayout(num_kv_heads, head_dim)
    R, nb, header = record_bytes(layout), layout.blocks_per_head, header_bytes(layout)
    off = offsets.to(buf.device, torch.int64)
    P, dev = off.numel(), buf.device
    last = buf.numel() - 1
    rec = buf[(off[:, None] + torch.arange(header, device=dev)).clamp(max=last)].to(torch.int64).view(P, -1, R)
    first = rec[..., 0] | (rec[..., 1] << 8) | (rec[..., 2] << 16) | (rec[..., 3] << 24)
    meta = (rec[..., 4:4 + 2 * nb:2] | (rec[..., 5:4 + 2 * nb:2] << 8)).flatten(1)
    if sizes is not None:
        check_meta(meta)
        if bool((rec[..., 4 + 2 * nb:] != 0).any()):
            raise CorruptPageError("FP8 page record padding is not zero")
    bsize, starts, total = _page_plan(meta, layout)
    j = torch.arange(MAX_BODY, device=dev)
    at = (off[:, None, None] + starts[..., None] + j).clamp(max=last)
    bodies = torch.where(j < bsize[..., None], buf[at].to(torch.int64), 0).view(-1, MAX_BODY)
    if sizes is not None:
        sizes = torch.as_tensor(sizes, dtype=torch.int64, device=dev).reshape(-1)
        end = header + bsize.sum(1)
        pad = torch.arange(PAGE_ALIGN, device=dev)
        tail = buf[(off[:, None] + end[:, None] + pad).clamp(max=last)]
        if (not torch.equal(first, starts.view(P, -1, nb)[..., 0]) or not torch.equal(total, sizes)
                or bool((off + sizes > buf.numel()).any())):
            raise CorruptPageError("FP8 page records do not match the page's length and block offsets")
        if bool(((end[:, None] + pad < total[:, None]) & (tail != 0)).any()):
            raise CorruptPageError("FP8 page padding is not zero")
        check_meta(meta.reshape(-1), bodies)
    codes = decode_blocks(bodies, meta.reshape(-1))
    return from_blocks(codes.view(P, num_kv_heads, 2, nb, BLOCK_VALUES))


def encode_fp8_page(page: torch.Tensor, design: str = DEFAULT_DESIGN) -> torch.Tensor:
    """One E4M3 page [2, 16, H, D] -> a 1-D uint8 tensor."""
    if not isinstance(page, torch.Tensor) or page.dim() != 4:
        raise ValueError("expected one page of shape [2, 16, num_kv_heads, head_dim], got "
                         f"{list(page.shape) if isinstance(page, torch.Tensor) else type(page).__name__}")
    out, size = encode_fp8_pages(page[None], design)
    return out[0, :int(size[0])]


def decode_fp8_page(buf: torch.Tensor, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Inverse of :func:`encode_fp8_page`; :class:`CorruptPageError` if the records do not
    describe exactly ``buf``."""
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1:
        raise TypeError("an encoded FP8 page is a 1-D torch.uint8 tensor")
    if buf.numel() < header_bytes(PageLayout(num_kv_heads, head_dim)):
        raise CorruptPageError("FP8 page shorter than its records")
    at = torch.zeros(1, dtype=torch.int64, device=buf.device)
    return decode_fp8_pages(buf, at, torch.tensor([buf.numel()]), num_kv_heads, head_dim)[0]
