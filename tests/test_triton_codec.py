"""Triton codec kernels against the torch reference: same metadata, same bytes, same values.

On CPU the kernels run under the Triton interpreter (tests/conftest.py) at small sizes; on a
CUDA machine the same checks run compiled, and the tests marked gpu at larger sizes.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from helpers import adversarial_escape_blocks, escape_pattern_blocks, pages_from_block_bits
from zipfusion.analysis.synthetic import model_like_pages, pages_with_fraction, realistic_pages
from zipfusion.format import (ESCAPE_FLAG, RAW_MARK, CorruptPageError, PageLayout, analyze_pages,
                              decode_pages, encode_pages_into, page_sizes)
from zipfusion.format.triton_codec import analyze_open_pages, compress_open_pages, decompress_pages

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
POISON = 0xAB


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------

def scattered_offsets(sizes, start, seed):
    """16-aligned, non-overlapping offsets for pages of ``sizes`` after ``start``, in shuffled
    order with random gaps. Returns (offsets [P] int64, end)."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(sizes), generator=g)
    gaps = 16 * torch.randint(0, 5, (len(sizes),), generator=g)
    offsets = torch.empty(len(sizes), dtype=torch.int64)
    pos = start
    for i, gap in zip(order.tolist(), gaps.tolist()):
        pos += gap
        offsets[i] = pos
        pos += int(sizes[i])
    return offsets, pos


def check_codec(pages, device, seed=0):
    """Place the open pages at scattered offsets of a poisoned arena, then check that analyze,
    compress and decompress agree with the reference byte for byte and touch nothing else."""
    P, _, _, H, D = pages.shape
    layout = PageLayout(H, D)
    src, end = scattered_offsets([layout.open_page_bytes] * P, 48, seed)
    ref_sizes = page_sizes(pages)
    dst, end = scattered_offsets(ref_sizes, end + 16, seed + 1)
    arena = torch.full((end + 64,), POISON, dtype=torch.uint8)
    flat = pages.contiguous().view(P, -1).view(torch.uint8)
    for i in range(P):
        arena[int(src[i]):int(src[i]) + layout.open_page_bytes] = flat[i]
    expected = arena.clone()
    encode_pages_into(pages, expected, dst)
    arena, src_d, dst_d = arena.to(device), src.to(device), dst.to(device)

    base_half, sizes = analyze_open_pages(arena, src_d, layout)
    assert base_half.dtype == torch.uint8 and base_half.shape == (P, layout.num_blocks)
    assert torch.equal(base_half.cpu().to(torch.int32), analyze_pages(pages).flatten(1)), \
        f"metadata bytes differ from the reference (seed {seed})"
    assert torch.equal(sizes.cpu(), ref_sizes), f"page sizes differ (seed {seed})"

    compress_open_pages(arena, src_d, base_half, dst_d, layout)
    diff = (arena.cpu() != expected).nonzero().flatten()
    assert diff.numel() == 0, (f"{diff.numel()} bytes differ from the reference, first at "
                               f"{diff[:8].tolist()} (seed {seed})")

    out = torch.full((P, 2, 16, H, D), float("nan"), dtype=torch.bfloat16, device=device)
    decoded = decompress_pages(arena, dst_d, layout, out=out)
    assert decoded is out
    assert torch.equal(out.cpu().view(torch.int16), pages.view(torch.int16)), \
        f"decompressed pages differ from the originals (seed {seed})"
    ref_decoded = decode_pages(arena.cpu(), dst, H, D, sizes=ref_sizes)
    assert torch.equal(out.cpu().view(torch.int16), ref_decoded.view(torch.int16))
    return base_half.cpu()


def every_pattern_blocks():
    """All 65,536 BF16 patterns, half of them in compressible blocks (512 consecutive patterns:
    at most 4 exponents) and half shuffled into raw blocks, plus every exponent at d = 7."""
    g = torch.Generator().manual_seed(3)
    patterns = torch.arange(65536, dtype=torch.int32)
    perm = torch.randperm(128, generator=g)
    consecutive = patterns.view(128, 512)[perm[:64]]
    rest = patterns.view(128, 512)[perm[64:]].flatten()
    shuffled = rest[torch.randperm(rest.numel(), generator=g)].view(64, 512)
    blocks = torch.stack([consecutive, shuffled], 1).flatten(0, 1)       # alternate
    return blocks


