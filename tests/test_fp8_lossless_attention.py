"""Decode attention over FP8 pages in the lossless block format (kernels/fp8_lossless_attention.py):
the restored bytes equal the pages' bytes in every mode (escapes at the block's ends, the most a
mode can hold, E4M3's extremes), and the attention output equals the open-FP8 kernel's bit for bit
over the same bytes: mixed open and encoded pages, ragged lengths, GQA, splits, scales; a
property test over random shapes and data; the input checks; corrupt records stay in the arena."""

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings, strategies as st

from zipfusion.format import PageLayout
from zipfusion.format.fp8 import Fp8PageLayout, quantize_e4m3
from zipfusion.format.fp8_blocks import (BLK2, BLK3, COL2, RAW, block_sizes, encode_fp8_page, fp8_block_meta,
                                         record_bytes)
from zipfusion.format.layout import BLOCK_VALUES, PAGE_TOKENS, from_blocks, open_loc, to_blocks
from zipfusion.kernels import fp8_lossless_attention as fla
from zipfusion.kernels.fp8_attention import decode_attention_fp8
from zipfusion.kernels.fp8_lossless_attention import decode_attention_fp8_lossless

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EXTREMES = torch.tensor([0x7E, 0xFE, 0x00, 0x80, 0x01, 0x81, 0x07, 0x87, 0x08, 0x88, 0x77, 0xF7], dtype=torch.uint8)


# -- data ----------------------------------------------------------------------------------------

