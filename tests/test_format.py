"""The page format's reference codec: bit-exact for every pattern, the block rule, the bytes."""

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from zipfusion.analysis.synthetic import model_like_pages, pages_with_fraction, realistic_pages
from zipfusion.format import (ESCAPE_FLAG, MAX_ESCAPES, RAW_MARK, CorruptPageError, PageLayout, analyze_pages, decode_page,
                              decode_pages, encode_page, encode_pages_into, from_blocks, page_sizes,
                              to_blocks)

from helpers import adversarial_escape_blocks, escape_pattern_blocks, pages_from_block_bits

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def bits(x):
    return x.view(torch.int16)


def roundtrip_batch(pages, device="cpu"):
    pages = pages.to(device)
    sizes = page_sizes(pages)
    # scatter the pages in a buffer, in reverse order and with gaps
    gaps = 16 * torch.arange(1, len(sizes) + 1, device=sizes.device)
    ends = torch.cumsum(sizes.flip(0) + gaps, 0)
    offsets = (ends - sizes.flip(0)).flip(0)
    buf = torch.full((int(ends[-1]) + 64,), 0xAB, dtype=torch.uint8, device=device)
    written = encode_pages_into(pages, buf, offsets)
    assert torch.equal(written.cpu(), sizes.cpu())
    out = decode_pages(buf, offsets, pages.shape[3], pages.shape[4], sizes=sizes)
    assert torch.equal(bits(out).cpu(), bits(pages).cpu())
    return out


ALL_PATTERNS = torch.arange(65536, dtype=torch.int32)


@pytest.mark.parametrize("device", DEVICES)
def test_every_pattern_in_compressible_blocks(device):
    # blocks of 512 consecutive patterns span at most 4 exponents: every block compresses
    pages = pages_from_block_bits(ALL_PATTERNS.view(-1, 512))
    assert bool((analyze_pages(pages) != RAW_MARK).all())
    roundtrip_batch(pages, device)


@pytest.mark.parametrize("device", DEVICES)
def test_every_pattern_at_the_largest_offset(device):
    # one block per exponent e: its 256 patterns (both signs, all fractions) next to fillers
    # with exponent f = (e - 14) & ~1, so the patterns sit at d = 7 (the top of the code range)
    blocks = []
    for e in range(256):
        pats = torch.arange(256, dtype=torch.int32)
        sign, frac = pats >> 7, pats & 0x7F
        values = (sign << 15) | (e << 7) | frac
        f = max(e - 14, 0) & ~1
        fill = (f << 7) | torch.arange(256, dtype=torch.int32) % 128
        blocks.append(torch.cat([values, fill]))
    pages = pages_from_block_bits(torch.stack(blocks))
    base = analyze_pages(pages).flatten()[:256]
    assert bool((base != RAW_MARK).all())
    roundtrip_batch(pages, device)


@pytest.mark.parametrize("device", DEVICES)
def test_every_pattern_in_raw_blocks(device):
    g = torch.Generator().manual_seed(1)
    shuffled = ALL_PATTERNS[torch.randperm(65536, generator=g)]
    pages = pages_from_block_bits(shuffled.view(-1, 512))
    assert bool((analyze_pages(pages) == RAW_MARK).all())
    roundtrip_batch(pages, device)