def largest_offset_blocks():
    """One block per exponent e: its 256 patterns next to fillers of exponent (e - 14) & ~1,
    so that the patterns sit at d = 7, the top of the code range."""
    blocks = []
    for e in range(256):
        pats = torch.arange(256, dtype=torch.int32)
        values = ((pats >> 7) << 15) | (e << 7) | (pats & 0x7F)
        f = max(e - 14, 0) & ~1
        blocks.append(torch.cat([values, (f << 7) | torch.arange(256, dtype=torch.int32) % 128]))
    return torch.stack(blocks)


def special_blocks():
    """Edge cases of the block rule and of BF16: zeros, subnormals, inf, NaN payloads, spans."""
    g = torch.Generator().manual_seed(5)
    idx = torch.arange(512, dtype=torch.int32)
    frac = torch.randint(0, 128, (512,), generator=g, dtype=torch.int32)
    sign = torch.randint(0, 2, (512,), generator=g, dtype=torch.int32) << 15

    def span(lo, hi):   # exponents lo and hi present, the rest in between
        e = lo + idx % (hi - lo + 1)
        return sign | (e << 7) | frac

    blocks = [
        torch.zeros(512, dtype=torch.int32),                       # +0 everywhere
        torch.full((512,), 0x8000, dtype=torch.int32),             # -0 everywhere
        torch.full((512,), 0x3F80, dtype=torch.int32),             # all-equal 1.0
        torch.full((512,), 0x7FC1, dtype=torch.int32),             # all-equal NaN
        sign | frac,                                               # ±0 and subnormals
        sign | (255 << 7) | frac,                                  # ±inf and NaN payloads
        span(240, 255),                                            # top of the range, b/2 = 120
        span(100, 115),                                            # span 15, even min: compressible
        span(101, 116),                                            # span 15, odd min: raw
        span(101, 115),                                            # span 14, odd min: compressible
        span(100, 116),                                            # span 16: raw
        span(100, 117),                                            # span 17: raw
        torch.where(idx % 2 == 0, 0, 0x3F80),                      # zeros next to 1.0: raw
        span(0, 15),                                               # subnormals up to e = 15
        span(254, 255),
        torch.where(idx == 7, 0xFF80, 0x7F80 | frac),              # -inf among NaN/inf
    ]
    return torch.stack(blocks)


# --------------------------------------------------------------------------------------------
# CPU (Triton interpreter) and CUDA
# --------------------------------------------------------------------------------------------

DEVICE = "cuda" if CUDA else "cpu"


@pytest.mark.parametrize("H,D", [(1, 64), (2, 128), (1, 256)])
def test_realistic_pages(H, D):
    check_codec(realistic_pages(3, H, D, seed=H * D), DEVICE, seed=D)


@pytest.mark.parametrize("fraction,escaped", [(0.0, 0.0), (0.5, 0.0), (1.0, 0.0), (0.75, 0.25)])
def test_exact_fractions(fraction, escaped):
    pages = pages_with_fraction(2, 2, 128, fraction, escaped_fraction=escaped, seed=7)
    base_half = check_codec(pages, DEVICE, seed=1)
    assert float((base_half != RAW_MARK).float().mean()) == fraction
    flagged = ((base_half & ESCAPE_FLAG) != 0) & (base_half != RAW_MARK)
    assert float(flagged.float().mean()) == escaped


