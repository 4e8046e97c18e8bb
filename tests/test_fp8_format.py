"""FP8 E4M3 quantization (vLLM's fp8 KV cache) and the lossless block format on top of it."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from zipfusion.format import CorruptPageError, PageLayout
from zipfusion.format.fp8 import E4M3_MAX, dequantize_e4m3, head_scales, quantize_e4m3
from zipfusion.format.fp8_blocks import (BLK2, BLK3, BODY_BYTES, COL2, DESIGNS, RAW, block_sizes, choose_modes,
                                         decode_blocks, decode_fp8_page, encode_blocks, encode_fp8_page, fp8_block_meta,
                                         fp8_page_sizes, pack_fields, record_bytes, unpack_fields)

ALL_CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8)
NAN_CODES = (0x7F, 0xFF)


def e4m3_values() -> torch.Tensor:
    """Every code's value from the definition (s, e, m), NaN for 0x7F/0xFF: independent of torch's fp8."""
    c = torch.arange(256, dtype=torch.float64)
    s, e, m = torch.div(c, 128, rounding_mode="floor"), torch.div(c, 8, rounding_mode="floor") % 16, c % 8
    mag = torch.where(e == 0, 2.0 ** -6 * m / 8, 2.0 ** (e - 7) * (1 + m / 8))
    v = torch.where(s == 1, -mag, mag)
    v[list(NAN_CODES)] = float("nan")
    return v


# ---- quantization ------------------------------------------------------------------------------

def test_dequantize_matches_the_definition():
    ref = e4m3_values()
    got = dequantize_e4m3(ALL_CODES, dtype=torch.float32).double()
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    ok = ~torch.isnan(ref)
    assert torch.equal(got[ok], ref[ok]) and float(ref[ok].abs().max()) == E4M3_MAX


def test_quantize_is_round_to_nearest_even_with_saturation():
    """Against a brute-force nearest-value search (ties to the even mantissa), fp32 inputs
    between and beyond the codes, both signs, with scale 1 and 0.25."""
    ref = e4m3_values()
    finite = [c for c in range(256) if c not in NAN_CODES]
    vals, codes = ref[finite], torch.tensor(finite)
    g = torch.Generator().manual_seed(0)
    x = torch.cat([vals, (vals[:-1] + vals[1:]) / 2, torch.randn(4000, generator=g, dtype=torch.float64) * 40,
                   torch.tensor([500.0, -1e6, 449.0, 464.0, -464.0, 1e-5, -1e-5, 0.0])]).float()
    for scale in (1.0, 0.25):
        y = (x.double() / scale).clamp(-E4M3_MAX, E4M3_MAX)
        dist = (y[:, None] - vals[None]).abs()
        best = dist.min(1, keepdim=True).values
        tie_even = torch.where(dist == best, (codes % 2 == 0).double() * 2 + (codes < 128).double(), -1.0)
        want = codes[tie_even.argmax(1)]
        got = quantize_e4m3(x, scale).long()
        same_value = ref[got] == ref[want]                    # +0 and -0 both valid for a zero result
        assert bool(same_value.all()), x[~same_value][:5]
    assert quantize_e4m3(torch.tensor([448.0, 1e9, -1e9, float("inf")])).tolist() == [0x7E, 0x7E, 0xFE, 0x7E]
    assert int(quantize_e4m3(torch.tensor([float("nan")]))[0]) in NAN_CODES


def test_quantize_keeps_every_code_and_per_head_scale_reaches_448():
    finite = torch.tensor([c for c in range(256) if c not in NAN_CODES], dtype=torch.uint8)
    assert torch.equal(quantize_e4m3(dequantize_e4m3(finite, dtype=torch.float32)), finite)
    x = torch.randn(32, 3, 64, dtype=torch.bfloat16) * torch.tensor([0.01, 1.0, 300.0]).view(1, 3, 1)
    x[:, 2] = 0                                                  # an all-zero head: scale 1
    s = head_scales(x)
    assert s[2] == 1.0 and torch.allclose(s[:2], x[:, :2].float().abs().amax(dim=(0, 2)) / 448)
    q = quantize_e4m3(x, s)
    assert q.dtype == torch.uint8 and q.shape == x.shape
    assert int((q[:, :2].view(torch.float8_e4m3fn).float().abs().amax(dim=(0, 2)) == 448).sum()) == 2
    back = dequantize_e4m3(q, s, dtype=torch.float32)
    assert float(((back - x.float()).abs() / x.float().abs().clamp(min=1e-3)).max()) < 0.07


def test_quantize_names_bad_input():
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        quantize_e4m3(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="per-head scales"):
        quantize_e4m3(torch.zeros(4, 2, 8), torch.ones(3))
    with pytest.raises(ValueError, match="FP8 scale must be a positive finite number"):
        quantize_e4m3(torch.zeros(4), 0.0)
    with pytest.raises(ValueError, match="> 0"):
        quantize_e4m3(torch.zeros(4), torch.tensor(-1.0))
    with pytest.raises(TypeError, match="uint8"):
        dequantize_e4m3(torch.zeros(4))
    with pytest.raises(ValueError, match="tokens, num_kv_heads, head_dim"):
        head_scales(torch.zeros(4, 8))


# ---- the block format ---------------------------------------------------------------------------

def test_planes_put_values_where_the_docstring_says():
    v = torch.arange(512)
    for bits in (4, 2, 1):
        x = (v * 7 + 3) % (1 << bits)
        plane = pack_fields(x[None], bits)[0]
        p = 8 // bits
        byte, shift = 4 * (v // (4 * p)) + v % 4, bits * ((v // 4) % p)
        assert torch.equal((plane.long()[byte] >> shift) & ((1 << bits) - 1), x)
        assert torch.equal(unpack_fields(plane[None], bits)[0], x)


def block_of(exps, signs=None, mants=None):
    e = torch.as_tensor(exps).long().expand(512)
    s = torch.zeros(512, dtype=torch.long) if signs is None else signs
    m = torch.arange(512) % 8 if mants is None else mants
    return ((s << 7) | (e << 3) | m).to(torch.uint8)[None]


@pytest.mark.parametrize("exps,mode,size", [
    (torch.full((512,), 7), BLK2, 384),                                   # one exponent: the 2-bit window
    (torch.arange(512) % 3 + 4, BLK2, 384),
    (torch.arange(512) % 7 + 2, BLK3, 448),
    ((torch.arange(512) % 3 + 4).index_put_((torch.tensor([100]),), torch.tensor(15)), BLK2, 388),   # 1 escape
    (torch.arange(512) % 32 % 16, COL2, 400),   # column c (channel) holds exponent c % 16 for every token
    (torch.randint(0, 16, (512,), generator=torch.Generator().manual_seed(0)), RAW, 512),   # uniform: nothing pays
])
def test_mode_and_size(exps, mode, size):
    blk = block_of(exps)
    meta = choose_modes(blk)
    assert int((meta >> 4) & 3) == mode and int(block_sizes(meta)) == size
    assert torch.equal(decode_blocks(encode_blocks(blk, meta), meta), blk)


@pytest.mark.parametrize("design", sorted(DESIGNS))
def test_designs_use_only_their_modes(design):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 512, generator=g) * torch.rand(64, 1, generator=g).mul(30)
    blocks = quantize_e4m3(x)
    meta = choose_modes(blocks, design)
    modes = set(((meta >> 4) & 3).tolist())
    assert modes <= set(DESIGNS[design]) | {RAW}
    assert torch.equal(decode_blocks(encode_blocks(blocks, meta), meta), blocks)
    assert bool((block_sizes(meta) < BODY_BYTES[RAW]).all())                # Gaussian blocks all pay
    if design == "adaptive":
        for other in ("blk3", "blk2", "col2"):
            assert bool((block_sizes(meta) <= block_sizes(choose_modes(blocks, other))).all())


SPECIAL = st.sampled_from([0x00, 0x80, 0x7F, 0xFF, 0x7E, 0xFE, 0x01, 0x81, 0x07, 0x08, 0x38, 0xB8])


@st.composite
def fp8_pages(draw):
    """A page [2, 16, H, D] of E4M3 bytes: a smooth background (one exponent band, or random
    bytes, or all one code) with adversarial bytes sprinkled at drawn places."""
    H, D = draw(st.sampled_from([(1, 64), (2, 64), (1, 128)]))
    seed = draw(st.integers(0, 2**31 - 1))
    kind = draw(st.sampled_from(["band", "random", "const", "gauss"]))
    g = torch.Generator().manual_seed(seed)
    shape = (2, 16, H, D)
    if kind == "band":
        lo = draw(st.integers(0, 15))
        e = torch.randint(lo, min(16, lo + draw(st.integers(1, 8))), shape, generator=g)
        page = (torch.randint(0, 2, shape, generator=g) << 7) | (e << 3) | torch.randint(0, 8, shape, generator=g)
    elif kind == "random":
        page = torch.randint(0, 256, shape, generator=g)
    elif kind == "const":
        page = torch.full(shape, draw(st.integers(0, 255)))
    else:
        page = quantize_e4m3(torch.randn(shape, generator=g) * draw(st.sampled_from([1e-3, 0.1, 3.0, 100.0]))).long()
    flat = page.flatten()
    for at, code in draw(st.lists(st.tuples(st.integers(0, flat.numel() - 1), SPECIAL), max_size=20)):
        flat[at] = code
    return flat.view(shape).to(torch.uint8)


@settings(max_examples=60, deadline=None)
@given(page=fp8_pages(), design=st.sampled_from(sorted(DESIGNS)))
def test_round_trip_is_bit_exact(page, design):
    buf = encode_fp8_page(page, design)
    H, D = page.shape[2:]
    assert buf.numel() == int(fp8_page_sizes(page[None], design)[0])
    assert buf.numel() <= 2 * 16 * H * D + 2 * H * record_bytes(PageLayout(H, D))   # all raw at most
    assert torch.equal(decode_fp8_page(buf, H, D), page)


def test_every_byte_value_round_trips_in_every_mode():
    """Each of the 256 codes (NaN, ±0, subnormals, 448) once per block, moved into each mode's
    window and outside it: a block of a narrow band with all 256 codes in its escapes."""
    base = block_of(torch.full((512,), 6))[0]
    for at in range(0, 512, 256):
        blk = base.clone()
        blk[at:at + 256] = ALL_CODES
        for design in DESIGNS:
            meta = choose_modes(blk[None], design)
            assert torch.equal(decode_blocks(encode_blocks(blk[None], meta), meta), blk[None])
    page = ALL_CODES.repeat(2 * 16 * 64 // 256).view(2, 16, 1, 64)
    assert torch.equal(decode_fp8_page(encode_fp8_page(page), 1, 64), page)


def test_corrupt_pages_are_refused():
    page = quantize_e4m3(torch.randn(2, 16, 1, 64))
    buf = encode_fp8_page(page)
    with pytest.raises(CorruptPageError):
        decode_fp8_page(buf[:-4], 1, 64)
    bad = buf.clone()
    bad[5] |= 0x20                       # metadata bit 13 (high byte of the first block's word)
    with pytest.raises(CorruptPageError):
        decode_fp8_page(bad, 1, 64)
    meta = int(buf[4]) | int(buf[5]) << 8
    assert (meta >> 4) & 3 != RAW
    end = 16 + int(block_sizes(fp8_block_meta(page[None])).sum())    # records + bodies, before the padding
    bad = torch.cat([buf[:end], torch.zeros(4, dtype=torch.uint8)])  # one escape word more than the codes say
    bad = torch.nn.functional.pad(bad, (0, -bad.numel() % 16))
    bad[4], bad[5] = (meta + 64) & 0xFF, (meta + 64) >> 8
    v_first = int(buf[8]) | int(buf[9]) << 8
    bad[8], bad[9] = (v_first + 4) & 0xFF, (v_first + 4) >> 8       # V's first block starts 4 bytes later
    with pytest.raises(CorruptPageError, match="escape-stream length"):
        decode_fp8_page(bad, 1, 64)
    bad = buf.clone()
    bad[4] = (meta & 0xF0) | 15                                     # β = 15: past every mode's limit
    with pytest.raises(CorruptPageError, match="base out of range"):
        decode_fp8_page(bad, 1, 64)


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="uint8 E4M3 codes"):
        encode_fp8_page(torch.zeros(2, 16, 1, 64))
    with pytest.raises(ValueError, match="head_dim"):
        encode_fp8_page(torch.zeros(2, 16, 1, 48, dtype=torch.uint8))
    with pytest.raises(ValueError, match="one page"):
        encode_fp8_page(torch.zeros(16, 1, 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="unknown FP8 block design"):
        choose_modes(torch.zeros(1, 512, dtype=torch.uint8), "k9")
    with pytest.raises(TypeError, match="1-D torch.uint8"):
        decode_fp8_page(torch.zeros(8, dtype=torch.int32), 1, 64)


def swar_restore(body: bytes, meta: int) -> list[int]:
    """The restore as a kernel would run it, 4 values per 32-bit word (docs/fp8_format.md section
    4): for slot s of a 32-value group, nibbles ``n``, codes ``d``, escape mask ``m``; escape codes
    zeroed, ``byte = n + 15·(n & 0x08..) + 8·(d + β)``, then an escaped lane XORs ``(β ^ e) << 3``
    with its exponent ``e`` from the stream (rank = escape codes before it in the block)."""
    mode, k = (meta >> 4) & 3, 3 if (meta >> 4) & 3 == BLK3 else 2
    word = lambda at: int.from_bytes(body[at:at + 4], "little")             # noqa: E731
    ones, at = 0x01010101, 16 if mode == COL2 else 0
    out, rank = [], 0
    stream = body[BODY_BYTES[mode]:]
    for g in range(16):
        for s in range(8):
            n = (word(at + 16 * g + 4 * (s >> 1)) >> (4 * (s & 1))) & 0x0F0F0F0F
            d = (word(at + 256 + 8 * g + 4 * (s >> 2)) >> (2 * (s & 3))) & 3 * ones
            if k == 3:
                d |= ((word(at + 384 + 4 * g) >> s) & ones) << 2
            m = d & (d >> 1) & (d >> 2 if k == 3 else 0xFFFFFFFF) & ones
            d ^= m * ((1 << k) - 1)
            base = (word(4 * (s >> 1)) >> (4 * (s & 1))) & 0x0F0F0F0F if mode == COL2 else (meta & 15) * ones
            x = n + 15 * (n & 0x08080808) + 8 * (d + base)
            assert x < 1 << 32                                              # no carry out of the word
            for j in range(4):
                if (m >> (8 * j)) & 1:
                    e = (stream[rank >> 1] >> (4 * (rank & 1))) & 15
                    x ^= (((base >> (8 * j)) ^ e) & 15) << (8 * j + 3)
                    rank += 1
            out += [(x >> (8 * j)) & 0xFF for j in range(4)]
    return out


@pytest.mark.parametrize("design", ["blk3", "blk2", "col2"])
def test_the_kernels_word_arithmetic_restores_every_block(design):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 512, generator=g) * torch.tensor([1e-3, 0.05, 1.0, 30.0, 400.0, 1.0])[:, None]
    blocks = quantize_e4m3(x)
    blocks[5, ::43] = ALL_CODES[::22]                                       # subnormals, other bands
    blocks[5, 1:6] = torch.tensor([0x7F, 0xFF, 0x80, 0x7E, 0xFE], dtype=torch.uint8)   # NaN, -0, ±448
    meta = choose_modes(blocks, design)
    assert bool(((meta >> 4) & 3 != RAW).all()) and bool((meta >> 6).any())             # escapes too
    bodies = encode_blocks(blocks, meta)
    for i in range(blocks.shape[0]):
        if (int(meta[i]) >> 4) & 3 != RAW:
            assert swar_restore(bytes(bodies[i].tolist()), int(meta[i])) == blocks[i].tolist()
