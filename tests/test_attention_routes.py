"""Each attention route object (attention/decode.py, prefill_open.py,
prefill_stored.py) run directly over an engine's pages -- full pages compressed or
left open, each request's last page open -- against the float64 torch reference
(zipfusion.testing). The CPU runs the kernels through the Triton interpreter; which route the
backend picks for which config is checked at the end."""

import pytest
import torch

pytest.importorskip("transformers")

from zipfusion.engine import LLM, SamplingParams  # noqa: E402
from zipfusion.attention.backend import AttentionBackend, ChunkView  # noqa: E402
from zipfusion.attention.decode import FlashInferPagedDecode, KernelDecode, TorchDecode  # noqa: E402
from zipfusion.attention.prefill_open import OpenPrefill  # noqa: E402
from zipfusion.attention.prefill_stored import GatherPrefill, RowsPrefill, page_reader  # noqa: E402
from zipfusion.testing import reference_decode_attention, reference_prefill_attention  # noqa: E402
from helpers import save_tiny_checkpoint  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LENGTHS = (70, 40, 5)                  # prompt tokens of the three requests whose pages are read
SCALE = 0.125                          # head_dim 64


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_checkpoint(path, num_hidden_layers=1, max_position_embeddings=2048)
    return path


@pytest.fixture(scope="module", params=[True, False], ids=["compressed", "open"])
def engine(request, ckpt):
    """An engine whose three prompts are prefilled, their full pages sealed (compressed
    pages, or open ones without kv_compression)."""
    llm = LLM(str(ckpt), dtype="bfloat16", device=DEVICE, kv_memory_gb=0.03, attention_backend="kernel",
              kv_compression=request.param, enable_prefix_caching=False)
    eng = llm.engine
    g = torch.Generator().manual_seed(3)
    reqs = [eng.add_request(torch.randint(3, 256, (n,), generator=g).tolist(),
                            SamplingParams(temperature=0, max_tokens=3)) for n in LENGTHS]
    eng.step()
    eng.scheduler.seal_now()
    assert (eng.cache.manager.page_state(reqs[0].pages[0]) == "stored") == request.param
    return eng, [r.pages for r in reqs]


def _q(n, seed):
    return torch.randn(n, 4, 64, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).to(DEVICE)


def _close(got, ref):
    rel = float((got.double() - ref).norm() / ref.norm())
    assert rel < 1e-2, f"relative error {rel:.3g} vs float64"


def _prefill_reference(eng, q, chunks):
    """float64 causal attention of each (offset, chunk)'s rows of q to its request's pages."""
    c = eng.cache
    W = max(len(ch.used_pages) for _, ch in chunks)
    table = torch.zeros(len(chunks), W, dtype=torch.int32)
    for j, (_, ch) in enumerate(chunks):
        table[j, :len(ch.used_pages)] = torch.tensor(ch.used_pages, dtype=torch.int32)
    rows = torch.cat([torch.arange(off, off + ch.length) for off, ch in chunks])
    indptr = torch.tensor([0] + [ch.length for _, ch in chunks]).cumsum(0).to(torch.int32)
    start = torch.tensor([ch.start for _, ch in chunks], dtype=torch.int32)
    ref = reference_prefill_attention(q[rows], c.arena, c.page_loc[0], table.to(DEVICE), indptr.to(DEVICE),
                                      start.to(DEVICE), c.layout, SCALE, out_dtype=torch.float64)
    return rows, ref


def _run(route, eng, chunks, q, k=None, v=None):
    out = torch.full_like(q, float("nan"))
    route.run(0, q, k, v, out, route.plan(chunks, q.device))
    return out


def _decode_routes(eng):
    c, compressed = eng.cache, eng.cache.kv_compression
    return {"kernel": KernelDecode(c, SCALE, compressed=compressed),
            "kernel, deterministic": KernelDecode(c, SCALE, compressed=compressed, deterministic=True),
            "torch": TorchDecode(c, SCALE), "torch, exact": TorchDecode(c, SCALE, exact=True)}