def test_patterns_as_escapes():
    """Format v2: patterns as escapes (4 per block; all 65,536 of them on the GPU, a seeded
    sixteenth under the interpreter, which the reference's test covers in full) and the
    adversarial 4- and 5-outlier blocks."""
    blocks = escape_pattern_blocks()
    if not CUDA:
        blocks = blocks[torch.randperm(blocks.shape[0], generator=torch.Generator().manual_seed(8))[:1024]]
    n = blocks.shape[0]
    blocks = torch.cat([blocks, adversarial_escape_blocks()])
    base_half = check_codec(pages_from_block_bits(blocks, 2, 256), DEVICE, seed=5).flatten()
    assert bool(((base_half[:n] & ESCAPE_FLAG) != 0).all())
    assert base_half[n:n + 10].tolist() == [0xBC, RAW_MARK, 0xBC, 0xBC, 0xBC, RAW_MARK,
                                            0xBC, 0xBC, 0xFE, 0x80]


def test_v1_pages_decompress():
    """Pages written in the seed format (no escapes: outlier blocks raw) still decompress."""
    pages = model_like_pages(4, 2, 128, seed=2, counts={"K": (0.4, 0.1, 0, 0), "V": (0.3, 0, 0, 0)})
    sizes = page_sizes(pages, version=1)
    offsets = 16 * ((torch.cumsum(sizes, 0) - sizes) // 16)
    arena = torch.zeros(int(sizes.sum()) + 64, dtype=torch.uint8)
    encode_pages_into(pages, arena, offsets, version=1)
    out = decompress_pages(arena.to(DEVICE), offsets.to(DEVICE), PageLayout(2, 128))
    assert torch.equal(out.cpu().view(torch.int16), pages.view(torch.int16))


@pytest.mark.parametrize("H,D", [(2, 64), (1, 128)])
def test_model_like_pages(H, D):
    check_codec(model_like_pages(24, H, D, seed=D, counts={"K": (0.3, 0.1, 0.05, 0.05),
                                                           "V": (0.2, 0.1, 0.05, 0.05)}),
                DEVICE, seed=6)


def test_every_pattern_in_raw_and_compressible_blocks():
    blocks = every_pattern_blocks()
    pages = pages_from_block_bits(blocks, 2, 256)
    base_half = check_codec(pages, DEVICE, seed=2).flatten()[:blocks.shape[0]]
    assert bool((base_half[0::2] != RAW_MARK).all())      # consecutive patterns compress
    assert bool((base_half[1::2] == RAW_MARK).all())      # shuffled patterns stay raw


def test_every_exponent_at_the_largest_offset():
    blocks = largest_offset_blocks()
    pages = pages_from_block_bits(blocks, 2, 256)
    base_half = check_codec(pages, DEVICE, seed=3).flatten()[:256]
    assert bool((base_half != RAW_MARK).all())


def test_special_values_and_span_edges():
    pages = pages_from_block_bits(special_blocks(), 1, 256)
    base_half = check_codec(pages, DEVICE, seed=4).flatten()[:16].tolist()
    raw = [i for i, b in enumerate(base_half) if b == RAW_MARK]
    assert raw == [8, 10, 11, 12]
    assert base_half[5] == 127 and base_half[6] == 120 and base_half[7] == 50 and base_half[9] == 50


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), H=st.sampled_from([1, 2]), D=st.sampled_from([64, 128, 256]),
       low=st.integers(0, 255), span=st.integers(0, 20), outliers=st.integers(0, 6))
def test_random_blocks(seed, H, D, low, span, outliers):
    """Blocks with exponents in low .. low + span (clipped to 255), each with up to
    ``outliers`` arbitrary patterns: both sides of the rule, with and without escapes."""
    g = torch.Generator().manual_seed(seed)
    n = PageLayout(H, D).num_blocks
    e = (low + torch.randint(0, span + 1, (n, 512), generator=g)).clamp(max=255)
    bits = (torch.randint(0, 2, (n, 512), generator=g) << 15) | (e << 7) | torch.randint(0, 128, (n, 512), generator=g)
    where = torch.randint(0, 512, (n, outliers), generator=g)
    bits.scatter_(1, where, torch.randint(0, 65536, (n, outliers), generator=g))
    check_codec(pages_from_block_bits(bits, H, D), DEVICE, seed=seed % 1000)