def brute_force_meta(bits):
    """The v2 block rule straight from docs/format.md, by comparing every value with every even
    base: [n, 512] bit patterns -> metadata bytes [n]."""
    e = (bits >> 7) & 0xFF
    b = torch.arange(0, 256, 2)
    n = ((e[:, :, None] < b) | (e[:, :, None] > b + 15)).sum(1)          # [n, 128]
    out = []
    for row, ev in zip(n.tolist(), e):
        v1 = int(ev.min()) & ~1
        if row[v1 // 2] == 0:
            out.append(v1 // 2)
            continue
        best = min(row[:127])
        bh = max(i for i in range(127) if row[i] == best)
        out.append(0x80 | bh if best <= MAX_ESCAPES else RAW_MARK)
    return torch.tensor(out, dtype=torch.int32)


@pytest.mark.parametrize("device", DEVICES)
def test_every_pattern_as_an_escape(device):
    # 16,384 blocks with exactly 4 escapes each: every pattern once, at every value index,
    # its exponent just outside the block's window (below or above)
    blocks = escape_pattern_blocks()
    pages = pages_from_block_bits(blocks, 2, 256)
    meta = analyze_pages(pages).flatten()[:blocks.shape[0]]
    assert bool(((meta & ESCAPE_FLAG) != 0).all() & (meta != RAW_MARK).all())
    assert torch.equal(meta[:64], brute_force_meta(blocks[:64]))
    layout = PageLayout(2, 256)
    assert bool((page_sizes(pages) == layout.page_bytes(layout.num_blocks, layout.num_blocks)).all())
    roundtrip_batch(pages, device)


@pytest.mark.parametrize("device", DEVICES)
def test_v1_pages_still_read(device):
    """Pages written in the seed format (version=1: blocks with outliers raw) decode to the same
    values; where no block needs an escape, v1 and v2 write the same bytes."""
    pages = model_like_pages(12, 2, 128, seed=5, counts={"K": (0.3, 0.1, 0.05, 0.05),
                                                          "V": (0.2, 0.1, 0.05, 0.05)})
    sizes = page_sizes(pages, version=1)
    assert bool((sizes > page_sizes(pages)).all())
    buf = torch.zeros(int(sizes.sum()), dtype=torch.uint8, device=device)
    offsets = torch.cumsum(sizes, 0) - sizes
    encode_pages_into(pages.to(device), buf, offsets.to(device), version=1)
    out = decode_pages(buf, offsets, 2, 128, sizes=sizes)
    assert torch.equal(bits(out).cpu(), bits(pages))
    plain = realistic_pages(2, 1, 64, seed=1, zero_fraction=0)
    plain = pages_from_block_bits(bits(plain).to(torch.int32).view(-1, 512) & ~0x7F80 | 0x3F00, 1, 64)
    v1, v2 = (torch.zeros(int(page_sizes(plain).sum()), dtype=torch.uint8) for _ in range(2))
    offs = torch.cumsum(page_sizes(plain), 0) - page_sizes(plain)
    encode_pages_into(plain, v1, offs, version=1)
    encode_pages_into(plain, v2, offs)
    assert torch.equal(v1, v2)


def test_adversarial_escape_blocks():
    blocks = adversarial_escape_blocks()
    pages = pages_from_block_bits(blocks, 1, 256)
    meta = analyze_pages(pages).flatten()[:blocks.shape[0]]
    assert meta.tolist() == [0xBC, RAW_MARK, 0xBC, 0xBC, 0xBC, RAW_MARK, 0xBC, 0xBC, 0xFE, 0x80]
    assert torch.equal(meta, brute_force_meta(blocks))
    roundtrip_batch(pages)
    buf = encode_page(pages[0])
    rec = buf[32 + 768:32 + 784].tolist()               # K block 0 of head 0, after 32 bytes of metadata
    words = [rec[2 * i] | rec[2 * i + 1] << 8 for i in range(8)]
    assert [w & 0x1FF for w in words[:4]] == [3, 100, 200, 511]     # index order
    assert words[4:] == [0] * 4                                     # the reserved half
    assert [w >> 9 for w in words[:4]] == [60] * 4                  # (e >> 1) ^ b/2, e = 0 or 1


@pytest.mark.parametrize("lo,hi,compressible", [
    (120, 135, True),    # span 15 from an even base
    (120, 136, False),   # span 16
    (120, 137, False),   # span 17
    (121, 135, True),    # odd minimum: b = 120, max = b + 15
    (121, 136, False),   # span 15 from an odd minimum still exceeds b + 15
    (0, 15, True),       # zeros / subnormals with small normals
    (0, 16, False),      # a zero next to exponent 16
    (240, 255, True),    # inf / NaN next to huge normals
    (239, 255, False),
])
def test_exponent_span_rule(lo, hi, compressible):
    g = torch.Generator().manual_seed(lo * 1000 + hi)
    e = torch.randint(lo, hi + 1, (512,), generator=g)
    e[0], e[1] = lo, hi
    pattern = (torch.randint(0, 2, (512,), generator=g) << 15) | (e << 7) | torch.randint(0, 128, (512,), generator=g)
    pages = pages_from_block_bits(pattern[None])
    assert (int(analyze_pages(pages).flatten()[0]) != RAW_MARK) == compressible
    roundtrip_batch(pages)


@pytest.mark.parametrize("value", [0x0000, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80, 0x7FC1, 0xFFFF, 0x3F80, 0xBF80])
def test_all_equal_blocks(value):
    # +0, -0, subnormals, +-inf, NaNs with payloads, +-1
    pages = pages_from_block_bits(torch.full((1, 512), value, dtype=torch.int32))
    assert int(analyze_pages(pages).flatten()[0]) != RAW_MARK
    out = roundtrip_batch(pages)
    assert int(bits(out).flatten()[0]) & 0xFFFF == value


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("heads", [1, 3, 8])
def test_realistic_kv_roundtrip(device, head_dim, heads):
    pages = realistic_pages(6, heads, head_dim, seed=head_dim + heads)
    roundtrip_batch(pages, device)
    for page in pages:
        buf = encode_page(page.to(device))
        assert buf.device.type == device and buf.dtype == torch.uint8 and buf.dim() == 1
        assert torch.equal(bits(decode_page(buf, heads, head_dim)).cpu(), bits(page))


@pytest.mark.parametrize("fraction,escaped", [(0.0, 0.0), (0.5, 0.0), (1.0, 0.0), (0.5, 0.25),
                                              (1.0, 1.0)])
def test_sizes_follow_the_compressible_fraction(fraction, escaped):
    layout = PageLayout(8, 128)
    pages = pages_with_fraction(4, 8, 128, fraction, escaped_fraction=escaped)
    meta = analyze_pages(pages)
    compressed = int((meta != RAW_MARK).sum())
    n_esc = int(((meta & ESCAPE_FLAG != 0) & (meta != RAW_MARK)).sum())
    assert compressed == round(fraction * 4 * layout.num_blocks)
    assert n_esc == round(escaped * 4 * layout.num_blocks)
    assert int(page_sizes(pages).sum()) == 4 * layout.page_bytes(0) - compressed * 256 + n_esc * 16
    roundtrip_batch(pages)


def test_block_grouping_maps():
    # K block j = channels 32j..32j+31 of all tokens; V block j = tokens 4j..4j+3 (D = 128)
    x = torch.arange(2 * 16 * 2 * 128, dtype=torch.float32).view(1, 2, 16, 2, 128)
    blocks = to_blocks(x)
    assert blocks.shape == (1, 2, 2, 4, 512)
    assert torch.equal(blocks[0, 1, 0, 2].view(16, 32), x[0, 0, :, 1, 64:96])
    assert torch.equal(blocks[0, 1, 1, 3].view(4, 128), x[0, 1, 12:16, 1, :])
    assert torch.equal(from_blocks(blocks), x)


def test_worked_example():
    # docs/format.md section 4: K block 0 of head 0 has exponents 120..133
    page = torch.full((2, 16, 1, 128), 0x3C00, dtype=torch.int32)      # exponent 120
    page[0, 0, 0, 2] = 0x4280                                          # exponent 133
    page[0, 0, 0, 0] = 0xBF95                                          # v = 0
    page[0, 0, 0, 4] = 0xC123                                          # v = 4
    kv = page.to(torch.int16).view(torch.bfloat16)
    buf = encode_page(kv)
    assert buf[:5].tolist() == [0x10, 0x00, 0x00, 0x00, 60]          # offset 16, b/2 = 60
    assert buf[16 + 0] == 0x95 and buf[16 + 4] == 0x23                  # low bytes untouched
    assert buf[16 + 512] == 0xEB                                        # the code byte of the example
    v_offset = int.from_bytes(bytes(buf[8:12].tolist()), "little")
    assert v_offset == 16 + 4 * 768
    assert buf.numel() == 16 + 8 * 768
    assert torch.equal(bits(decode_page(buf, 1, 128)), bits(kv))


def test_worked_example_v2():
    # docs/format.md section 4, v2: the same block with an exact zero at v = 5 -> one escape
    page = torch.full((2, 16, 1, 128), 0x3C00, dtype=torch.int32)
    page[0, 0, 0, 2] = 0x4280
    page[0, 0, 0, 0] = 0xBF95
    page[0, 0, 0, 4] = 0xC123
    page[0, 0, 0, 5] = 0x0000                                          # exponent 0: below b = 120
    kv = page.to(torch.int16).view(torch.bfloat16)
    buf = encode_page(kv)
    assert buf[:5].tolist() == [0x10, 0x00, 0x00, 0x00, 0xBC]          # 0x80 | b/2
    assert buf[16 + 512] == 0xEB and buf[16 + 513] == 0x00             # value 5: d = 0
    assert buf[16 + 768:16 + 784].tolist() == [0x05, 0x78] + [0] * 14   # 5 | (0 ^ 60) << 9
    assert int.from_bytes(bytes(buf[8:12].tolist()), "little") == 16 + 784 + 3 * 768
    assert buf.numel() == 16 + 784 + 7 * 768
    assert torch.equal(bits(decode_page(buf, 1, 128)), bits(kv))


# ------------------------------------------------------------------------------ hypothesis

@st.composite
def structured_pages(draw):
    """A page whose blocks share an exponent range, plus a few arbitrary patterns (0..6 per
    drawn position list: escapes, or too many of them) anywhere in the page."""
    heads = draw(st.integers(1, 2))
    head_dim = draw(st.sampled_from([64, 128, 256]))
    n = 2 * 16 * heads * head_dim
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    base = draw(st.integers(0, 255))
    span = draw(st.integers(0, 20))
    e = (base + torch.randint(0, span + 1, (n,), generator=g)).clamp(max=255)
    sign = torch.randint(0, 2, (n,), generator=g)
    frac = torch.randint(0, 128, (n,), generator=g)
    pattern = (sign << 15) | (e << 7) | frac
    spots = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, 65535)), max_size=6))
    for i, p in spots:
        pattern[i] = p
    return pattern.to(torch.int16).view(torch.bfloat16).view(2, 16, heads, head_dim)