def no_nan(x: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes with the NaN codes (0x7F, 0xFF) moved to ±448 (0x7E, 0xFE)."""
    return torch.where((x & 0x7F) == 0x7F, x - 1, x)


def make_block(kind: str, g: torch.Generator) -> torch.Tensor:
    """One 512-value block (uint8, value order) that puts an encoder in a given situation."""
    v = torch.arange(BLOCK_VALUES)
    sign_mant = (torch.randint(0, 2, (512,), generator=g) << 7) | torch.randint(0, 8, (512,), generator=g)
    beta = int(torch.randint(0, 12, (1,), generator=g))
    if kind == "band2":              # 3 exponents: blk2 without escapes
        e = beta + torch.randint(0, 3, (512,), generator=g)
    elif kind == "band3":            # 7 exponents: blk3
        e = torch.randint(0, 7, (512,), generator=g) + min(beta, 9)
    elif kind == "columns":          # one exponent band per column v & 31: col2
        e = (v % 32 * 7) % 14 + torch.randint(0, 3, (512,), generator=g)
    elif kind == "ends":             # a band with escapes at the first and the last value only
        e = torch.full((512,), 6)
        e[0], e[511] = 15, 0
    elif kind == "max_escapes":      # blk2 with 248 escapes (w = 31: 508 bytes, the most that pays)
        e = torch.full((512,), 7)
        far = torch.tensor([0, 1, 2, 3, 11, 12, 13, 14, 15])
        e[torch.randperm(512, generator=g)[:248]] = far[torch.randint(0, 9, (248,), generator=g)]
    elif kind == "sprinkled":        # a band with a random number of escapes at random places
        e = beta + torch.randint(0, 3, (512,), generator=g)
        n = int(torch.randint(1, 60, (1,), generator=g))
        e[torch.randperm(512, generator=g)[:n]] = torch.randint(0, 16, (n,), generator=g)
    elif kind == "extremes":         # E4M3's edges only: ±448, ±0, subnormals, the smallest normals
        return EXTREMES[torch.randint(0, len(EXTREMES), (512,), generator=g)]
    elif kind == "random":           # every byte: raw
        return no_nan(torch.randint(0, 256, (512,), generator=g).to(torch.uint8))
    else:
        raise ValueError(kind)
    return no_nan(((e.clamp(0, 15) << 3) | sign_mant).to(torch.uint8))


KINDS = ("band2", "band3", "columns", "ends", "max_escapes", "sprinkled", "extremes", "random")


def pages_of_blocks(P: int, H: int, D: int, seed: int, kinds=KINDS) -> torch.Tensor:
    """P E4M3 pages [P, 2, 16, H, D] whose blocks (K and V, every head) cycle through ``kinds``."""
    g = torch.Generator().manual_seed(seed)
    nb = PAGE_TOKENS * D // BLOCK_VALUES
    n = P * H * 2 * nb
    blocks = torch.stack([make_block(kinds[(i + seed) % len(kinds)], g) for i in range(n)])
    return from_blocks(blocks.view(P, H, 2, nb, BLOCK_VALUES))


def gauss_pages(P, H, D, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return no_nan(quantize_e4m3(torch.randn(P, 2, 16, H, D, generator=g) * scale))


def arenas(pages: torch.Tensor, encoded: list[bool], design: str = "adaptive", seed: int = 0):
    """The pages in an open-FP8 arena and in a mixed one (page i encoded where ``encoded[i]``,
    else open), each scattered (a random order, gaps), with their page locations."""
    P, _, _, H, D = pages.shape
    lay = Fp8PageLayout(H, D)
    g = torch.Generator().manual_seed(seed)
    out = []
    for enc in ([False] * P, encoded):
        blobs = [encode_fp8_page(pages[i], design) if e else pages[i].reshape(-1) for i, e in enumerate(enc)]
        order = torch.randperm(P, generator=g).tolist()
        loc = torch.empty(P, dtype=torch.int64)
        parts, at = [], 0
        for i in order:
            gap = 16 * int(torch.randint(0, 3, (1,), generator=g))
            parts.append(torch.full((gap,), 0x7F, dtype=torch.uint8))       # NaN bytes between pages
            at += gap
            loc[i] = at if enc[i] else open_loc(at)
            n = -(-blobs[i].numel() // 16) * 16
            parts.append(torch.nn.functional.pad(blobs[i], (0, n - blobs[i].numel()), value=0x7F))
            at += n
        out.append((torch.cat(parts).to(DEVICE), loc.to(DEVICE)))
    return lay, out[0], out[1]


def same_bits(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def check(pages, encoded, q, bt, lens, design="adaptive", seed=0, **kw):
    """decode_attention_fp8_lossless over the mixed arena == decode_attention_fp8 over the open one."""
    lay, (arena_o, loc_o), (arena_m, loc_m) = arenas(pages, encoded, design, seed)
    bt, lens, q = bt.to(DEVICE), lens.to(DEVICE), q.to(DEVICE)
    want = decode_attention_fp8(q, arena_o, loc_o, bt, lens, lay, 0.125, **kw)
    got = decode_attention_fp8_lossless(q, arena_m, loc_m, bt, lens, lay, 0.125, **kw)
    assert not bool(want.isnan().any())
    assert same_bits(got, want), (got.float() - want.float()).abs().max()
    return got


def modes_of(pages, design="adaptive"):
    meta = fp8_block_meta(pages, design)
    return meta, set(((meta >> 4) & 3).flatten().tolist())


# -- the restore alone ---------------------------------------------------------------------------

@triton.jit
def _restore_kernel(arena32, loc_ptr, out, n_words, H: tl.constexpr, D: tl.constexpr,
                    TP: tl.constexpr, REC: tl.constexpr):
    """Program h: the K and V bytes of head h of TP pages, [2, 16·TP, D] each, as the kernel restores them."""
    NB: tl.constexpr = D // 32
    h = tl.program_id(0)
    slot = tl.arange(0, TP * NB) // NB
    loc = tl.load(loc_ptr + slot)
    enc = fla._loc_is_compressed(loc)
    r = tl.arange(0, TP * 16)[:, None]
    d = tl.arange(0, D)[None, :]
    for role in tl.static_range(2):
        x = fla._role_tile(arena32, n_words, loc, enc, slot, 1 << 30, h, role, H, D, NB, REC)
        tl.store(out + ((h * 2 + role) * TP * 16 + r) * D + d, x)


def restored(arena, loc, lay: Fp8PageLayout) -> torch.Tensor:
    """The bytes the kernel restores from the pages at ``loc`` (all in one tile): [P, 2, 16, H, D]."""
    H, D, P = lay.num_kv_heads, lay.head_dim, loc.numel()
    out = torch.full((H, 2, P * 16, D), 0x55, dtype=torch.uint8, device=arena.device)
    arena32 = arena[:arena.numel() // 4 * 4].view(torch.int32)
    _restore_kernel[(H,)](arena32, loc, out, arena32.numel(), H=H, D=D, TP=P, REC=record_bytes(lay))
    return out.view(H, 2, P, 16, D).permute(2, 1, 3, 0, 4)


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("design", ["adaptive", "blk3", "blk2", "col2"])
def test_the_restore_gives_the_pages_bytes_in_every_mode(design, D):
    H = 2 if D < 256 else 1
    pages = pages_of_blocks(4, H, D, seed=D)
    meta, modes = modes_of(pages, design)
    w = meta >> 6
    assert modes == {RAW, *({"adaptive": (BLK3, BLK2, COL2), "blk3": (BLK3,), "blk2": (BLK2,),
                             "col2": (COL2,)}[design])}
    assert int(w.max()) >= (31 if design in ("adaptive", "blk2") else 1)     # the most escapes blk2 holds
    lay, _, (arena, loc) = arenas(pages, [True, False, True, True], design, seed=D)
    assert torch.equal(restored(arena, loc, lay), pages.to(DEVICE))


def test_the_blocks_the_restore_is_checked_on():
    """The data above is what it says: escapes at value 0 and 511, 248 escapes in a blk2 block."""
    g = torch.Generator().manual_seed(0)
    ends, most = make_block("ends", g), make_block("max_escapes", g)
    meta = fp8_block_meta(from_blocks(torch.stack([ends, most, ends, most]).view(1, 1, 2, 2, 512)), "blk2")
    assert ((meta >> 4) & 3).flatten().tolist() == [BLK2] * 4
    assert (meta >> 6).flatten().tolist() == [1, 31, 1, 31] and block_sizes(meta).flatten().tolist()[1] == 508
    e = (ends.long() >> 3) & 15
    assert e[0] == 15 and e[511] == 0 and bool((e[1:511] == 6).all())


# -- the attention kernel ------------------------------------------------------------------------

BT = torch.tensor([[0, 1, 2, 3, 4, 5], [5, 3, 1, 0, 0, 0], [2, 0, 0, 0, 0, 0], [4, 2, 0, 0, 0, 0]], dtype=torch.int32)


@pytest.mark.parametrize("design,split,G,scale", [
    ("adaptive", {}, 1, (1.0, 1.0)),
    ("adaptive", {"split_pages": 2}, 4, (2.0 ** -7, 0.5)),
    ("blk3", {"num_splits": 3}, 2, (0.01, 3.0)),
    ("blk2", {"tile_pages": 2}, 3, (2.0 ** -6, 1.0)),
    ("col2", {"split_pages": 2, "tile_pages": 2}, 1, (0.03, 0.25)),
])
def test_bit_identical_to_the_open_fp8_kernel(design, split, G, scale):
    """Adversarial blocks, every mode, encoded and open pages in one batch, ragged lengths (the
    partial last pages open), GQA, splits, k/v scales."""
    H, D, P = 2, 64, 6
    pages = pages_of_blocks(P, H, D, seed=G)
    encoded = [True, True, False, True, True, True]          # page 2: the partial last page of two requests
    q = torch.randn(4, H * G, D, generator=torch.Generator().manual_seed(G)).to(torch.bfloat16)
    lens = torch.tensor([96, 64, 7, 24], dtype=torch.int32)  # request 3's last page (2) partial too
    check(pages, encoded, q, BT, lens, design, seed=G, k_scale=scale[0], v_scale=scale[1], **split)


@pytest.mark.parametrize("D", [128, 256])
def test_bit_identical_on_model_like_pages_and_larger_heads(D):
    pages = gauss_pages(3, 1, D, seed=D)
    _, modes = modes_of(pages)
    assert len(modes - {RAW}) >= 2
    q = torch.randn(2, 2, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    bt = torch.tensor([[0, 1, 2], [2, 1, 0]], dtype=torch.int32)
    check(pages, [False, True, True], q, bt, torch.tensor([48, 40], dtype=torch.int32), v_scale=0.5)


SPECIAL = st.sampled_from([0x00, 0x80, 0x7E, 0xFE, 0x01, 0x81, 0x07, 0x08, 0x38, 0xB8])


@st.composite
def cases(draw):
    H, D = draw(st.sampled_from([(1, 64), (2, 64), (1, 128)]))
    G = draw(st.sampled_from([1, 2, 4]))
    P = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    g = torch.Generator().manual_seed(seed)
    kind = draw(st.sampled_from(["blocks", "gauss", "band", "const"]))
    if kind == "blocks":
        pages = pages_of_blocks(P, H, D, seed % 1000)
    elif kind == "gauss":
        pages = gauss_pages(P, H, D, seed, draw(st.sampled_from([1e-3, 0.1, 3.0, 100.0])))
    elif kind == "band":
        lo = draw(st.integers(0, 15))
        e = torch.randint(lo, min(16, lo + draw(st.integers(1, 8))), (P, 2, 16, H, D), generator=g)
        pages = no_nan(((torch.randint(0, 16, e.shape, generator=g) & 8) << 4 | e << 3
                        | torch.randint(0, 8, e.shape, generator=g)).to(torch.uint8))
    else:
        pages = no_nan(torch.full((P, 2, 16, H, D), draw(st.integers(0, 255)), dtype=torch.uint8))
    flat = pages.view(-1)
    for at, code in draw(st.lists(st.tuples(st.integers(0, flat.numel() - 1), SPECIAL), max_size=30)):
        flat[at] = code
    B = draw(st.integers(1, 3))
    W = draw(st.integers(1, 4))
    bt = torch.randint(0, P, (B, W), generator=g, dtype=torch.int32)
    lens = torch.tensor([draw(st.integers(1, 16 * W)) for _ in range(B)], dtype=torch.int32)
    encoded = [draw(st.booleans()) for _ in range(P)]
    for b in range(B):              # a partial last page is open
        if lens[b] % 16:
            encoded[int(bt[b, (int(lens[b]) - 1) // 16])] = False
    split = draw(st.sampled_from([{}, {"split_pages": 1}, {"num_splits": 2}, {"tile_pages": 2},
                                  {"split_pages": 2, "tile_pages": 2}]))
    scale = (draw(st.sampled_from([1.0, 2.0 ** -6, 0.02])), draw(st.sampled_from([1.0, 0.3])))
    q = torch.randn(B, H * G, D, generator=g).to(torch.bfloat16)
    return pages, encoded, q, bt, lens, draw(st.sampled_from(["adaptive", "blk3", "blk2", "col2"])), split, scale


@settings(max_examples=15, deadline=None)
@given(case=cases())
def test_property_bit_identical_to_the_open_fp8_kernel(case):
    pages, encoded, q, bt, lens, design, split, scale = case
    check(pages, encoded, q, bt, lens, design, k_scale=scale[0], v_scale=scale[1], **split)


# -- inputs and corrupt pages --------------------------------------------------------------------

def test_input_errors_are_one_clear_line():
    pages = gauss_pages(2, 1, 64, seed=0)
    lay, _, (arena, loc) = arenas(pages, [True, False])
    q = torch.zeros(1, 1, 64, dtype=torch.bfloat16, device=DEVICE)
    bt = torch.tensor([[0, 1]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([20], dtype=torch.int32, device=DEVICE)
    decode_attention_fp8_lossless(q, arena, loc, bt, lens, lay, 0.1)
    cases = [
        (dict(layout=PageLayout(1, 64)), TypeError, "layout must be a zipfusion.format.fp8.Fp8PageLayout"),
        (dict(v_scale=float("inf")), ValueError, "v_scale must be a positive finite number"),
        (dict(k_scale=0), ValueError, "k_scale must be a positive finite number"),
        (dict(arena=arena[:400]), ValueError, "past the end of the arena"),
        (dict(q=q.float()), TypeError, "q must be torch.bfloat16"),
        (dict(num_splits=2, split_pages=1), ValueError, "give num_splits or split_pages, not both"),
        (dict(lens=torch.tensor([3], dtype=torch.int32, device=DEVICE)), ValueError,
         "the last, partial page of a request must be open"),                   # page 0 is encoded
        (dict(loc=loc + 8), ValueError, "16-byte aligned"),
    ]
    for change, err, match in cases:
        args = dict(q=q, arena=arena, loc=loc, bt=bt, lens=lens, layout=lay)
        kw = {k: change.pop(k) for k in ("v_scale", "k_scale", "num_splits", "split_pages") if k in change}
        args.update(change)
        with pytest.raises(err, match=match) as e:
            decode_attention_fp8_lossless(args["q"], args["arena"], args["loc"], args["bt"], args["lens"],
                                          args["layout"], 0.1, **kw)
        assert "\n" not in str(e.value)


def corrupt(page: torch.Tensor, how: str, g: torch.Generator) -> torch.Tensor:
    """An E4M3 page [2, 16, H, D] encoded, its records made wrong in one way."""
    buf = encode_fp8_page(page)
    H, D = page.shape[2:]
    R = record_bytes(PageLayout(H, D))
    rec = buf[:2 * H * R].view(2 * H, R)
    nb = D // 32
    meta = rec[:, 4:4 + 2 * nb].view(2 * H, nb, 2)
    if how in ("first", "first_raw"):       # a first-block offset far past the arena
        rec[:, :4] = torch.tensor([0xF0, 0xFF, 0xFF, 0xFF], dtype=torch.uint8)
        if how == "first_raw":              # ... and raw blocks: one reads the arena's last word
            meta[:] = 0
    elif how == "escape_words":             # w = 127 everywhere, high bits set: sizes far past the page
        meta[..., 0] |= 0xC0
        meta[..., 1] = 0xFF
    elif how == "random":                   # any record bytes
        rec[:] = torch.randint(0, 256, rec.shape, generator=g, dtype=torch.uint8)
    elif how == "no_escape_words":          # escape codes in the planes but w = 0
        meta[..., 0] &= 0x3F
        meta[..., 1] = 0
    elif how == "short_stream":             # the last block has more escape codes than its w holds,
        word = int(meta[-1, -1, 0]) | int(meta[-1, -1, 1]) << 8      # and the page ends with its stream:
        beta, w = word & 15, word >> 6                                # w cut where a word's escapes
        assert (word >> 4) & 3 == BLK2                                # straddle 8·w (its window would
        e = (to_blocks(page[None])[0, H - 1, 1, nb - 1].long() >> 3) & 15     # cross the page's end)
        esc = ((e < beta) | (e > beta + 2)).view(128, 4).sum(1)
        first = torch.cumsum(esc, 0) - esc
        cut = max(k for k in range(1, w) if bool(((first < 8 * k) & (first + esc > 8 * k)).any()))
        word += (cut - w) << 6
        meta[-1, -1, 0], meta[-1, -1, 1] = word & 0xFF, word >> 8
        buf = buf[:buf.numel() - 4 * (w - cut)]
    return buf


@pytest.mark.parametrize("how", ["first", "first_raw", "escape_words", "random", "no_escape_words", "short_stream"])
def test_corrupt_records_never_read_outside_the_arena(how):
    """The arena is a slice of a larger buffer; the kernel, given corrupt records, gives the same
    bits whatever lies before and after the slice (so it reads none of it). The last encoded page
    ends the arena, where an unclamped body or stream would run past it."""
    H, D = 1, 64
    pages = pages_of_blocks(3, H, D, seed=0, kinds=("sprinkled", "max_escapes"))
    g = torch.Generator().manual_seed(1)
    opened = pages[0].reshape(-1)
    bufs = [corrupt(pages[i], how, g) for i in (1, 2)]
    pad = (-bufs[0].numel()) % 16
    arena = torch.cat([opened, bufs[0], torch.zeros(pad, dtype=torch.uint8), bufs[1]])
    loc = torch.tensor([open_loc(0), opened.numel(), opened.numel() + bufs[0].numel() + pad])
    q = torch.randn(2, 2, D, generator=g).to(torch.bfloat16).to(DEVICE)
    bt = torch.tensor([[1, 2, 0], [2, 1, 0]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([40, 33], dtype=torch.int32, device=DEVICE)
    outs, tiles = [], []
    lay = Fp8PageLayout(H, D)
    for fill in (0x00, 0x7F, 0xFF):
        big = torch.full((arena.numel() + 8192,), fill, dtype=torch.uint8)
        big[4096:4096 + arena.numel()] = arena
        view = big.to(DEVICE)[4096:4096 + arena.numel()]
        outs.append(decode_attention_fp8_lossless(q, view, loc.to(DEVICE), bt, lens, lay, 0.125,
                                                  k_scale=2.0 ** -9))       # scores of O(1): every V row weighs
        tiles.append(restored(view, loc[1:].to(DEVICE), lay))              # the bytes (NaN or not)
    assert same_bits(outs[0], outs[1]) and same_bits(outs[0], outs[2])
    assert torch.equal(tiles[0], tiles[1]) and torch.equal(tiles[0], tiles[2])