def test_indexed_subset_in_one_launch():
    """compress_open_pages(index=...) writes analyzed page index[i] at dst[i] (any subset, any
    order, one launch): the reference's bytes there, nothing anywhere else."""
    P, H, D = 6, 2, 128
    layout = PageLayout(H, D)
    pages = pages_with_fraction(P, H, D, 0.6, seed=21)
    src, end = scattered_offsets([layout.open_page_bytes] * P, 32, 22)
    keep = torch.tensor([4, 1, 5, 2])
    ref_sizes = page_sizes(pages[keep])
    dst, end = scattered_offsets(ref_sizes, end + 16, 23)
    arena = torch.full((end + 64,), POISON, dtype=torch.uint8)
    flat = pages.view(P, -1).view(torch.uint8)
    for i in range(P):
        arena[int(src[i]):int(src[i]) + layout.open_page_bytes] = flat[i]
    expected = arena.clone()
    encode_pages_into(pages[keep], expected, dst)
    arena = arena.to(DEVICE)
    base_half, _ = analyze_open_pages(arena, src.to(DEVICE), layout)
    compress_open_pages(arena, src.to(DEVICE), base_half, dst.to(DEVICE), layout, index=keep.to(DEVICE))
    assert torch.equal(arena.cpu(), expected)
    with pytest.raises(ValueError, match="outside 0..5"):
        compress_open_pages(arena, src.to(DEVICE), base_half, dst.to(DEVICE), layout,
                            index=(keep + 2).to(DEVICE))
    with pytest.raises(TypeError, match="int64"):
        compress_open_pages(arena, src.to(DEVICE), base_half, dst.to(DEVICE), layout,
                            index=keep.to(torch.int32).to(DEVICE))
    with pytest.raises(ValueError, match="expected 4"):
        compress_open_pages(arena, src.to(DEVICE), base_half, dst[:3].to(DEVICE), layout,
                            index=keep.to(DEVICE))


def test_no_pages():
    layout = PageLayout(2, 64)
    arena = torch.zeros(1024, dtype=torch.uint8, device=DEVICE)
    none = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    base_half, sizes = analyze_open_pages(arena, none, layout)
    assert base_half.shape == (0, layout.num_blocks) and sizes.shape == (0,)
    compress_open_pages(arena, none, base_half, none, layout)
    assert decompress_pages(arena, none, layout).shape == (0, 2, 16, 2, 64)