@settings(max_examples=60, deadline=None)
@given(structured_pages())
@example(torch.zeros(2, 16, 1, 64, dtype=torch.bfloat16))
def test_property_roundtrip_and_rule(kv):
    heads, head_dim = kv.shape[2], kv.shape[3]
    buf = encode_page(kv)
    assert torch.equal(bits(decode_page(buf, heads, head_dim)), bits(kv))
    blocks = to_blocks(kv[None]).view(torch.int16).to(torch.int32) & 0xFFFF
    expect = brute_force_meta(blocks.view(-1, 512)).view(blocks.shape[:-1])
    assert torch.equal(analyze_pages(kv[None]), expect)
    n_c = int((expect != RAW_MARK).sum())
    n_e = int(((expect & ESCAPE_FLAG) != 0).sum()) - (expect.numel() - n_c)
    assert buf.numel() == PageLayout(heads, head_dim).page_bytes(n_c, n_e)


# ------------------------------------------------------------------------------ bad input

def test_bad_inputs_are_named():
    kv = realistic_pages(1, 2, 128)[0]
    with pytest.raises(TypeError, match="bfloat16"):
        encode_page(kv.float())
    with pytest.raises(ValueError, match=r"\[2, 16, num_kv_heads, head_dim\]"):
        encode_page(kv[:, :8])
    with pytest.raises(ValueError, match="head_dim=96"):
        encode_page(torch.zeros(2, 16, 2, 96, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        encode_page(kv.transpose(2, 3).contiguous().transpose(2, 3))
    with pytest.raises(TypeError, match="torch.Tensor"):
        encode_page(kv.tolist())
    buf = encode_page(kv)
    with pytest.raises(TypeError, match="uint8"):
        decode_page(buf.to(torch.int8), 2, 128)
    with pytest.raises(ValueError, match="head_dim"):
        decode_page(buf, 2, 100)


def corrupt(buf, index, value):
    out = buf.clone()
    out[index] = value
    return out


def test_corrupt_metadata_is_detected_not_read_past():
    kv = pages_with_fraction(1, 2, 128, 0.5)[0]
    buf = encode_page(kv)
    base = analyze_pages(kv[None]).flatten()
    raw_byte = 4 + int((base[:4] == RAW_MARK).nonzero()[0]) if bool((base[:4] == RAW_MARK).any()) else None
    cases = {
        "block byte changes its size": corrupt(buf, 4, 0x80),   # 784 bytes: offsets disagree
        "bad offset": corrupt(buf, 0, int(buf[0]) + 16),
        "truncated": buf[:-100].clone(),
        "extended": torch.cat([buf, torch.zeros(16, dtype=torch.uint8)]),
    }
    if raw_byte is not None:   # a raw block relabelled as compressed changes the page length
        cases["raw relabelled"] = corrupt(buf, raw_byte, 60)
    for name, bad in cases.items():
        with pytest.raises(CorruptPageError):
            decode_page(bad, 2, 128)
    # D = 64: records carry 2 padding bytes, which must stay zero
    buf64 = encode_page(pages_with_fraction(1, 1, 64, 1.0)[0])
    with pytest.raises(CorruptPageError, match="padding"):
        decode_page(corrupt(buf64, 7, 1), 1, 64)
    # a header that claims more bytes than the arena holds
    with pytest.raises(CorruptPageError):
        decode_pages(buf, torch.tensor([buf.numel() - 8]), 2, 128)