def test_decode_routes(engine):
    eng, pages = engine
    c = eng.cache
    lens = torch.tensor([70, 33, 5, 1], dtype=torch.int32)
    table = torch.zeros(4, 5, dtype=torch.int32)
    for i, p in enumerate(pages + [pages[2]]):
        table[i, :len(p)] = torch.tensor(p, dtype=torch.int32)
    lens, table, q = lens.to(DEVICE), table.to(DEVICE), _q(4, 0)
    ref = reference_decode_attention(q, c.arena, c.page_loc[0], table, lens, c.layout, SCALE,
                                     out_dtype=torch.float64)
    for name, route in _decode_routes(eng).items():
        route.prepare(lens.cpu(), table.cpu())
        _close(route(0, q, table, lens), ref)


def test_prefill_over_open_pages(engine):
    """A prompt over its own K/V (here read back from its pages: what the step stored)."""
    eng, pages = engine
    chunks = [(3, ChunkView(0, 70, pages[0])), (73, ChunkView(0, 40, pages[1]))]
    q = _q(113, 1)
    k = torch.empty(113, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    v = torch.empty_like(k)
    for off, ch in chunks:
        k[off:off + ch.length], v[off:off + ch.length] = eng.cache.read_tokens(0, ch.pages, ch.length)
    out = _run(OpenPrefill(SCALE), eng, chunks, q, k, v)
    rows, ref = _prefill_reference(eng, q, chunks)
    _close(out[rows], ref)
    assert out[:3].isnan().all()                       # rows of no chunk are left alone


# continuations (and whole prompts: deterministic mode) over their requests' pages:
# (first row in q, request, start, length); the first is long (an open copy's, a restored one's)
STORED = [(0, 0, 50, 17), (17, 1, 36, 4), (21, 2, 0, 3), (24, 0, 67, 3)]


def _stored_routes(eng):
    c, compressed = eng.cache, eng.cache.kv_compression
    kernel = KernelDecode(c, SCALE, compressed=compressed, deterministic=True)
    kernel_read, torch_read = page_reader(c, True, compressed), page_reader(c, False, compressed)
    return {"rows, kernel": RowsPrefill(kernel),
            "rows, kernel, open copy": RowsPrefill(kernel, kernel_read),
            "rows, torch": RowsPrefill(TorchDecode(c, SCALE, exact=True)),
            "gather, kernel rows": GatherPrefill(kernel_read, SCALE, RowsPrefill(kernel)),
            "gather, torch": GatherPrefill(torch_read, SCALE)}


def test_prefill_over_stored_pages(engine):
    eng, pages = engine
    chunks = [(off, ChunkView(start, n, pages[r])) for off, r, start, n in STORED]
    q = _q(27, 2)
    rows, ref = _prefill_reference(eng, q, chunks)
    outs = {}
    for name, route in _stored_routes(eng).items():
        outs[name] = _run(route, eng, chunks, q)
        _close(outs[name][rows], ref)
    # rows over an open copy: the fused kernel's bits on the pages themselves
    assert torch.equal(outs["rows, kernel"].view(torch.int16), outs["rows, kernel, open copy"].view(torch.int16))


def test_the_backend_picks_its_routes_once_from_the_config(engine):
    eng, _ = engine
    c = eng.cache
    kw = dict(kv_compression=c.kv_compression, num_qo_heads=4, sm_scale=SCALE)
    kernel = AttentionBackend(c, "kernel", **kw)
    assert isinstance(kernel.decode, KernelDecode) and not kernel.decode.split
    assert isinstance(kernel.prefill_open, OpenPrefill)
    assert isinstance(kernel.prefill_stored, GatherPrefill) and isinstance(kernel.prefill_stored.rows, RowsPrefill)
    torch_ = AttentionBackend(c, "torch", **kw)
    assert isinstance(torch_.decode, TorchDecode) and torch_.prefill_stored.rows is None
    assert not torch_.graph_safe and kernel.graph_safe
    det = AttentionBackend(c, "kernel", deterministic=True, **kw)
    assert det.prefill_open is det.prefill_stored and isinstance(det.prefill_open, RowsPrefill)
    assert det.decode.split and (det.prefill_open.read is not None) == c.kv_compression   # copies of stored pages
    assert isinstance(AttentionBackend(c, "torch", deterministic=True, **kw).prefill_open.decode, TorchDecode)
    assert AttentionBackend(c, "auto", **kw).kind == ("kernel" if DEVICE == "cuda" else "torch")
    if DEVICE == "cuda" and not c.kv_compression:
        pytest.importorskip("flashinfer")
        assert isinstance(AttentionBackend(c, "flashinfer", **kw).decode, FlashInferPagedDecode)
