"""Paged prefill attention: fused (compressed pages) vs twin (open pages) vs float64 reference.

CPU tests run the Triton kernel under the interpreter (tests/conftest.py) at tiny shapes; the
tests marked gpu run the compiled kernel at the benchmark's shapes. Every draw is seeded.
"""

import pytest
import torch

from helpers import (adversarial_escape_blocks, build_arena, escape_pattern_blocks,
                     pages_from_block_bits)
from zipfusion.analysis.synthetic import model_like_pages, realistic_pages
from zipfusion.format import PageLayout
from zipfusion.format.layout import RAW_MARK
from zipfusion.format.reference import analyze_pages
from zipfusion.kernels import paged_prefill_attention, plan_prefill
from zipfusion.kernels.prefill_attention import gather_kv
from zipfusion.testing import reference_prefill_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu


def adversarial(pages, gen):
    """Pages with values the format must keep bit for bit: exponent outliers that force raw
    blocks, exact ±0 runs, subnormals, huge and tiny normals (no NaN, no inf)."""
    pages = pages.clone()
    P = pages.shape[0]
    flat = pages.view(P, -1)
    n = flat.shape[1]
    special = torch.tensor([0.0, -0.0, 1e-40, -3e-39, 2 ** -126, 2 ** 12, -2 ** 14, 1e-30],
                           dtype=torch.bfloat16)
    for p in range(0, P, 2):                                     # every other page
        idx = torch.randint(0, n, (n // 50,), generator=gen)
        flat[p, idx] = special[torch.randint(0, len(special), (len(idx),), generator=gen)]
        pages[p, 1, int(torch.randint(0, 16, (1,), generator=gen))] = 0     # a zero V row
    return pages


def make_case(chunks, H, G, D, seed, kind="mixed", device=DEVICE):
    """Chunks (start, length) of requests whose pages hold K/V up to each chunk's end.

    ``arena_c``: full pages compressed (~1/4 left open), the last partial page open (with NaN
    past the end); ``arena_o``: the same values, every page open. Pages in random order with
    random gaps, page ids shuffled, unused table entries random ids.
    """
    gen = torch.Generator().manual_seed(seed)
    n_pages = [-(-(s + n) // 16) for s, n in chunks]
    P = sum(n_pages) + 2
    pages = realistic_pages(P, H, D, seed=seed)
    if kind == "escapes":                         # format v2: blocks with 1-4 escapes, raw, plain
        pages = model_like_pages(P, H, D, seed=seed, counts={"K": (0.25, 0.1, 0.05, 0.05, 0.1),
                                                             "V": (0.2, 0.1, 0.05, 0.05, 0.1)})
    if kind == "adversarial":
        pages = adversarial(pages, gen)
    ids = torch.randperm(P, generator=gen)
    bt = torch.randint(0, P, (len(chunks), max(n_pages) + 1), generator=gen, dtype=torch.int32)
    comp = torch.rand(P, generator=gen) > 0.25
    k = 0
    for c, ((s, n), m) in enumerate(zip(chunks, n_pages)):
        bt[c, :m] = ids[k:k + m].to(torch.int32)
        if (s + n) % 16:                          # the last, partial page: open, NaN past the end
            comp[ids[k + m - 1]] = False
            pages[ids[k + m - 1], :, (s + n) % 16:] = float("nan")
        k += m
    arena_c, loc_c = build_arena(pages, comp, seed=seed + 1, device=device)
    arena_o, loc_o = build_arena(pages, torch.zeros(P, dtype=torch.bool), seed=seed + 2,
                                 device=device)
    lens = [n for _, n in chunks]
    indptr = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(lens), H * G, D, generator=gen).to(torch.bfloat16)
    return dict(q=q.to(device), arena_c=arena_c, loc_c=loc_c, arena_o=arena_o, loc_o=loc_o,
                bt=bt.to(device), indptr=indptr.to(device),
                start=torch.tensor([s for s, _ in chunks], dtype=torch.int32, device=device),
                layout=PageLayout(H, D), scale=D ** -0.5, seed=seed, comp=comp, pages=pages)


def same_bits(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def run(c, compressed=True, open_pages=False, **kw):
    arena, loc = (c["arena_o"], c["loc_o"]) if open_pages or not compressed \
        else (c["arena_c"], c["loc_c"])
    out = torch.full_like(c["q"], float("nan"))
    return paged_prefill_attention(c["q"], arena, loc, c["bt"], c["indptr"], c["start"],
                                   c["layout"], c["scale"], out, compressed=compressed, **kw)


def check_case(c, open_pages=False, **kw):
    """Close to float64; fused on compressed pages == twin (== fused on open pages, where
    ``open_pages``), bit for bit."""
    tag = f"(seed {c['seed']}, {kw})"
    out = run(c, **kw)
    assert torch.isfinite(out.float()).all(), f"some outputs not written or not finite {tag}"
    ref = reference_prefill_attention(c["q"], c["arena_o"], c["loc_o"], c["bt"], c["indptr"],
                                      c["start"], c["layout"], c["scale"],
                                      out_dtype=torch.float64)
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, f"relative error {rel:.3g} vs float64 reference {tag}"
    assert same_bits(out, run(c, compressed=False, **kw)), f"fused and twin differ {tag}"
    if open_pages:
        assert same_bits(out, run(c, open_pages=True, **kw)), f"open/compressed differ {tag}"
    return out


# chunks (start, length): starts not multiples of 16, a chunk of one token, a fresh prompt
CHUNKS = [(0, 21), (37, 6), (19, 1)]


@pytest.mark.parametrize("G,block_m,tp", [(1, 16, 1), (2, 32, 2), (4, 32, 1), (8, 64, 2)])
def test_against_reference_and_twin_d64(G, block_m, tp, seed):
    """Several query tiles per chunk (block_m / G tokens each), K/V tiles of 1 and 2 pages."""
    check_case(make_case(CHUNKS, 2, G, 64, seed), block_m=block_m, tile_pages=tp)


def test_against_reference_and_twin_d128(seed):
    check_case(make_case([(3, 30), (16, 1)], 2, 4, 128, seed), tile_pages=2, block_m=64)


def test_escapes_against_reference_and_twin(seed):
    """Format v2 pages: blocks with escapes, raw blocks and plain ones in every page."""
    c = make_case(CHUNKS, 2, 4, 64, seed, kind="escapes")
    base = analyze_pages(c["pages"][c["comp"]].nan_to_num())
    assert ((base & 0x80 != 0) & (base != RAW_MARK)).any() and (base == RAW_MARK).any()
    check_case(c, block_m=32, tile_pages=2, open_pages=True)


def test_gather_restores_escape_patterns():
    """The attention kernels' restore (gather_kv) gives back every pattern as an escape (all
    65,536 on the GPU, a seeded sixteenth under the interpreter), NaN and inf included, and
    the 4/5-outlier blocks, bit for bit, from compressed pages."""
    blocks = escape_pattern_blocks()
    if DEVICE == "cpu":
        blocks = blocks[torch.randperm(blocks.shape[0], generator=torch.Generator().manual_seed(9))[:1024]]
    pages = pages_from_block_bits(torch.cat([blocks, adversarial_escape_blocks()]), 2, 128)
    P = pages.shape[0]
    arena, loc = build_arena(pages, torch.ones(P, dtype=torch.bool), seed=3, device=DEVICE)
    order = torch.randperm(P, generator=torch.Generator().manual_seed(4))
    k, v = gather_kv(arena, loc, order.to(torch.int32).to(DEVICE), 16 * P, PageLayout(2, 128),
                     compressed=True)
    assert same_bits(k.cpu(), pages[order, 0].reshape(-1, 2, 128))
    assert same_bits(v.cpu(), pages[order, 1].reshape(-1, 2, 128))


def test_adversarial_pages_bit_identical_to_twin():
    """Outliers (raw blocks), ±0, subnormals and huge/tiny normals in compressed, raw-block
    and open pages; NaN past the end of the open last pages: finite, and twin's bits."""
    c = make_case([(2, 29), (50, 3)], 2, 4, 64, 17, kind="adversarial")
    base = analyze_pages(c["pages"][c["comp"]].nan_to_num())        # compressed pages' blocks
    assert (base == RAW_MARK).any() and (base != RAW_MARK).any() and (~c["comp"]).any()
    check_case(c, open_pages=True, block_m=32)


def test_rows_do_not_depend_on_the_other_chunks(seed):
    """A chunk's rows have the same bits alone and in any place of a launch, through a plan
    made from host lists (no device sync), as every layer of a step reuses it."""
    c = make_case([(9, 14), (0, 3), (33, 7)], 2, 4, 64, seed)
    full = run(c, block_m=16)
    rows = [(0, 14), (14, 17), (17, 24)]
    for order in ([1], [2, 0, 1]):
        sub = dict(c)
        sub["q"] = torch.cat([c["q"][rows[i][0]:rows[i][1]] for i in order])
        sub["bt"] = c["bt"][order].contiguous()
        lens = [rows[i][1] - rows[i][0] for i in order]
        sub["indptr"] = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(),
                                     dtype=torch.int32, device=DEVICE)
        starts = [int(c["start"][i]) for i in order]
        sub["start"] = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
        plan = plan_prefill(sub["indptr"].tolist(), starts, 8, 2, block_m=16, device=DEVICE)
        out = run(sub, plan=plan)
        at = 0
        for i, n in zip(order, lens):
            assert same_bits(out[at:at + n], full[rows[i][0]:rows[i][1]]), \
                f"chunk {i} in launch {order} (seed {c['seed']})"
            at += n


def _reference_ended(c, kv_end):
    """float64 attention of each row to keys 0 .. min(its position, kv_end - 1), and the
    log2-sum-exp of its scores x scale·log2(e) (the kernel's ``lse``)."""
    outs, lses = [], []
    q, starts, indptr = c["q"].double(), c["start"].tolist(), c["indptr"].tolist()
    H = c["layout"].num_kv_heads
    for j, e in enumerate(kv_end):
        k, v = gather_kv(c["arena_o"], c["loc_o"], c["bt"][j], e, c["layout"], compressed=False)
        k, v = k.double(), v.double()
        for i in range(indptr[j + 1] - indptr[j]):
            pos = min(starts[j] + i, e - 1)
            qr = q[indptr[j] + i].view(H, -1, q.shape[-1])                      # [H, G, D]
            s = torch.einsum("hgd,thd->hgt", qr, k[:pos + 1]) * c["scale"]
            outs.append(torch.einsum("hgt,thd->hgd", s.softmax(-1), v[:pos + 1]).reshape(-1, q.shape[-1]))
            lses.append((torch.logsumexp(s, -1) / 0.6931471805599453).reshape(-1))
    return torch.stack(outs), torch.stack(lses)


def test_ended_chunks_and_lse(seed):
    """``kv_end`` ends a chunk's keys early (a piece of a longer context: q_start = kv_end - 1, every
    row sees the same keys; or part way through a chunk); fp32 ``out`` and ``lse`` match float64,
    and fused (compressed pages) and twin give the same bits for both."""
    c = make_case([(47, 5), (20, 12), (0, 3)], 2, 4, 64, seed)
    kv_end = [48, 26, 3]                     # all rows at 47; rows 6.. clamped at 25; causal
    plan = plan_prefill(c["indptr"].tolist(), c["start"].tolist(), 8, 2, block_m=16, device=DEVICE,
                        kv_end=kv_end)
    res = []
    for compressed in (True, False):
        arena, loc = (c["arena_c"], c["loc_c"]) if compressed else (c["arena_o"], c["loc_o"])
        out = torch.full(c["q"].shape, float("nan"), device=DEVICE)
        lse = torch.full(c["q"].shape[:2], float("nan"), device=DEVICE)
        paged_prefill_attention(c["q"], arena, loc, c["bt"], c["indptr"], c["start"], c["layout"],
                                c["scale"], out, compressed=compressed, plan=plan, lse=lse)
        res.append((out, lse))
    (out, lse), (out_t, lse_t) = res
    assert torch.equal(out, out_t) and torch.equal(lse, lse_t), "fused and twin differ"
    ref_o, ref_lse = _reference_ended(c, kv_end)
    assert ((out.double() - ref_o).norm() / ref_o.norm()) < 1e-2
    assert (lse.double() - ref_lse).abs().max() < 1e-3
    with pytest.raises(ValueError, match="kv_end"):
        plan_prefill([0, 5], [47], 8, 2, kv_end=[47])


def test_plan_covers_every_row_once_heaviest_first():
    plan = plan_prefill([0, 5, 40, 41], [100, 0, 7], 8, 2, block_m=32)
    assert plan.block_tokens == 8 and plan.group_pad == 4
    items = plan.items.tolist()
    assert sorted(items) == [[0, 0], [1, 0], [1, 8], [1, 16], [1, 24], [1, 32], [2, 0]]
    assert items[0] == [0, 0]                              # ends at position 104
    g3 = plan_prefill([0, 3], [0], 6, 2, block_m=8)        # group 3 -> 4; tiles >= 16 rows
    assert g3.group_pad == 4 and g3.block_tokens == 4


# ------------------------------------------------------------------------------------------
# Bad input: one-line errors
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small():
    c = make_case([(10, 30), (0, 2)], 1, 2, 64, 5)
    assert c["comp"][c["bt"][0, :2].long().cpu()].any(), "the case needs a compressed page"
    return c


def _call(c, **over):
    a = dict(q=c["q"], arena=c["arena_c"], page_loc_layer=c["loc_c"], block_table=c["bt"],
             q_indptr=c["indptr"], q_start=c["start"], layout=c["layout"], sm_scale=c["scale"],
             compressed=True)
    a.update(over)
    return paged_prefill_attention(**a)


@pytest.mark.parametrize("over,err,match", [
    (lambda c: dict(q=c["q"].float()), TypeError, "bfloat16"),
    (lambda c: dict(q=c["q"][:, :, :32]), ValueError, "num_q_heads"),
    (lambda c: dict(arena=c["arena_c"].view(torch.int8)), TypeError, "uint8"),
    (lambda c: dict(page_loc_layer=c["loc_c"].int()), TypeError, "int64"),
    (lambda c: dict(block_table=c["bt"].long()), TypeError, "block_table"),
    (lambda c: dict(block_table=c["bt"][:1]), TypeError, "num_chunks=2"),
    (lambda c: dict(q_start=c["start"].long()), TypeError, "q_start"),
    (lambda c: dict(q_indptr=c["indptr"][:2]), TypeError, "q_indptr"),
    (lambda c: dict(q_indptr=torch.tensor([0, 5, 5], dtype=torch.int32, device=c["q"].device)), ValueError,
     "at least one query row"),
    (lambda c: dict(q_start=torch.tensor([-1, 0], dtype=torch.int32, device=c["q"].device)), ValueError, "q_start"),
    (lambda c: dict(q=c["q"][:4]), ValueError, "32 query rows"),
    (lambda c: dict(sm_scale=0.0), ValueError, "sm_scale"),
    (lambda c: dict(out=torch.empty(32, 2, 32, dtype=torch.bfloat16, device=c["q"].device)), ValueError, "out must"),
    (lambda c: dict(layout=(1, 64)), TypeError, "PageLayout"),
    (lambda c: dict(q=c["q"].to("meta")), ValueError, "on meta"),
    (lambda c: dict(tile_pages=3), ValueError, "tile_pages"),
    (lambda c: dict(block_m=24), ValueError, "block_m"),
    (lambda c: dict(q_start=torch.tensor([60, 0], dtype=torch.int32, device=c["q"].device)), ValueError,
     "past the 4 pages"),
    (lambda c: dict(compressed=False), ValueError, "open pages only"),
])
def test_bad_inputs(small, over, err, match):
    with pytest.raises(err, match=match) as e:
        _call(small, **over(small))
    assert "\n" not in str(e.value)


def test_bad_plan_and_ids(small):
    c = small
    with pytest.raises(ValueError, match="plan is for 1 chunks"):
        _call(c, plan=plan_prefill([0, 30], [10], 2, 1))
    with pytest.raises(ValueError, match="differs from the plan"):
        _call(c, plan=plan_prefill([0, 30, 32], [10, 0], 2, 1, block_m=32), block_m=64)
    loc = c["loc_c"].clone()
    loc[c["bt"][1, 0].long()] = -1
    with pytest.raises(ValueError, match="no page"):
        _call(c, page_loc_layer=loc)


# ------------------------------------------------------------------------------------------
# GPU: the compiled kernel at real shapes
# ------------------------------------------------------------------------------------------

@gpu
@pytest.mark.parametrize("kw", [{}, dict(block_m=64, tile_pages=8, num_warps=4, num_stages=3),
                                dict(block_m=128, tile_pages=4, num_warps=8, num_stages=1)])
@pytest.mark.parametrize("G", [1, 4, 8])
def test_gpu_real_shapes(G, kw, seed):
    c = make_case([(0, 700), (3001, 257), (37, 1), (1024, 16), (515, 129)], 8, G, 128, seed)
    check_case(c, **kw)


@gpu
def test_gpu_adversarial():
    check_case(make_case([(3, 500), (1000, 77)], 8, 4, 128, 23, kind="adversarial"))


def test_benchmark_cpu_smoke(tmp_path, monkeypatch):
    """benchmarks/prefill_attention.py end to end at its tiny CPU shapes: fused == twin bits,
    close to SDPA, a JSON record per kernel and case."""
    import importlib.util
    import json
    import sys
    from pathlib import Path
    path = Path(__file__).parents[1] / "benchmarks" / "prefill_attention.py"
    monkeypatch.syspath_prepend(str(path.parent))
    spec = importlib.util.spec_from_file_location("bench_prefill_attention", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(sys, "argv", ["x", "--cpu-smoke", "--block-m", "32", "--tile-pages",
                                      "4", "--out", str(tmp_path)])
    bench.main()
    recs = json.loads((tmp_path / "prefill_attention.json").read_text())["records"]
    gathered = [r for r in recs if r["kernel"].startswith("gather_")]
    recs = [r for r in recs if not r["kernel"].startswith("gather_")]
    assert {(r["kernel"], r["start"]) for r in recs} == \
        {(k, s) for k in ("fused", "twin", "sdpa_math") for s in bench.SMOKE["starts"]}
    assert all(r["fused_equals_twin"] and r["rel_err_vs_sdpa"] < 2e-2 for r in recs)
    # the engine's restore before its dense route, over compressed and open pages: the same bits
    assert {(r["kernel"], r["start"]) for r in gathered} == \
        {(k, s) for k in ("gather_compressed", "gather_open") for s in bench.SMOKE["starts"] if s > 0}
    assert all(r["fused_equals_twin"] and r["gb_s"] > 0 for r in gathered)