def test_kernels_run_when_triton_was_imported_without_the_interpreter():
    """Another module may import the codec before TRITON_INTERPRET is set: CPU still works."""
    code = (
        "import torch\n"
        "from zipfusion.format import PageLayout, analyze_pages\n"
        "from zipfusion.format.triton_codec import analyze_open_pages\n"
        "from zipfusion.analysis.synthetic import realistic_pages\n"
        "p = realistic_pages(1, 1, 64)\n"
        "bh, _ = analyze_open_pages(p.view(-1).view(torch.uint8).clone(), torch.zeros(1, dtype=torch.int64), PageLayout(1, 64))\n"
        "assert torch.equal(bh.to(torch.int32), analyze_pages(p).flatten(1))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------

@pytest.fixture
def placed():
    layout = PageLayout(1, 64)
    pages = realistic_pages(2, 1, 64, seed=9)
    arena = torch.zeros(5 * layout.open_page_bytes, dtype=torch.uint8)
    arena[:2 * layout.open_page_bytes] = pages.view(-1).view(torch.uint8)
    src = torch.tensor([0, layout.open_page_bytes])
    dst = torch.tensor([2, 3]) * layout.open_page_bytes
    return layout, arena, src, dst


def test_bad_arena(placed):
    layout, arena, src, dst = placed
    with pytest.raises(TypeError, match="1-D torch.uint8"):
        analyze_open_pages(arena.view(torch.int16), src, layout)
    with pytest.raises(TypeError, match="1-D torch.uint8"):
        analyze_open_pages(arena.view(2, -1), src, layout)
    with pytest.raises(TypeError, match="torch.Tensor"):
        analyze_open_pages(arena.numpy(), src, layout)
    with pytest.raises(ValueError, match="16-byte aligned"):
        analyze_open_pages(arena[8:], src, layout)
    with pytest.raises(TypeError, match="PageLayout"):
        analyze_open_pages(arena, src, (1, 64))


def test_bad_offsets(placed):
    layout, arena, src, dst = placed
    with pytest.raises(TypeError, match="int64"):
        analyze_open_pages(arena, src.to(torch.int32), layout)
    with pytest.raises(TypeError, match="int64"):
        analyze_open_pages(arena, [0, 4096], layout)
    with pytest.raises(ValueError, match="multiple of 16"):
        analyze_open_pages(arena, src + 8, layout)
    with pytest.raises(ValueError, match="outside the arena"):
        analyze_open_pages(arena, src + 4 * layout.open_page_bytes, layout)
    with pytest.raises(ValueError, match="outside the arena"):
        analyze_open_pages(arena, src - 16 * layout.open_page_bytes, layout)
    if CUDA:
        with pytest.raises(ValueError, match="move it"):
            analyze_open_pages(arena.cuda(), src, layout)


def test_bad_compress_arguments(placed):
    layout, arena, src, dst = placed
    base_half, _ = analyze_open_pages(arena, src, layout)
    with pytest.raises(ValueError, match="base_half must be uint8"):
        compress_open_pages(arena, src, base_half.to(torch.int32), dst, layout)
    with pytest.raises(ValueError, match="base_half must be uint8"):
        compress_open_pages(arena, src, base_half[:, :3], dst, layout)
    with pytest.raises(ValueError, match="expected 2"):
        compress_open_pages(arena, src[:1], base_half, dst, layout)
    with pytest.raises(ValueError, match="outside the arena"):
        compress_open_pages(arena, src, base_half, dst + 2 * layout.open_page_bytes, layout)
    with pytest.raises(ValueError, match="multiple of 16"):
        compress_open_pages(arena, src, base_half, dst + 4, layout)


def test_bad_decompress_arguments(placed):
    layout, arena, src, dst = placed
    base_half, _ = analyze_open_pages(arena, src, layout)
    compress_open_pages(arena, src, base_half, dst, layout)
    with pytest.raises(ValueError, match="out must be a bfloat16"):
        decompress_pages(arena, dst, layout, out=torch.empty(2, 2, 16, 1, 64))
    with pytest.raises(ValueError, match="out must be a bfloat16"):
        decompress_pages(arena, dst, layout, out=torch.empty(1, 2, 16, 1, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 16"):
        decompress_pages(arena, dst + 1, layout)
    corrupt = arena.clone()
    byte = int(dst[1]) + 4                             # a block byte that changes the block's size
    corrupt[byte] = 0 if int(arena[byte]) & 0x80 else 200
    with pytest.raises(CorruptPageError):
        decompress_pages(corrupt, dst, layout)
    corrupt = arena.clone()
    corrupt[int(dst[0])] += 16                         # block 0 no longer right after the header
    with pytest.raises(CorruptPageError):
        decompress_pages(corrupt, dst, layout)


# --------------------------------------------------------------------------------------------
# CUDA at larger sizes
# --------------------------------------------------------------------------------------------

@gpu
@pytest.mark.parametrize("H,D", [(8, 128), (4, 64), (2, 256), (5, 128)])
def test_cuda_realistic_large(H, D):
    check_codec(realistic_pages(96, H, D, seed=11), "cuda", seed=12)


@gpu
@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.5, 0.8, 1.0])
def test_cuda_fractions_large(fraction):
    check_codec(pages_with_fraction(64, 8, 128, fraction, seed=13), "cuda", seed=14)


@gpu
@pytest.mark.parametrize("H,D", [(8, 128), (1, 64)])
def test_cuda_every_pattern(H, D):
    blocks = torch.cat([every_pattern_blocks(), largest_offset_blocks(), special_blocks(),
                        escape_pattern_blocks(), adversarial_escape_blocks()])
    check_codec(pages_from_block_bits(blocks, H, D), "cuda", seed=15)


@gpu
@pytest.mark.parametrize("H,D", [(8, 128), (3, 64)])
def test_cuda_model_like_large(H, D):
    check_codec(model_like_pages(96, H, D, seed=16), "cuda", seed=17)
