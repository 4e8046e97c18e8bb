"""Paged decode attention: fused (compressed pages), the uncompressed kernel (open pages), unfused, vs float64.

CPU tests run the Triton kernels under the Triton interpreter (tests/conftest.py) at small
sizes; the tests marked gpu (large shapes, the CUDA kernel, the Triton kernel compiled) run
only where a CUDA GPU is present. Every random draw is seeded; a failing check names its seed.
"""

import os
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

from helpers import (adversarial_escape_blocks, build_arena, escape_pattern_blocks,
                     pages_from_block_bits)
from zipfusion.analysis.synthetic import model_like_pages, pages_with_fraction, realistic_pages
from zipfusion.format import PageLayout
from zipfusion.kernels import decode_attention, decode_attention_uncompressed
from zipfusion.testing import reference_decode_attention
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from unfused import decode_attention_unfused  # noqa: E402  (benchmarks/unfused.py: the baseline)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu


def make_case(contexts, H, G, D, kind, seed, device=DEVICE):
    """Pages for requests of the given context lengths, their arenas and tables.

    kind: 'compressible' (every block compressible without escapes), 'raw' (none), 'mixed'
    (realistic KV: outlier channels, zeros; format v2 compresses every block, many of them
    with escapes), 'escapes' (a trained model's outliers at raised rates: blocks with 1-4
    escapes, raw blocks with 5, plain compressed ones, mixed in every page). Full pages are
    compressed in ``arena_c`` (except ~1/4 left open when ``kind == 'mixed'``, as a lazy memory
    manager would), the last partial page is open; ``arena_o`` holds the same pages all open.
    Pages are placed in random order with random gaps; page ids are shuffled. Every draw comes
    from ``seed`` (kept as ``c["seed"]`` for the failure messages).
    """
    gen = torch.Generator().manual_seed(seed)
    n_pages = [-(-L // 16) for L in contexts]
    P = sum(n_pages) + 3                                    # a few pages nobody uses
    if kind == "compressible":
        pages = pages_with_fraction(P, H, D, 1.0, seed=seed)
    elif kind == "raw":
        pages = pages_with_fraction(P, H, D, 0.0, seed=seed)
    elif kind == "escapes":
        pages = model_like_pages(P, H, D, seed=seed, counts=ESCAPE_RATES)
    else:
        pages = realistic_pages(P, H, D, seed=seed)
    ids = torch.randperm(P, generator=gen)
    width = max(n_pages) + 2
    bt = torch.randint(0, P, (len(contexts), width), generator=gen, dtype=torch.int32)
    compressed = torch.ones(P, dtype=torch.bool)
    k = 0
    for b, (L, n) in enumerate(zip(contexts, n_pages)):
        bt[b, :n] = ids[k:k + n].to(torch.int32)
        if L % 16:
            compressed[ids[k + n - 1]] = False
        k += n
    if kind == "mixed":
        compressed &= torch.rand(P, generator=gen) > 0.25
    arena_c, loc_c = build_arena(pages, compressed, seed=seed + 1, device=device)
    arena_o, loc_o = build_arena(pages, torch.zeros(P, dtype=torch.bool), seed=seed + 2,
                                 device=device)
    q = torch.randn(len(contexts), H * G, D, generator=gen).to(torch.bfloat16).to(device)
    lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    return dict(q=q, arena_c=arena_c, loc_c=loc_c, arena_o=arena_o, loc_o=loc_o,
                bt=bt.to(device), lens=lens, layout=PageLayout(H, D), scale=D ** -0.5, seed=seed)


# blocks with k = 1..5 values outside the window (5: raw), per role
ESCAPE_RATES = {"K": (0.25, 0.1, 0.05, 0.05, 0.1), "V": (0.2, 0.1, 0.05, 0.05, 0.1)}


def poisoned(q):
    return torch.full_like(q, float("nan"))


def same_bits(a, b):
    """Bit-for-bit equality (NaNs included)."""
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def check_case(c, unfused=True, **kw):
    """Fused kernel vs float64 reference; compressed and open pages, fused and uncompressed kernels (and the
    unfused baseline) bit-identical. ``kw``: the kernels' keyword arguments."""
    args = (c["bt"], c["lens"], c["layout"], c["scale"])
    tag = f"(seed {c['seed']}, {kw})"
    out_c = decode_attention(c["q"], c["arena_c"], c["loc_c"], *args, out=poisoned(c["q"]), **kw)
    assert not torch.isnan(out_c).any(), f"some outputs were not written {tag}"
    ref = reference_decode_attention(c["q"], c["arena_c"], c["loc_c"], *args, out_dtype=torch.float64,
                                     window=kw.get("window"), softcap=kw.get("softcap"))
    rel = ((out_c.double() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, f"relative error {rel:.3g} vs float64 reference {tag}"
    worst = ((out_c.double() - ref).abs().amax(-1) / ref.abs().amax(-1).clamp_min(1e-6)).max()
    assert worst < 5e-2, f"a head's max error is {worst:.3g} of its max |ref| {tag}"
    # same values read from open pages: bit-identical, fused and uncompressed kernels
    out_o = decode_attention(c["q"], c["arena_o"], c["loc_o"], *args, out=poisoned(c["q"]), **kw)
    out_t = decode_attention_uncompressed(c["q"], c["arena_o"], c["loc_o"], *args,
                                  out=poisoned(c["q"]), **kw)
    assert same_bits(out_c, out_o), f"compressed and open pages give different bits {tag}"
    assert same_bits(out_c, out_t), f"fused and uncompressed kernels give different bits {tag}"
    if unfused:
        out_u = decode_attention_unfused(c["q"], c["arena_c"], c["loc_c"], *args,
                                         out=poisoned(c["q"]), **kw)
        assert same_bits(out_c, out_u), f"unfused baseline differs from the uncompressed kernel {tag}"
    return rel


# ------------------------------------------------------------------------------------------
# CPU (interpreter) and GPU: small shapes
# ------------------------------------------------------------------------------------------

SMALL = [
    # contexts, H, G, kind, tile_pages, num_splits, also the unfused baseline
    ([1, 17], 1, 4, "mixed", 1, None, True),
    ([15, 16], 1, 8, "compressible", 1, None, False),
    ([33, 5], 1, 1, "raw", 2, None, False),
    ([33], 2, 4, "mixed", 1, 2, False),
    ([48, 7], 2, 4, "escapes", 2, None, True),
]


@pytest.mark.parametrize("contexts,H,G,kind,tp,splits,unfused", SMALL)
def test_small_cases(contexts, H, G, kind, tp, splits, unfused, seed):
    check_case(make_case(contexts, H, G, 128, kind, seed), num_splits=splits, tile_pages=tp,
               unfused=unfused)


@pytest.mark.parametrize("D", [64, 256])
def test_other_head_dims(D, seed):
    check_case(make_case([20], 1, 4, D, "mixed", seed), tile_pages=1, unfused=False)


@pytest.mark.parametrize("contexts,D,G,window,softcap,splits", [([40, 7], 64, 16, 5, None, 3),
                                                                 ([35], 256, 2, 18, 2.0, 2)])
def test_sliding_window_and_softcap(contexts, D, G, window, softcap, splits, seed):
    """Sliding-window layers (keys before the window masked, pages wholly before it skipped --
    splits left empty included) and soft-capped scores: against float64, and compressed = open
    pages = the uncompressed kernel, bit for bit."""
    check_case(make_case(contexts, 1, G, D, "escapes", seed), unfused=False, window=window, softcap=softcap,
               num_splits=splits, tile_pages=1)


@settings(max_examples=2, deadline=None)
@given(st.lists(st.integers(1, 24), min_size=1, max_size=2), st.sampled_from([1, 2, 4, 8]),
       st.sampled_from(["mixed", "compressible", "raw", "escapes"]), st.integers(0, 2**20))
def test_hypothesis_random_shapes(contexts, G, kind, seed):
    check_case(make_case(contexts, 1, G, 128, kind, seed), tile_pages=1, unfused=False)


def test_single_split_equals_multi_split_closely():
    c = make_case([40], 1, 4, 128, "mixed", 7)
    args = (c["q"], c["arena_c"], c["loc_c"], c["bt"], c["lens"], c["layout"], c["scale"])
    a = decode_attention(*args, num_splits=1, tile_pages=1)
    b = decode_attention(*args, num_splits=3, tile_pages=1)
    assert (a.double() - b.double()).abs().max() < 2e-2, "seed 7"


# ------------------------------------------------------------------------------------------
# Fixed split size (split_pages): a request's bits do not depend on the batch
# ------------------------------------------------------------------------------------------

def sub_batch(c, rows, width, seed):
    """Requests ``rows`` of case ``c`` as a batch of their own: their q, lengths and table rows,
    the table cut or padded (with random page ids past the context) to ``width`` columns."""
    gen = torch.Generator().manual_seed(seed)
    bt = c["bt"][rows].cpu()
    if width > bt.shape[1]:
        pad = torch.randint(0, c["loc_c"].numel(), (len(rows), width - bt.shape[1]),
                            generator=gen, dtype=torch.int32)
        bt = torch.cat([bt, pad], 1)
    rows_t = torch.tensor(rows, device=c["q"].device)
    return c["q"][rows_t], bt[:, :width].contiguous().to(c["q"].device), c["lens"][rows_t]


def check_batch_invariance(c, batches, split_pages, **kw):
    """Every request of ``c`` that is in several ``batches`` (lists of (rows, table width))
    gets the same bits in each of them, fused over compressed pages, fused over open pages
    and the uncompressed kernel alike; every result is close to the float64 reference."""
    kernels = {"fused, compressed pages": (decode_attention, c["arena_c"], c["loc_c"]),
               "fused, open pages": (decode_attention, c["arena_o"], c["loc_o"]),
               "uncompressed": (decode_attention_uncompressed, c["arena_o"], c["loc_o"])}
    seen = {}                                  # request -> (its output row, where it came from)
    for i, (rows, width) in enumerate(batches):
        q, bt, lens = sub_batch(c, rows, width, seed=c["seed"] + i)
        args = (bt, lens, c["layout"], c["scale"])
        ref = reference_decode_attention(q, c["arena_o"], c["loc_o"], *args,
                                         out_dtype=torch.float64)
        for name, (fn, arena, loc) in kernels.items():
            out = fn(q, arena, loc, *args, out=poisoned(q), split_pages=split_pages, **kw)
            rel = ((out.double() - ref).norm() / ref.norm()).item()
            where = f"{name}, batch {rows} width {width} (seed {c['seed']}, split_pages " \
                    f"{split_pages}, {kw})"
            assert rel < 1e-2, f"relative error {rel:.3g} vs float64: {where}"
            for j, r in enumerate(rows):
                first = seen.setdefault(r, (out[j], where))
                assert same_bits(out[j], first[0]), \
                    f"request {r}: different bits in {where} and in {first[1]}"


def test_split_pages_batch_invariant(seed):
    """split_pages=4. Request 0 (3 pages, the last one partial and open) alone is one split
    (the single-split path) and in the batches the first of two or three (the merge); request 1
    (5 pages) is two splits alone and two of three in the wide batch, whose other requests are
    much longer (7 pages) or shorter (1 token) and whose table is 5 columns wider."""
    contexts = [37, 80, 21, 100, 1, 16]
    c = make_case(contexts, 1, 4, 128, "mixed", seed)
    pages = [-(-L // 16) for L in contexts]
    batches = [([0], pages[0]), ([1], pages[1]), ([0, 2, 1], max(pages[:3])),
               ([3, 1, 4, 0, 5, 2], max(pages) + 5)]
    check_batch_invariance(c, batches, split_pages=4)


def test_balanced_splits_ignore_the_table_width(seed):
    """Without split_pages each request's own pages are spread over the launch's splits: its bits
    depend on the split count alone, not on the table's width or the other requests (the
    engine's tables are as wide as max_model_len allows)."""
    contexts = [37, 80, 21, 100, 1, 16]
    c = make_case(contexts, 1, 4, 128, "mixed", seed)
    pages = [-(-L // 16) for L in contexts]
    batches = [([1, 0], pages[1]), ([0, 2, 1], max(pages[:3]) + 9), ([3, 1, 4, 0, 5, 2], 40)]
    check_batch_invariance(c, batches, None, num_splits=3, tile_pages=1)


def test_balanced_split_size():
    """The host's copy of the kernels' rule: a request's pages over S splits in whole tiles, or
    the fixed size; the longest request of a mixed batch is cut as finely as the others."""
    from zipfusion.kernels.splits import split_size
    assert split_size(137, -1, 3) == 46 and split_size(44, -1, 3) == 15
    assert split_size(5, -2, 3) == 2 and split_size(7, -2, 3) == 4 and split_size(1, -2, 8) == 2
    assert split_size(100, 16, 3) == 16 and split_size(3, -1, 1) == 3
    for n in range(1, 300):
        for S in (1, 2, 3, 7, 64):
            for T in (1, 2, 4):
                k = split_size(n, -T, S)
                assert k % T == 0 and -(-n // k) <= S and (k == T or -(-n // (k - T)) > S), (n, S, T)


def test_split_pages_arguments(small):
    c = small
    with pytest.raises(ValueError, match="split_pages"):
        _call(c, split_pages=0)
    with pytest.raises(ValueError, match="split_pages"):
        _call(c, split_pages=2.0)
    with pytest.raises(ValueError, match="not both"):
        _call(c, split_pages=2, num_splits=2)
    with pytest.raises(ValueError, match="num_splits"):
        _call(c, num_splits=0)
    with pytest.raises(ValueError, match="multiple of the Triton kernel's tile of 2 pages"):
        _call(c, split_pages=3, tile_pages=2, backend="triton")
    # a split larger than the table: one split, the same bits as one split asked for
    assert same_bits(_call(c, split_pages=64), _call(c, num_splits=1))


# ------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small():
    return make_case([20, 7], 1, 4, 128, "mixed", 3)


def _call(c, fn=decode_attention, **over):
    a = dict(q=c["q"], arena=c["arena_c"], page_loc_layer=c["loc_c"], block_table=c["bt"],
             context_lens=c["lens"], layout=c["layout"], sm_scale=c["scale"])
    a.update(over)
    return fn(**a)


def test_bad_dtypes_and_shapes(small):
    c = small
    with pytest.raises(TypeError, match="bfloat16"):
        _call(c, q=c["q"].float())
    with pytest.raises(ValueError, match="num_q_heads"):
        _call(c, q=c["q"][:, :, :64])
    with pytest.raises(TypeError, match="uint8"):
        _call(c, arena=c["arena_c"].view(torch.int8))
    with pytest.raises(TypeError, match="int64"):
        _call(c, page_loc_layer=c["loc_c"].int())
    with pytest.raises(TypeError, match="int32"):
        _call(c, block_table=c["bt"].long())
    with pytest.raises(TypeError, match="context_lens"):
        _call(c, context_lens=c["lens"][:1])
    with pytest.raises(ValueError, match="sm_scale"):
        _call(c, sm_scale=float("nan"))
    with pytest.raises(TypeError, match="PageLayout"):
        _call(c, layout=(1, 128))
    with pytest.raises(ValueError, match="out must be"):
        _call(c, out=torch.empty(2, 4, 64, dtype=torch.bfloat16, device=c["q"].device))


def test_bad_ids(small):
    c = small
    bt = c["bt"].clone()
    bt[0, 0] = c["loc_c"].numel()
    with pytest.raises(ValueError, match="page ids"):
        _call(c, block_table=bt)
    with pytest.raises(ValueError, match="context_lens.*got min 0, max 0"):
        _call(c, context_lens=torch.zeros_like(c["lens"]))
    top = 16 * c["bt"].shape[1] + 1
    with pytest.raises(ValueError, match=f"context_lens.*got min {top}, max {top}"):
        _call(c, context_lens=torch.full_like(c["lens"], top))
    loc = c["loc_c"].clone()
    loc[c["bt"][0, 0].long()] = -1
    with pytest.raises(ValueError, match="no page"):
        _call(c, page_loc_layer=loc)
    loc = c["loc_c"].clone()
    loc[c["bt"][1, 0].long()] &= ~1                          # request 1 (7 tokens): partial page
    with pytest.raises(ValueError, match="partial page"):
        _call(c, page_loc_layer=loc)
    with pytest.raises(ValueError, match="open pages only"):
        _call(c, fn=decode_attention_uncompressed)


def test_bad_ids_are_asserted_on_the_device_too():
    """check_ids_async (the engine's check_pages=True) finds what check_ids finds, plus
    misaligned and past-the-end locations, with no host sync. On CPU tensors, where the assert
    raises at once (on a GPU a device-side assert ends the process: the next test)."""
    from zipfusion.kernels.decode_attention import check_ids, check_ids_async
    c = make_case([20, 7], 1, 4, 128, "mixed", 3, device="cpu")
    args = dict(arena=c["arena_c"], page_loc_layer=c["loc_c"], block_table=c["bt"], context_lens=c["lens"],
                layout=c["layout"], open_only=None)
    check_ids_async(**args)                                     # a sound step passes
    bt = c["bt"].clone()
    bt[0, 0] = c["loc_c"].numel()
    bad = [dict(block_table=bt), dict(context_lens=torch.zeros_like(c["lens"])), dict(open_only="the uncompressed kernel")]
    for change, match in ((lambda loc, p: -1, "no page"), (lambda loc, p: loc[p] + 2, "16-byte aligned"),
                          (lambda loc, p: c["arena_c"].numel() + 16, "past the end")):
        loc = c["loc_c"].clone()
        p = c["bt"][0, 0].long()
        loc[p] = change(loc, p)
        bad.append(dict(page_loc_layer=loc))
        with pytest.raises(ValueError, match=match):
            check_ids(**{**args, "page_loc_layer": loc})
    loc = c["loc_c"].clone()
    loc[c["bt"][1, 0].long()] &= ~1                          # request 1 (7 tokens): partial page
    bad.append(dict(page_loc_layer=loc))
    for over in bad:
        with pytest.raises(RuntimeError):
            check_ids_async(**{**args, **over})


# ------------------------------------------------------------------------------------------
# GPU: the large shapes
# ------------------------------------------------------------------------------------------

LARGE = [
    # contexts, G, kind
    ([32768], 4, "mixed"),
    ([1, 15, 16, 17, 1000, 8192, 333], 8, "mixed"),
    ([8192] * 8, 4, "compressible"),
    ([1000] * 64, 1, "raw"),
    ([1000, 17, 16, 15, 1] * 6 + [8192, 32768], 8, "compressible"),
    ([700] * 64, 4, "mixed"),
    ([8192] * 32, 4, "escapes"),
    ([1, 15, 17, 1000, 8192, 333], 16, "escapes"),
]


BACKENDS = ["triton", "cuda"]


@gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("contexts,G,kind", LARGE)
def test_large_cases_gpu(contexts, G, kind, backend, seed):
    check_case(make_case(contexts, 8, G, 128, kind, seed), backend=backend)


@gpu
@pytest.mark.parametrize("contexts,H,G,kind,tp,splits,unfused", SMALL)
def test_small_cases_cuda_kernel(contexts, H, G, kind, tp, splits, unfused, seed):
    check_case(make_case(contexts, H, G, 128, kind, seed), num_splits=splits, unfused=unfused,
               backend="cuda")


@gpu
@pytest.mark.parametrize("kind", ["mixed", "escapes"])
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("stages,splits", [(3, None), (4, 1), (6, 7), (4, 64)])
def test_cuda_kernel_pipeline_depths_and_splits(stages, splits, tma, kind, seed):
    if tma and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("bulk copies (TMA) need sm_90+")
    check_case(make_case([3000, 17, 8192, 1], 8, 4, 128, kind, seed), num_splits=splits,
               stages=stages, tma=tma, producer=False, unfused=False, backend="cuda")


@gpu
@pytest.mark.parametrize("kind", ["mixed", "escapes", "compressible"])
@pytest.mark.parametrize("G", [4, 16])
@pytest.mark.parametrize("splits", [None, 1, 7, 64])
def test_cuda_producer_kernel(splits, G, kind, seed):
    """The producer-warp kernel (one warp copies, four compute) against the reference, and the
    same bits as the per-warp kernels: requests of 1 page to 8K tokens, ragged last pages,
    rounds of pages that end mid-round, splits with fewer pages than warps."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the producer kernel's bulk copies need sm_90+")
    case = make_case([3000, 17, 8192, 1, 33, 130], 8, G, 128, kind, seed)
    check_case(case, num_splits=splits, producer=True, unfused=False, backend="cuda")
    args = (case["q"], case["arena_c"], case["loc_c"], case["bt"], case["lens"], case["layout"],
            case["scale"])
    outs = [decode_attention(*args, num_splits=splits, producer=p, tma=t, backend="cuda")
            for p, t in ((True, True), (False, True), (False, False))]
    assert same_bits(outs[0], outs[1]) and same_bits(outs[0], outs[2]), f"seed {seed}"


@gpu
@pytest.mark.parametrize("D", [128, 64, 256])
@pytest.mark.parametrize("backend", BACKENDS)
def test_escape_patterns_gpu(backend, D):
    """Format v2 escapes in both decode kernels: blocks carrying every finite pattern of
    exponent <= 140 as an escape (4 per block, next to windows just above or below it), and
    the 4/5-outlier blocks made finite, compressed, against the same pages open (the uncompressed kernel).
    (Every pattern, NaN and inf included, goes through the Triton restore bit for bit in
    tests/test_prefill_attention.py::test_gather_restores_escape_patterns.)"""
    blocks = escape_pattern_blocks()
    blocks = blocks[((blocks >> 7) & 0xFF).amax(1) <= 140]
    blocks = torch.cat([blocks, adversarial_escape_blocks()[:8]])
    pages = pages_from_block_bits(blocks, 8, D).nan_to_num(0.0, 1.0, -1.0)
    P = pages.shape[0]
    gen = torch.Generator().manual_seed(6)
    arena_c, loc_c = build_arena(pages, torch.ones(P, dtype=torch.bool), seed=4, device=DEVICE)
    arena_o, loc_o = build_arena(pages, torch.zeros(P, dtype=torch.bool), seed=5, device=DEVICE)
    order = torch.randperm(P, generator=gen).to(torch.int32)
    B = 8                                                    # requests of P / 8 pages each
    bt = order[:P // B * B].view(B, -1).to(DEVICE)
    lens = torch.full((B,), 16 * bt.shape[1], dtype=torch.int32, device=DEVICE)
    q = (torch.randn(B, 32, D, generator=gen) * 0.05).to(torch.bfloat16).to(DEVICE)
    args = (bt, lens, PageLayout(8, D), D ** -0.5)
    out_c = decode_attention(q, arena_c, loc_c, *args, backend=backend)
    out_t = decode_attention_uncompressed(q, arena_o, loc_o, *args, backend=backend)
    assert torch.isfinite(out_t.float()).all()
    assert same_bits(out_c, out_t), "fused (escapes) and uncompressed kernels give different bits"


@gpu
@pytest.mark.parametrize("D", [128, 64, 256])
@pytest.mark.parametrize("G", [1, 4, 8, 9, 16])
def test_cuda_kernel_group_sizes(G, D, seed):
    check_case(make_case([700, 33, 16], 2, G, D, "compressible", seed), unfused=False,
               backend="cuda")


def cuda_variants():
    """(producer, tma, stages) of every copy scheme of the CUDA kernel this GPU runs."""
    hopper = torch.cuda.get_device_capability()[0] >= 9
    per_warp = [(False, t, st) for t in ((False, True) if hopper else (False,)) for st in (3, 4, 6)]
    return ([(True, None, None)] if hopper else []) + per_warp


@gpu
@pytest.mark.parametrize("D", [64, 256])
@pytest.mark.parametrize("kind", ["mixed", "escapes", "raw", "compressible"])
@pytest.mark.parametrize("G", [1, 4, 16])
def test_cuda_kernel_head_dims(D, kind, G, seed):
    """The CUDA kernel at head_dim 64 and 256: vs the float64 reference, and compressed pages
    (raw blocks, compressed ones, ones with escapes, open pages among them), open pages and the
    uncompressed kernel the same bits; every copy scheme (producer warp, per-warp bulk copies,
    cp.async; 3, 4, 6 stages) the same bits at 1, 7 and 64 splits (64: fewer pages than warps).
    Requests of 1 page to 3000 tokens, ragged last pages."""
    case = make_case([3000, 17, 1, 33, 130, 700], 2, G, D, kind, seed)
    check_case(case, unfused=False, backend="cuda")
    args = (case["bt"], case["lens"], case["layout"], case["scale"])
    for splits in (1, 7, 64):
        outs = [decode_attention(case["q"], case["arena_c"], case["loc_c"], *args, num_splits=splits,
                                 producer=p, tma=t, stages=st, backend="cuda")
                for p, t, st in cuda_variants()]
        outs += [decode_attention_uncompressed(case["q"], case["arena_o"], case["loc_o"], *args,
                                               num_splits=splits, producer=p, tma=t, stages=st,
                                               backend="cuda")
                 for p, t, st in cuda_variants()]
        for o, v in zip(outs[1:], cuda_variants()[1:] + cuda_variants()):
            assert same_bits(outs[0], o), f"copy scheme {v} differs (seed {seed}, splits {splits})"


@gpu
@pytest.mark.parametrize("D", [128, 64, 256])
@pytest.mark.parametrize("backend", BACKENDS)
def test_adversarial_values_and_garbage_past_the_end_gpu(backend, D):
    """±0, subnormals, huge and tiny exponents in the same blocks, and NaN/inf bytes in the
    unused slots of each request's open last page: output finite, compressed == uncompressed bits."""
    c = make_case([45, 16, 3], 2, 4, D, "mixed", 11)
    gen = torch.Generator().manual_seed(5)
    for arena, loc in ((c["arena_c"], c["loc_c"]), (c["arena_o"], c["loc_o"])):
        for b, L in enumerate(c["lens"].tolist()):
            if L % 16 == 0:
                continue
            start = int(loc[int(c["bt"][b, (L - 1) // 16])]) & ~1
            page = arena[start:start + c["layout"].open_page_bytes].view(torch.bfloat16)
            page = page.view(2, 16, 2, D)
            page[:, L % 16:] = float("nan")
            page[1, L % 16:, :, ::3] = float("inf")
    # adversarial values in the open pages' valid tokens: signed zeros, subnormals, wide range
    special = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 2 ** -126, 1.0, -2.5, 60.0],
                           dtype=torch.bfloat16)
    vals = special[torch.randint(0, 8, (2, 3, 2, D), generator=gen)].to(c["q"].device)
    for arena, loc in ((c["arena_c"], c["loc_c"]), (c["arena_o"], c["loc_o"])):
        start = int(loc[int(c["bt"][2, 0])]) & ~1                  # request 2: 3 tokens, open
        page = arena[start:start + c["layout"].open_page_bytes].view(torch.bfloat16)
        page.view(2, 16, 2, D)[:, :3] = vals
    args = (c["bt"], c["lens"], c["layout"], c["scale"])
    out_c = decode_attention(c["q"], c["arena_c"], c["loc_c"], *args, backend=backend)
    out_t = decode_attention_uncompressed(c["q"], c["arena_o"], c["loc_o"], *args, backend=backend)
    assert torch.isfinite(out_c.float()).all(), \
        "garbage past the context leaked into the output (seeds 11, 5)"
    assert same_bits(out_c, out_t), "fused and uncompressed kernels give different bits (seeds 11, 5)"


@gpu
@pytest.mark.parametrize("tp,splits", [(1, None), (4, None), (2, 1), (2, 16)])
def test_tilings_gpu(tp, splits, seed):
    """The Triton kernel compiled, at several tile sizes and split counts."""
    check_case(make_case([3000, 17, 8192], 8, 4, 128, "mixed", seed), num_splits=splits,
               tile_pages=tp, unfused=False, backend="triton")


@gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("split_pages", [16, 64])
@pytest.mark.parametrize("G", [4, 8])
def test_split_pages_batch_invariant_gpu(backend, split_pages, G, seed):
    """Large contexts on the GPU, both kernels: requests 0 and 1 alone, in a batch of 3 and
    among much longer / shorter requests with a wider table give the same bits."""
    contexts = [1000, 3000, 500, 8192, 1, 17, 32768, 16]
    c = make_case(contexts, 8, G, 128, "mixed", seed)
    pages = [-(-L // 16) for L in contexts]
    batches = [([0], pages[0]), ([1], pages[1]), ([0, 2, 1], max(pages[:3])),
               ([3, 1, 4, 0, 5, 2], max(pages[:6]) + 40), ([6, 0, 7, 1] * 8, max(pages) + 1)]
    check_batch_invariance(c, batches, split_pages, backend=backend)


@gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_balanced_splits_ignore_the_table_width_gpu(backend, seed):
    """Both kernels, balanced splits (no split_pages), 6 splits: a request's bits do not depend
    on the table's width (the engine's CUDA graphs pass tables as wide as max_model_len) or on
    the other requests."""
    contexts = [1000, 3000, 500, 8192, 1, 17, 700, 16]
    c = make_case(contexts, 8, 4, 128, "mixed", seed)
    pages = [-(-L // 16) for L in contexts]
    batches = [([0, 1], pages[1]), ([0, 2, 1], max(pages[:3]) + 7), ([3, 1, 4, 0, 5, 2], 2047),
               ([6, 0, 7, 1] * 8, 2047)]
    check_batch_invariance(c, batches, None, num_splits=6, backend=backend)


# ------------------------------------------------------------------------------------------
# Backend choice (CPU-checkable) and the CUDA source
# ------------------------------------------------------------------------------------------

@gpu
def test_bad_ids_device_assert_cuda():
    """On a GPU check_ids_async queues its assert without a host sync: a sound step passes, a
    misaligned page location fires a device-side assert at the next sync. Such an assert ends
    the CUDA context, so the check runs in a child process."""
    import subprocess
    code = "\n".join([
        "import torch",
        "from test_decode_attention import make_case",
        "from zipfusion.kernels.decode_attention import check_ids_async",
        "c = make_case([20, 7], 1, 4, 128, 'mixed', 3, device='cuda')",
        "args = dict(arena=c['arena_c'], page_loc_layer=c['loc_c'], block_table=c['bt'],",
        "            context_lens=c['lens'], layout=c['layout'], open_only=None)",
        "check_ids_async(**args); torch.cuda.synchronize(); print('sound ok', flush=True)",
        "loc = c['loc_c'].clone(); loc[c['bt'][0, 0].long()] += 2",
        "check_ids_async(**{**args, 'page_loc_layer': loc}); print('queued', flush=True)",
        "torch.cuda.synchronize(); print('not caught', flush=True)"])
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.path.join(here, "..", "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert "sound ok" in res.stdout and "queued" in res.stdout, res.stdout + res.stderr[-3000:]
    assert "not caught" not in res.stdout and res.returncode != 0
    assert "device-side assert" in res.stderr, res.stderr[-3000:]


def test_backend_argument(small):
    c = small
    with pytest.raises(ValueError, match="backend"):
        _call(c, backend="tensorrt")
    if not torch.cuda.is_available():
        from zipfusion.kernels.cuda_attention import CudaKernelUnavailable
        with pytest.raises(CudaKernelUnavailable, match="not on a CUDA device"):
            _call(c, backend="cuda")
        # auto on CPU tensors: the Triton kernel, same bits as asking for it
        assert same_bits(_call(c, backend="auto"), _call(c, backend="triton"))


@gpu
def test_cuda_source_compiles(tmp_path):
    """The CUDA kernel builds (all template instances, sm_80 and sm_90, and the variant with the
    COMPRESSED_ESC page kind, the two diagnostic builds), the five builds at once. Marked gpu:
    five nvcc builds took 223 s of a 2-core CPU machine's test run (issue 48); the GPU machine
    builds the kernel anyway and runs this with ``-m gpu``."""
    import shutil
    import subprocess
    from zipfusion.kernels.cuda_attention import SOURCE
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not installed: the CUDA kernel is built on the GPU machine")
    builds = {}
    for i, (arch, flags) in enumerate((("80", []), ("90", []), ("90", ["-DZF_ESC_KIND"]),
                                       ("90", ["-DZF_DIAG_COPY_ONLY"]), ("90", ["-DZF_DIAG_COMPUTE_ONLY"]),
                                       ("80", ["-DZF_HEAD_DIM=64"]), ("80", ["-DZF_HEAD_DIM=256"]))):
        cmd = [nvcc, "-O1", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}", *flags,
               "-c", "-o", str(tmp_path / f"k{i}.o"), str(SOURCE)]
        builds[" ".join([f"sm_{arch}", *flags])] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                                                    stderr=subprocess.PIPE, text=True)
    for name, proc in builds.items():
        err = proc.communicate()[1]
        assert proc.returncode == 0, f"{name}: {err[-3000:]}"


def ptxas_usage(log: str) -> dict[str, tuple[int, int]]:
    """{kernel: (registers, spill bytes stored)} from nvcc -Xptxas -v output."""
    usage, name, spill = {}, None, 0
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            name, spill = m.group(1), 0
        elif m := re.search(r"(\d+) bytes spill stores", line):
            spill = int(m.group(1))
        elif (m := re.search(r"Used (\d+) registers", line)) and name:
            usage[name], name = (int(m.group(1)), spill), None
    return usage


def test_cuda_kernel_builds_for_head_dims_64_and_256(tmp_path):
    """The CUDA kernel's head_dim 64 and 256 libraries build for sm_90 with the library's own
    nvcc command, every kernel without register spills (ptxas -v), and at 256 the producer
    kernel (160 threads) fits two CTAs an SM. (head_dim 128 and sm_80: test_cuda_source_compiles
    on the GPU machine.) Two builds side by side, ~40 s of CPU."""
    from zipfusion.kernels import cuda_attention as ca
    try:
        cmds = {D: ca.nvcc_command("90", [f"-DZF_HEAD_DIM={D}", "-Xptxas", "-v"], tmp_path / f"d{D}.so")
                for D in (64, 256)}
    except ca.CudaKernelUnavailable as e:
        pytest.skip(f"{e}: the CUDA kernel is built on the GPU machine")
    procs = {D: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for D, cmd in cmds.items()}
    for D, proc in procs.items():
        log = proc.communicate()[0]
        assert proc.returncode == 0, f"head_dim {D}: {log[-3000:]}"
        usage = ptxas_usage(log)
        kernels = {k: v for k, v in usage.items() if "attention_kernel" in k or "producer_kernel" in k}
        # compressed/uncompressed x NT x (10 per-warp variants + 2 producer); 256: one n-tile
        assert len(kernels) == (2 if D == 256 else 4) * 12, f"head_dim {D}: {sorted(usage)}"
        spills = {k: v for k, v in kernels.items() if v[1]}
        assert not spills, f"head_dim {D}: kernels spill registers: {spills}"
        if D == 256:
            producer = [r for k, (r, _) in kernels.items() if "producer_kernel" in k]
            assert max(producer) <= 200, f"the producer kernel takes {producer} registers (> 200)"


def test_cuda_build_defines(monkeypatch):
    """Build variants are asked for by name (benchmarks/attention.py --define / --diag, the tests'
    --cuda-define), never by the environment: the defines reach nvcc and key the built library;
    a malformed one is a clear error."""
    from zipfusion.kernels import cuda_attention as ca
    built = []
    monkeypatch.setattr(ca, "_build", lambda arch, flags: built.append(flags) or object())
    monkeypatch.setattr(ca, "_BUILT", {})
    monkeypatch.setattr(ca, "_FLAGS", [])
    for defines in ((), ("ZF_ESC_KIND",), ("ZF_ESC_KIND",), ("ZF_ESC_KIND", "ZF_X=2"), ()):
        ca.set_build_defines(*defines)
        ca._library("90")
    ca._library("90", 256)                                     # one library per head dim
    d128, d256 = "-DZF_HEAD_DIM=128", "-DZF_HEAD_DIM=256"
    assert built == [[d128], [d128, "-DZF_ESC_KIND"], [d128, "-DZF_ESC_KIND", "-DZF_X=2"], [d256]]
    with pytest.raises(ValueError, match="NAME or NAME=VALUE"):
        ca.set_build_defines("-DZF_ESC_KIND")


def test_cuda_build_failure_is_remembered_and_warned_once(monkeypatch, environ, tmp_path):
    """No nvcc: one warning, one attempt, then the same clear error (callers use Triton)."""
    from zipfusion.kernels import cuda_attention as ca
    calls = []

    def no_nvcc():
        calls.append(1)
        raise ca.CudaKernelUnavailable("nvcc was not found")
    monkeypatch.setattr(ca, "_nvcc", no_nvcc)
    monkeypatch.setattr(ca, "_BUILT", {})
    environ(ZIPFUSION_KERNEL_CACHE=str(tmp_path))
    with pytest.warns(UserWarning, match="falls back to the slower Triton kernel"):
        with pytest.raises(ca.CudaKernelUnavailable, match="nvcc"):
            ca._library("00")
    with pytest.raises(ca.CudaKernelUnavailable, match="nvcc"):
        ca._library("00")
    assert len(calls) == 1


def test_cuda_copy_choice(environ):
    """Which CUDA kernel variant a call gets: the producer warp for compressed pages on Hopper,
    per-warp copies for the uncompressed kernel and wherever a per-warp knob is asked for, the environment
    overriding the default; contradictions are clear errors."""
    from zipfusion.kernels.cuda_attention import CudaKernelUnavailable, choose_copy
    environ(ZIPFUSION_CUDA_PRODUCER=None)
    assert choose_copy(True, True, 4, None, None, None) == (4, 2)          # fused: producer
    assert choose_copy(False, True, 4, None, None, None) == (3, 0)         # uncompressed: cp.async
    assert choose_copy(True, False, 4, None, None, None) == (4, 0)         # sm_80: cp.async
    assert choose_copy(True, True, 4, 3, None, None) == (3, 1)             # a per-warp depth
    assert choose_copy(True, True, 4, None, False, None) == (4, 0)         # cp.async asked for
    assert choose_copy(True, True, 4, 4, True, False) == (4, 1)
    assert choose_copy(False, True, 4, None, None, True) == (4, 2)         # the uncompressed producer kernel
    assert choose_copy(False, True, 16, None, None, None, 256) == (3, 0)   # head_dim 256: 3 stages
    assert choose_copy(True, False, 16, None, None, None, 256) == (3, 0)
    assert choose_copy(True, True, 16, None, None, None, 256) == (4, 2)
    environ(ZIPFUSION_CUDA_PRODUCER="0")
    assert choose_copy(True, True, 4, None, None, None) == (4, 1)
    environ(ZIPFUSION_CUDA_PRODUCER="1")
    assert choose_copy(False, True, 4, None, None, None) == (4, 2)
    assert choose_copy(True, False, 4, None, None, None) == (4, 0)         # no Hopper, no producer
    with pytest.raises(ValueError, match="stages=3 with producer=True"):
        choose_copy(True, True, 4, 3, None, True)
    with pytest.raises(ValueError, match="producer=True with tma=False"):
        choose_copy(True, True, 4, None, False, True)
    with pytest.raises(CudaKernelUnavailable, match="sm_90"):
        choose_copy(True, False, 4, None, None, True)


def test_cuda_split_heuristic_packs_whole_waves(monkeypatch):
    """The split-KV wave model (H200: 132 SMs): the measured best at batch 32 x 8K (3 splits
    for the fused kernel's 396 slots), >= 16 pages a split, and no splits where one wave of
    whole requests already fills the GPU. It takes no kernel or depth: fused and uncompressed kernels must
    split alike to give the same bits (check_case holds them to it)."""
    from types import SimpleNamespace
    from zipfusion.kernels import cuda_attention as ca
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=132))
    assert ca.default_num_splits(32, 8, 513, "cuda") == 3
    assert ca.default_num_splits(93, 8, 513, "cuda") == 1
    for B in (1, 2, 8, 64, 256):
        for pages in (1, 17, 129, 513, 2049):
            S = ca.default_num_splits(B, 8, pages, "cuda")
            assert 1 <= S <= 64 and (S == 1 or -(-pages // S) >= 16)
    assert ca.ctas_per_sm(3) == 4 and ca.ctas_per_sm(4) == 3 and ca.ctas_per_sm(6) == 2
    assert ca.ctas_per_sm(3, 256) == 2 and ca.ctas_per_sm(4, 256) == 1
    # head_dim 256: 264 slots; a group of 16 is two CTAs per KV head (8 query heads each)
    assert ca.head_passes(16, 256) == 2 and ca.head_passes(8, 256) == 1 and ca.head_passes(16, 128) == 1
    assert ca.default_num_splits(32, 8, 513, "cuda", 256, 16) <= ca.default_num_splits(32, 8, 513, "cuda", 256, 8)


# ------------------------------------------------------------------------------------------
# Packed requests: rows behind shared pages in one request's columns (attention/packing.py)
# ------------------------------------------------------------------------------------------

class _Decode:
    """What PackedPlan.run asks of the engine's decode route: the kernel on one case."""

    def __init__(self, c, fn, arena, loc, **kw):
        self.c, self.fn, self.arena, self.loc, self.kw = c, fn, arena, loc, kw

    def __call__(self, layer, q, block_table, context_lens, **packed):
        return self.fn(q, self.arena, self.loc, block_table, context_lens, self.c["layout"],
                       self.c["scale"], out=poisoned(q), **packed, **self.kw)


def packed_case(groups, lone, G, kind, seed, H=2, D=128):
    """A case whose rows in each group of ``groups`` (shared pages, [context lengths]) begin
    with the first row's pages (full, compressed in arena_c unless 'mixed' left one open),
    then ``lone`` rows of their own. Each row's last page is open and holds NaN and inf past
    its context (in the middle of a packed request's table, where a slot's own pages end)."""
    contexts = [L for _, lens in groups for L in lens] + list(lone)
    c = make_case(contexts, H, G, D, kind, seed)
    bt, row = c["bt"].cpu(), 0
    for shared, lens in groups:
        assert all(L > 16 * shared for L in lens)
        for r in range(row + 1, row + len(lens)):
            bt[r, :shared] = bt[row, :shared]
        row += len(lens)
    c["bt"] = bt.to(c["q"].device)
    for arena, loc in ((c["arena_c"], c["loc_c"]), (c["arena_o"], c["loc_o"])):
        for b, L in enumerate(contexts):
            if L % 16:
                start = int(loc[int(bt[b, (L - 1) // 16])]) & ~1
                page = arena[start:start + c["layout"].open_page_bytes].view(torch.bfloat16)
                page = page.view(2, 16, H, D)
                page[:, L % 16:] = float("nan")
                page[1, L % 16:, :, ::3] = float("inf")
    return c


PACKED = [
    # groups (shared pages, lengths), lone rows, G, kind, pack_heads
    ([(2, [40, 53, 69])], [5], 4, "mixed", 8),             # a pair, a group's last row alone, a lone row
    ([(3, [49, 64, 100, 50]), (2, [33, 47])], [17, 1], 2, "escapes", 8),   # R = 4
    ([(2, [37, 90, 45])], [], 4, "compressible", 16),      # R = 4 with an empty slot
    ([(4, [80, 65])], [30], 8, "mixed", 16),               # two n-tiles of one row each
]


def check_packed(groups, lone, G, kind, pack_heads, seed, D=128, **kw):
    """Packed requests vs the plain kernel row by row (close) and the float64 reference;
    compressed pages, open pages and the uncompressed kernel give the same bits."""
    from zipfusion.attention import packing
    from zipfusion.config import Tuning
    c = packed_case(groups, lone, G, kind, seed, D=D)
    spared = sum((len(lens) - 1) * shared for shared, lens in groups)
    too_few = Tuning(min_shared_pages=2, min_spared_pages=spared + 1)     # too little to pack
    assert packing.plan_packed(c["lens"].cpu(), c["bt"].cpu(), c["q"].shape[1], 2, too_few, pack_heads) is None
    plan = packing.plan_packed(c["lens"].cpu(), c["bt"].cpu(), c["q"].shape[1], 2,
                               Tuning(min_shared_pages=2, min_spared_pages=0), pack_heads)
    assert plan is not None and plan.rows.shape[1] == pack_heads // G
    plan = plan.to(c["q"].device)
    tag = f"(seed {seed}, {groups}, {lone}, G {G}, {kw})"
    outs = {}
    for name, fn, arena, loc in (("compressed", decode_attention, c["arena_c"], c["loc_c"]),
                                 ("open", decode_attention, c["arena_o"], c["loc_o"]),
                                 ("uncompressed", decode_attention_uncompressed, c["arena_o"], c["loc_o"])):
        outs[name] = plan.run(_Decode(c, fn, arena, loc, **kw), 0, c["q"], c["layout"].num_kv_heads)
    args = (c["bt"], c["lens"], c["layout"], c["scale"])
    plain = decode_attention(c["q"], c["arena_c"], c["loc_c"], *args, **kw)
    ref = reference_decode_attention(c["q"], c["arena_o"], c["loc_o"], *args, out_dtype=torch.float64)
    got = outs["compressed"]
    assert torch.isfinite(got.float()).all(), f"NaN/inf past a slot's end leaked {tag}"
    for b in range(got.shape[0]):
        rel = float((got[b].double() - ref[b]).norm() / ref[b].norm())
        assert rel < 1e-2, f"row {b}: relative error {rel:.3g} vs float64 {tag}"
        # another summation order: within 2 bf16 ulps of the row's largest value (head_dim 256
        # rows reach 13 on mixed data, where one ulp is 0.0625)
        bound = max(2e-2, float(plain[b].double().abs().max()) / 64)
        assert float((got[b].double() - plain[b].double()).abs().max()) <= bound, f"row {b} vs plain {tag}"
    assert same_bits(got, outs["open"]), f"compressed and open pages give different bits {tag}"
    assert same_bits(got, outs["uncompressed"]), f"fused and uncompressed kernels give different bits {tag}"
    # the same plan in a CUDA graph's buffers: more requests (padding, no keys), wider tables,
    # filled after a larger step's plan (its rows, lengths and spans must not leak)
    V, R = plan.rows.shape
    B, W = got.shape[0], 2 * plan.block_table.shape[1] + 5
    bufs = packing.PackedPlan.empty(V + 3, R, W, B, device=c["q"].device)
    gen = torch.Generator().manual_seed(seed)
    larger = packing.PackedPlan(torch.randint(0, B, (V + 3, R), generator=gen),
                                torch.randint(0, 1 << 20, (V + 3, W), generator=gen, dtype=torch.int32),
                                torch.full((V + 3,), 16 * W, dtype=torch.int32),
                                torch.randint(0, 16 * W, (V + 3, R, 2), generator=gen, dtype=torch.int32),
                                torch.randint(0, (V + 3) * R, (B,), generator=gen))
    bufs.fill(larger)
    bufs.fill(plan.to("cpu"))
    assert bufs.context_lens[V:].eq(0).all() and bufs.rows[V:].eq(0).all() and bufs.spans[V:].eq(0).all(), \
        f"a larger plan leaked {tag}"
    padded = bufs.run(_Decode(c, decode_attention, c["arena_c"], c["loc_c"], **kw), 0, c["q"], c["layout"].num_kv_heads)
    if c["q"].device.type == "cpu" or kw.get("num_splits") == 1:     # the same splits: the same bits
        assert same_bits(padded, got), f"padded packed plan {tag}"
    assert float((padded.double() - got.double()).abs().max()) < 2e-2, f"padded packed plan {tag}"
    return plan


@pytest.mark.parametrize("groups,lone,G,kind,pack_heads", PACKED[:2])
def test_packed_requests(groups, lone, G, kind, pack_heads, seed):
    plan = check_packed(groups, lone, G, kind, pack_heads, seed)
    if G == 4:               # rows 0, 1 paired behind 2 pages; rows 2 and 3 alone
        assert plan.rows.tolist() == [[0, 1], [2, 0], [3, 0]]
        assert plan.spans.tolist() == [[[32, 40], [48, 69]], [[0, 69], [0, 0]], [[0, 5], [0, 0]]]
        assert plan.context_lens.tolist() == [69, 69, 5] and plan.slots.tolist() == [0, 1, 2, 4]


def test_packed_request_slots_without_keys_output_zero(monkeypatch):
    """An empty slot of a lone row's request attends nothing: zeros, not NaN (the kernel's
    -inf guards), on either route."""
    c = packed_case([], [20], 4, "mixed", 2, H=1)
    spans = torch.tensor([[[0, 20], [0, 0]]], dtype=torch.int32, device=c["q"].device)
    q = torch.cat([c["q"], c["q"]], 1)                        # two slots of 4 heads
    out = decode_attention(q, c["arena_c"], c["loc_c"], c["bt"], c["lens"], c["layout"], c["scale"],
                           spans=spans, slot_heads=4)
    assert torch.equal(out[:, 4:], torch.zeros_like(out[:, 4:]))
    plain = decode_attention(c["q"], c["arena_c"], c["loc_c"], c["bt"], c["lens"], c["layout"], c["scale"])
    assert float((out[:, :4].double() - plain.double()).abs().max()) < 2e-2


def test_packed_request_arguments(small):
    c = small
    sp = torch.tensor([[[0, 20], [0, 0]], [[0, 7], [0, 0]]], dtype=torch.int32, device=c["q"].device)
    q = torch.cat([c["q"], c["q"]], 1)
    with pytest.raises(ValueError, match="slot_heads must be a positive int dividing the GQA group of 8"):
        _call(c, q=q, spans=sp, slot_heads=3)
    with pytest.raises(TypeError, match=r"spans must be a contiguous torch.int32 \[2, 2, 2\]"):
        _call(c, q=q, spans=sp.to(torch.int64), slot_heads=4)
    with pytest.raises(ValueError, match="spans of packed request 1 .* begin at a page boundary"):
        _call(c, q=q, spans=torch.tensor([[[0, 20], [0, 0]], [[3, 7], [0, 0]]], dtype=torch.int32,
                                         device=c["q"].device), slot_heads=4)
    with pytest.raises(ValueError, match="end within the context"):
        _call(c, q=q, spans=torch.tensor([[[0, 21], [0, 0]], [[0, 7], [0, 0]]], dtype=torch.int32,
                                         device=c["q"].device), slot_heads=4)


@gpu
@pytest.mark.parametrize("groups,lone,G,kind,pack_heads", PACKED)
@pytest.mark.parametrize("kw", [dict(), dict(num_splits=1), dict(num_splits=5), dict(stages=3, tma=False),
                                dict(stages=4, tma=True, num_splits=3), dict(producer=True),
                                dict(producer=True, num_splits=3)])
def test_packed_requests_cuda_kernel(groups, lone, G, kind, pack_heads, kw, seed):
    check_packed(groups, lone, G, kind, pack_heads, seed, backend="cuda", **kw)


@gpu
@pytest.mark.parametrize("D", [64, 256])
@pytest.mark.parametrize("groups,lone,G,kind,pack_heads", PACKED)
@pytest.mark.parametrize("kw", [dict(), dict(num_splits=5), dict(stages=3, tma=False), dict(producer=True)])
def test_packed_requests_cuda_kernel_head_dims(groups, lone, G, kind, pack_heads, kw, D, seed):
    """Packed requests at head_dim 64 and 256 (pack_heads 16 at 256: two CTAs of 8 query heads
    per KV head, each with its own slots' spans)."""
    check_packed(groups, lone, G, kind, pack_heads, seed, D=D, backend="cuda", **kw)


def test_packed_launches_in_cuda_graphs_only_where_the_cuda_kernel_serves_them(monkeypatch, environ):
    """A packed launch is captured in a CUDA graph only where the CUDA kernel reads the spans
    itself; the Triton route plans each slot's row on the host (``packed_rows``), which a graph
    cannot hold (the engine's packed graphs failed capture on a head_dim-64 model on the H100)."""
    from zipfusion.kernels import cuda_attention
    from zipfusion.kernels.decode_attention import uses_cuda_kernel
    layout = PageLayout(2, 128)
    environ(ZIPFUSION_DECODE_KERNEL=None)
    assert not uses_cuda_kernel(None, "cpu", layout, 4)           # the CPU: no CUDA kernel
    monkeypatch.setattr(cuda_attention, "unsupported_reason", lambda device, head_dim, G: None)
    assert uses_cuda_kernel(None, "cpu", layout, 4)               # as where the kernel applies
    environ(ZIPFUSION_DECODE_KERNEL="triton")
    assert not uses_cuda_kernel(None, "cpu", layout, 4)           # the Triton route forced
