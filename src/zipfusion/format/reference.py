"""Reference codec in plain torch (CPU or CUDA): the definition (docs/format.md) the kernels are
checked against. All arithmetic is on integers, so decoding gives back every bit exactly.
"""

from __future__ import annotations

import torch

from .layout import (BLOCK_VALUES, COMPRESSED_BLOCK_BYTES, ESCAPE_CHUNK_BYTES, ESCAPE_FLAG,
                     ESCAPED_BLOCK_BYTES, GROUP_VALUES, MAX_ESCAPES, PAGE_TOKENS, RAW_BLOCK_BYTES,
                     RAW_MARK, PageLayout, block_bytes, from_blocks, to_blocks)


class CorruptPageError(ValueError):
    """A compressed page whose metadata does not describe a valid page."""



def _bits(x: torch.Tensor) -> torch.Tensor:
    """bf16 tensor -> its 16-bit patterns as int32 in 0..65535."""
    return x.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF


def block_base_half(bits: torch.Tensor) -> torch.Tensor:
    """bits [..., 512] -> each block's metadata byte: ``b/2`` (no escapes), ``0x80 | b/2``
    (1..MAX_ESCAPES escapes) or ``RAW_MARK``, straight from docs/format.md section 2's rule."""
    e = (bits >> 7) & 0xFF
    hist = torch.zeros(*e.shape[:-1], 257, dtype=torch.int32, device=e.device)
    hist.scatter_add_(-1, e + 1, torch.ones_like(e))
    below = torch.cumsum(hist, -1)
    b = torch.arange(0, 256, 2, device=e.device)
    n = e.shape[-1] - (below[..., (b + 16).clamp(max=256)] - below[..., b])
    v1 = e.amin(-1) & ~1
    fits = n.gather(-1, (v1 >> 1)[..., None])[..., 0] == 0
    last = n[..., :127].flip(-1)  # b/2 = 126 .. 0: argmin takes the largest b
    bh = 126 - last.argmin(-1)
    n_esc = last.amin(-1)
    meta = torch.where(n_esc <= MAX_ESCAPES, ESCAPE_FLAG | bh, torch.full_like(bh, RAW_MARK))
    return torch.where(fits, v1 >> 1, meta).to(torch.int32)


def block_base_half_v1(bits: torch.Tensor) -> torch.Tensor:
    """The v1 rule (no escapes): b/2 if max(e) <= (min(e) & ~1) + 15, else RAW_MARK."""
    e = (bits >> 7) & 0xFF
    b = e.amin(-1) & ~1
    return torch.where(e.amax(-1) <= b + 15, b >> 1, torch.full_like(b, RAW_MARK)).to(torch.int32)


def _escape_records(bits: torch.Tensor, bh: torch.Tensor, esc: torch.Tensor) -> torch.Tensor:
    """Each block's 16-byte escape chunk: records v | ((e >> 1) ^ b/2) << 9, zeros after."""
    v = torch.arange(bits.shape[-1], device=bits.device)
    pos = torch.where(esc, v, bits.shape[-1]).topk(MAX_ESCAPES, -1, largest=False).values
    hi7 = ((bits >> 8) & 0x7F).gather(-1, pos.clamp(max=bits.shape[-1] - 1))
    rec = torch.where(pos < bits.shape[-1], pos | ((hi7 ^ bh[..., None]) << 9), 0)
    chunk = torch.stack([rec & 0xFF, rec >> 8], -1).flatten(-2)
    return torch.nn.functional.pad(chunk, (0, ESCAPE_CHUNK_BYTES - 2 * MAX_ESCAPES))


def encode_blocks(bits: torch.Tensor, base_half: torch.Tensor) -> torch.Tensor:
    """Block bodies [..., 1024] uint8 (a compressed block uses the first 768, or 784, bytes)."""
    lo = bits & 0xFF
    s = bits >> 15
    bh = base_half & 0x7F
    d = (((bits >> 7) & 0xFF) - 2 * bh[..., None]) >> 1
    esc = ((d < 0) | (d > 7)) & (base_half != RAW_MARK)[..., None]
    d = torch.where(esc, 0, d)
    chunk = _escape_records(bits, bh, esc)
    s = s.unflatten(-1, (-1, GROUP_VALUES))
    d = d.unflatten(-1, (-1, GROUP_VALUES))
    codes = (s[..., :4] << 7) | (s[..., 4:] << 6) | (d[..., 4:] << 3) | d[..., :4]
    compressed = torch.cat([lo, codes.flatten(-2), chunk], dim=-1).to(torch.uint8)
    compressed = torch.nn.functional.pad(compressed, (0, RAW_BLOCK_BYTES - ESCAPED_BLOCK_BYTES))
    raw = bits.to(torch.int16).contiguous().view(torch.uint8)
    is_raw = (base_half == RAW_MARK)[..., None]
    return torch.where(is_raw, raw, compressed)


def decode_blocks(bodies: torch.Tensor, base_half: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`encode_blocks`: bodies [..., 1024] uint8 -> bits [..., 512] int32."""
    b = bodies.to(torch.int32)
    raw = b[..., 0::2] | (b[..., 1::2] << 8)
    lo = b[..., :BLOCK_VALUES]
    codes = b[..., BLOCK_VALUES:COMPRESSED_BLOCK_BYTES].unflatten(-1, (-1, 4))
    half = (base_half & 0x7F)[..., None, None]
    hi_first = (codes & 0x87) + half
    hi_last = (((codes << 1) & 0x80) | ((codes >> 3) & 0x07)) + half
    hi = torch.cat([hi_first, hi_last], dim=-1).flatten(-2)
    escaped = ((base_half & ESCAPE_FLAG) != 0) & (base_half != RAW_MARK)
    rec = b[..., COMPRESSED_BLOCK_BYTES:ESCAPED_BLOCK_BYTES:2] \
        | (b[..., COMPRESSED_BLOCK_BYTES + 1:ESCAPED_BLOCK_BYTES:2] << 8)
    rec = torch.where(escaped[..., None], rec[..., :MAX_ESCAPES], 0)
    v = torch.arange(BLOCK_VALUES, device=bodies.device)
    for r in range(MAX_ESCAPES):
        hi = hi ^ torch.where(v == (rec[..., r:r + 1] & 0x1FF), rec[..., r:r + 1] >> 9, 0)
    compressed = (hi << 8) | lo
    return torch.where((base_half == RAW_MARK)[..., None], raw, compressed)



def _check_pages(pages: torch.Tensor) -> PageLayout:
    if not isinstance(pages, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor of bfloat16 KV pages, got {type(pages).__name__}")
    if pages.dtype != torch.bfloat16:
        raise TypeError(f"KV pages must be torch.bfloat16 (the format is BF16-only), got {pages.dtype}; "
                        "convert with .to(torch.bfloat16) or run without KV compression")
    if pages.dim() != 5 or pages.shape[1] != 2 or pages.shape[2] != PAGE_TOKENS:
        raise ValueError("expected pages of shape [num_pages, 2, 16, num_kv_heads, head_dim] "
                         f"(K then V, 16 tokens), got {list(pages.shape)}")
    if not pages.is_contiguous():
        raise ValueError("KV pages must be contiguous; call .contiguous() first")
    return PageLayout(int(pages.shape[3]), int(pages.shape[4]))


def _rule(version: int):
    if version not in (1, 2):
        raise ValueError(f"format version must be 1 or 2, got {version!r}")
    return block_base_half if version == 2 else block_base_half_v1


def analyze_pages(pages: torch.Tensor, version: int = 2) -> torch.Tensor:
    """Per-block metadata bytes [P, H, 2, nb] (``version=1``: the no-escape rule)."""
    _check_pages(pages)
    return _rule(version)(_bits(to_blocks(pages)))


def page_sizes(pages: torch.Tensor, version: int = 2) -> torch.Tensor:
    """Encoded size of each page, [P] int64, without encoding."""
    layout = _check_pages(pages)
    meta = analyze_pages(pages, version)
    return layout.header_bytes + block_bytes(meta).flatten(1).sum(1).to(torch.int64)


def _block_starts(base_half: torch.Tensor, layout: PageLayout) -> torch.Tensor:
    """Byte offset of every block from its page's start, [P, NB] int64."""
    sizes = block_bytes(base_half.flatten(1)).to(torch.int64)
    return layout.header_bytes + torch.cumsum(sizes, 1) - sizes


def _headers(base_half: torch.Tensor, starts: torch.Tensor, layout: PageLayout) -> torch.Tensor:
    P, H, _, nb = base_half.shape
    first = starts.view(P, H, 2, nb)[..., 0]
    offset_bytes = torch.stack([(first >> (8 * i)) & 0xFF for i in range(4)], -1)
    pad = layout.record_bytes - 4 - nb
    records = torch.cat([offset_bytes, base_half.to(torch.int64),
                         offset_bytes.new_zeros(P, H, 2, pad)], -1)
    return records.reshape(P, layout.header_bytes).to(torch.uint8)


def encode_pages_into(pages: torch.Tensor, out: torch.Tensor, dst_offsets: torch.Tensor,
                      version: int = 2) -> torch.Tensor:
    """Encode pages [P, 2, 16, H, D] into ``out`` at ``dst_offsets``; returns their sizes
    (size the destinations with :func:`page_sizes` first)."""
    layout = _check_pages(pages)
    bits = _bits(to_blocks(pages))
    base_half = _rule(version)(bits)
    bodies = encode_blocks(bits, base_half)
    P = pages.shape[0]
    starts = _block_starts(base_half, layout)
    sizes = block_bytes(base_half.flatten(1))
    total = layout.header_bytes + sizes.sum(1).to(torch.int64)
    dst = dst_offsets.to(device=out.device, dtype=torch.int64).view(P, 1)
    if P and int((dst.view(-1) + total.to(dst.device)).max()) > out.numel():
        raise ValueError("destination buffer too small for the encoded pages")
    hdr_idx = dst + torch.arange(layout.header_bytes, device=out.device)
    out[hdr_idx.flatten()] = _headers(base_half, starts, layout).flatten().to(out.device)
    pos = torch.arange(RAW_BLOCK_BYTES, device=pages.device)
    keep = pos < sizes[..., None]
    idx = dst.to(pages.device)[..., None] + starts[..., None] + pos
    out[idx[keep].to(out.device)] = bodies.flatten(1, 3)[keep].to(out.device)
    return total


def encode_page(kv: torch.Tensor) -> torch.Tensor:
    """One page [2, 16, H, D] bf16 -> 1-D uint8 tensor."""
    if isinstance(kv, torch.Tensor) and (kv.dim() != 4 or kv.shape[:2] != (2, PAGE_TOKENS)):
        raise ValueError("expected one page of shape [2, 16, num_kv_heads, head_dim] (K then V, "
                         f"16 tokens), got {list(kv.shape)}")
    pages = kv[None] if isinstance(kv, torch.Tensor) else kv
    size = int(page_sizes(pages)[0])
    out = torch.empty(size, dtype=torch.uint8, device=kv.device)
    encode_pages_into(pages, out, torch.zeros(1, dtype=torch.int64))
    return out


def read_headers(buf: torch.Tensor, offsets: torch.Tensor, layout: PageLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Parse and check the metadata of pages at ``offsets`` -> (base_half, block starts);
    CorruptPageError when a record is malformed or a page would pass the buffer's end."""
    P = offsets.numel()
    H, nb, M = layout.num_kv_heads, layout.blocks_per_head, layout.record_bytes
    offsets = offsets.to(device=buf.device, dtype=torch.int64).view(P, 1)
    if P and (int(offsets.min()) < 0 or int(offsets.max()) + layout.header_bytes > buf.numel()):
        raise CorruptPageError("page location outside the buffer")
    hdr = buf[offsets + torch.arange(layout.header_bytes, device=buf.device)].to(torch.int64)
    rec = hdr.view(P, H, 2, M)
    base_half = rec[..., 4:4 + nb]
    if bool((rec[..., 4 + nb:] != 0).any()):
        raise CorruptPageError("metadata padding bytes are not zero")
    first = rec[..., 0] | (rec[..., 1] << 8) | (rec[..., 2] << 16) | (rec[..., 3] << 24)
    starts = _block_starts(base_half, layout)
    if not torch.equal(first, starts.view(P, H, 2, nb)[..., 0]):
        raise CorruptPageError("metadata block offsets are not contiguous after the header")
    return base_half.to(torch.int32), starts


def decode_pages(buf: torch.Tensor, offsets: torch.Tensor, num_kv_heads: int, head_dim: int,
                 sizes: torch.Tensor | None = None) -> torch.Tensor:
    """Decode the pages at ``offsets`` of ``buf`` -> [P, 2, 16, H, D] bf16; given ``sizes``, each
    page must end exactly there (CorruptPageError)."""
    layout = PageLayout(num_kv_heads, head_dim)
    _check_buffer(buf)
    base_half, starts = read_headers(buf, offsets, layout)
    P = offsets.numel()
    block_sizes = block_bytes(base_half.flatten(1))
    ends = starts[:, -1] + block_sizes[:, -1] if P else starts.new_zeros(0)
    offs = offsets.to(device=buf.device, dtype=torch.int64).view(P)
    if P and int((offs + ends).max()) > buf.numel():
        raise CorruptPageError("page metadata describes blocks past the end of the buffer")
    if sizes is not None and not torch.equal(ends, sizes.to(ends)):
        raise CorruptPageError("page metadata does not match the page's length")
    pos = torch.arange(RAW_BLOCK_BYTES, device=buf.device)
    idx = (offs[:, None, None] + starts[..., None] + pos).clamp(max=max(buf.numel() - 1, 0))
    bodies = buf[idx].view(P, layout.num_kv_heads, 2, layout.blocks_per_head, RAW_BLOCK_BYTES)
    bits = decode_blocks(bodies, base_half)
    return from_blocks(bits.to(torch.int16).view(torch.bfloat16))


def decode_page(buf: torch.Tensor, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Inverse of :func:`encode_page`."""
    _check_buffer(buf)
    offsets = torch.zeros(1, dtype=torch.int64, device=buf.device)
    sizes = torch.full((1,), buf.numel(), dtype=torch.int64)
    return decode_pages(buf, offsets, num_kv_heads, head_dim, sizes=sizes)[0]


def _check_buffer(buf: torch.Tensor) -> None:
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"expected a uint8 torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise TypeError(f"compressed pages live in a 1-D torch.uint8 tensor, got {buf.dtype} "
                        f"with shape {list(buf.shape)}")
    if not buf.is_contiguous():
        raise ValueError("the compressed buffer must be contiguous")
