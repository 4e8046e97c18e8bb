"""The engine's kernel path (merged rope + store, decode kernels over the arena) at tiny size:
compiled on a GPU, through the Triton interpreter on the CPU (tests/conftest.py chooses). The
plumbing (page_loc, block tables, scratch padding, fused vs twin) is the one the GPU uses."""

import pytest
import torch

pytest.importorskip("transformers")

from zipfusion.config import Tuning  # noqa: E402
from zipfusion.engine import LLM, SamplingParams  # noqa: E402
from zipfusion.testing import run_to_completion  # noqa: E402
from helpers import save_tiny_checkpoint  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_checkpoint(path, num_hidden_layers=1, max_position_embeddings=2048)
    return path


def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (40, 5, 17)]


def test_kernel_attention_matches_reference_on_engine_pages(ckpt):
    from zipfusion.testing import reference_decode_attention
    llm = LLM(str(ckpt), dtype="bfloat16", device=DEVICE, kv_memory_gb=0.03, attention_backend="kernel")
    eng = llm.engine
    reqs = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=3)) for p in prompts()]
    eng.step()                                                      # prefill
    eng.scheduler.seal_now()                   # full pages compressed now
    assert eng.cache.manager.page_state(reqs[0].pages[0]) == "stored"
    b = eng.runner.decode_inputs(reqs, 4)                          # one padding row
    q = torch.randn(4, 4, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).to(DEVICE)
    lens = b["context_lens"] - 1                                    # tokens already written
    lens[3] = 1
    lens, table = lens.to(DEVICE), b["block_table"].to(DEVICE)
    assert eng.attention.sm_scale == 0.125
    got = eng.attention.decode(0, q, table, lens).cpu()
    ref = reference_decode_attention(q, eng.cache.arena, eng.cache.page_loc[0], table, lens,
                                     eng.cache.layout, 0.125, out_dtype=torch.float64).cpu()
    assert float((got.double() - ref)[:3].norm() / ref[:3].norm()) < 1e-2


@pytest.mark.parametrize("budget,lengths", [
    (8192, (40, 5, 17)),                  # whole prompts
    (32, (70, 5, 33)),                    # later chunks attend to their pages: restored + SDPA, decode rows
    pytest.param(700, (1500, 40), marks=pytest.mark.gpu),   # long later chunks: pages restored + SDPA
])
def test_fused_compressed_equals_twin_uncompressed_through_the_engine(ckpt, budget, lengths):
    """Compressed (fused kernels) and uncompressed (twins) give the same bits, prefill chunks
    included; and the kernels' logits are those of torch attention up to bf16 rounding."""
    res = {}
    g = torch.Generator().manual_seed(2)
    ps = [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]
    for name, kw in (("fused", dict(kv_compression=True, attention_backend="kernel")),
                     ("twin", dict(kv_compression=False, attention_backend="kernel")),
                     ("torch", dict(kv_compression=True, attention_backend="torch"))):
        llm = LLM(str(ckpt), dtype="bfloat16", device=DEVICE, kv_memory_gb=0.03, max_num_batched_tokens=budget,
                  max_model_len=2048, **kw)
        eng = llm.engine
        reqs = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)) for p in ps]
        run_to_completion(eng, reqs, keep_logits=True)
        res[name] = reqs
    for a, b, t in zip(res["fused"], res["twin"], res["torch"]):
        assert a.output_ids == b.output_ids
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
        x, y = a.logits[0].double(), t.logits[0].double()
        assert float((x - y).norm() / y.norm()) < 2e-2


@pytest.mark.parametrize("streams", [1, None])
def test_seals_around_each_forward_keep_compressed_and_uncompressed_identical(ckpt, streams):
    """Each step seals the pages earlier steps filled behind its own forward (the earlier
    analysis placed, compacted and encoded while it runs, the pages it filled analysed, the
    tokens read after): under memory pressure, with many seals during decode, compressed and
    uncompressed runs give the same tokens and the same logits bits (deterministic mode, whose
    rows do not depend on the batch). One fill stream: requests finishing apart leave holes that
    compaction fills; the default streams (by expected finish) mostly avoid them."""
    tuning = Tuning(fill_streams=streams) if streams is not None else Tuning()
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (90, 20, 65, 48, 77, 33, 50, 70, 25, 60, 41, 85)]
    outs = [48, 4, 40, 8, 32, 12, 44, 16, 36, 20, 28, 24]        # finishing apart: holes, compaction
    page = LLM(str(ckpt), dtype="bfloat16", device=DEVICE, kv_memory_gb=0.01).engine.cache.layout.open_page_bytes
    res, sealed = {}, {}
    for comp in (True, False):
        llm = LLM(str(ckpt), dtype="bfloat16", device=DEVICE, kv_compression=comp, deterministic=True,
                  kv_memory_gb=28 * page / 2**30, chunk_bytes=4 * page, max_num_batched_tokens=64,
                  max_model_len=160, tuning=tuning)
        eng = llm.engine
        reqs = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=o, ignore_eos=True))
                for p, o in zip(ps, outs)]
        run_to_completion(eng, reqs, keep_logits=True)
        res[comp], sealed[comp] = reqs, eng.cache.stats()
    assert [r.output_ids for r in res[True]] == [r.output_ids for r in res[False]]
    for a, b in zip(res[True], res[False]):
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
    assert sealed[True]["pages_compressed"] > 40, sealed[True]
    assert sealed[True]["compactions"] > 0 or streams is None, sealed[True]


def test_a_device_page_table_kept_apart_gives_the_same_run(ckpt, monkeypatch):
    """On CUDA the kernels (and the K/V store) read a device copy of the page table, brought up
    to date after each change or, the engine's way, in one copy before each forward. Here on the
    CPU that copy is forced (a tensor of its own): under pressure, with seals, compaction and
    frees between forwards, both ways give the tokens and logits bits of a run that reads the
    host table itself (one fill stream: requests finishing apart, compaction)."""
    from zipfusion.memory import page_table
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (90, 20, 65, 48, 77, 33, 50, 70, 25, 60, 41, 85)]
    outs = [48, 4, 40, 8, 32, 12, 44, 16, 36, 20, 28, 24]
    page = LLM(str(ckpt), dtype="bfloat16", device=DEVICE, kv_memory_gb=0.01).engine.cache.layout.open_page_bytes
    init = page_table.PageTable.__init__
    res = {}
    for way in ("host", "deferred", "immediate"):
        if way != "host":
            monkeypatch.setattr(page_table.PageTable, "__init__",
                                lambda self, L, P, device, mirrored=None: init(self, L, P, device, True))
        llm = LLM(str(ckpt), dtype="bfloat16", device=DEVICE, deterministic=True, kv_memory_gb=28 * page / 2**30,
                  chunk_bytes=4 * page, max_num_batched_tokens=64, max_model_len=160, tuning=Tuning(fill_streams=1))
        eng = llm.engine
        table = eng.cache.manager.table
        # the engine defers; on CUDA every table is a device copy (there "host" is "deferred")
        assert table.mirrored == (way != "host" or DEVICE != "cpu") and table.deferred
        if way != "host":
            assert table.page_loc.data_ptr() != torch.from_numpy(table.loc).data_ptr()
        table.deferred = way == "deferred"
        reqs = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=o, ignore_eos=True))
                for p, o in zip(ps, outs)]
        run_to_completion(eng, reqs, keep_logits=True)
        res[way] = reqs
        stats = eng.cache.stats()
        assert stats["pages_compressed"] > 40 and stats["compactions"] > 0, stats
    for way in ("deferred", "immediate"):
        assert [r.output_ids for r in res[way]] == [r.output_ids for r in res["host"]]
        for a, b in zip(res[way], res["host"]):
            assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def test_merged_rope_store_is_the_torch_path_bit_for_bit(ckpt):
    """The CUDA path's rope + K/V-store kernel (forced on here, prefill and decode) and the torch
    rope + write give the same K/V bits in the pages and the same logits."""
    res = {}
    for merged in (True, False):
        llm = LLM(str(ckpt), dtype="bfloat16", device=DEVICE, kv_memory_gb=0.03, attention_backend="kernel")
        eng = llm.engine
        eng.cache.merged_store = merged
        reqs = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)) for p in prompts()]
        for r in reqs:
            r.logits = []
        for _ in range(2):                                         # prefill, one decode step
            step = eng.step()
            for r, row in zip(step.sampled, step.logits.cpu()):
                r.logits.append(row.clone())
        kv = [eng.cache.read_tokens(0, r.pages, r.num_computed) for r in reqs]
        res[merged] = (reqs, kv)
    for (a, kva), (b, kvb) in zip(zip(*res[True]), zip(*res[False])):
        assert a.output_ids == b.output_ids
        for x, y in zip(kva, kvb):                                 # K, V incl. the decoded token
            assert torch.equal(x, y)
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def test_deterministic_rows_over_an_open_copy_are_the_fused_kernels_bits(ckpt):
    """Deterministic mode, compressed pages: a long prefill chunk's rows run the twin over an
    open copy of the request's pages; that gives the fused kernel's bits on the pages themselves,
    and the run's tokens and logits equal the uncompressed run's and a whole-prompt run's."""
    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (50, 9)]
    res = {}
    for name, kw in (("compressed", dict(kv_compression=True)), ("uncompressed", dict(kv_compression=False)),
                     ("whole", dict(kv_compression=True, max_num_batched_tokens=8192))):
        opts = dict(dtype="bfloat16", device=DEVICE, kv_memory_gb=0.03, attention_backend="kernel",
                    deterministic=True, max_num_batched_tokens=24, max_model_len=512,
                    enable_prefix_caching=False)              # the repeated prompt computes its pages
        opts.update(kw)
        eng = LLM(str(ckpt), **opts).engine
        reqs = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)) for p in ps]
        run_to_completion(eng, reqs, keep_logits=True)
        res[name] = reqs
        if name == "compressed":                          # the copy against the pages themselves
            eng.scheduler.seal_now()
            r = eng.add_request(ps[0], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            eng.step()
            eng.step()                                    # 48 prompt tokens, sealed
            eng.scheduler.seal_now()
            assert eng.cache.manager.page_state(r.pages[0]) == "stored"
            q = torch.randn(20, 4, 64, generator=g).to(torch.bfloat16).to(DEVICE)
            pages = torch.tensor(r.pages[:2], dtype=torch.int32, device=DEVICE)
            lens = torch.arange(13, 33, dtype=torch.int32, device=DEVICE)
            be = eng.attention
            a = be.decode.over_open_copy(q, *be.prefill_stored.read(0, pages, 2 * 16), lens)
            b = be.decode(0, q, pages.expand(20, 2).contiguous(), lens)
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    for a, b, w in zip(res["compressed"], res["uncompressed"], res["whole"]):
        assert a.output_ids == b.output_ids == w.output_ids
        assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(a.logits, b.logits, w.logits))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="varlen FlashAttention and cuDNN SDPA run on CUDA only")
@pytest.mark.parametrize("spans,first,split", [
    ([(4096, 256), (40, 700), (1000, 17)], [0, 272, 320], False),    # short chunks: one varlen call
    ([(3000, 1024), (16, 2000)], [0, 400], True),                    # all long: split_prefill each
])
def test_gather_chunks_match_per_chunk_sdpa(monkeypatch, spans, first, split):
    """The "gather" chunks of a step -- in one varlen FlashAttention call (bottom-right causal,
    GQA), or, all of them long, each as split_prefill (cuDNN over prefix and chunk, merged by
    log-sum-exp) -- give what SDPA gives chunk by chunk (bf16 kernels: a few bf16 ulps apart)."""
    from zipfusion.config import PREFILL_SPLIT_MIN_TOKENS
    from zipfusion.attention import prefill_stored as stored
    from zipfusion.attention.backend import ChunkView
    from zipfusion.attention.prefill_open import cudnn_takes, prefill_attention
    if split and not cudnn_takes(torch.empty(0, dtype=torch.bfloat16, device="cuda")):
        pytest.skip("this torch/GPU has no cuDNN SDPA with log-sum-exp: the varlen route is used")
    assert split == (min(n for _, n in spans) >= PREFILL_SPLIT_MIN_TOKENS)
    calls, real = [], stored.split_prefill                           # count the split's calls
    monkeypatch.setattr(stored, "split_prefill", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator(device="cuda").manual_seed(0)
    Hq, H, D = 32, 8, 128
    # each chunk's own pages (the key order is cu_k's here), behind 5 decode rows
    chunks = [ChunkView(s, n, list(range(f, f + -(-(s + n) // 16)))) for (s, n), f in zip(spans, first)]
    offsets = [5 + sum(n for _, n in spans[:j]) for j in range(len(spans))]
    vb = stored.VarlenBatch.of(list(zip(offsets, chunks)), torch.device("cuda"))
    q = torch.randn(5 + sum(n for _, n in spans), Hq, D, device="cuda", generator=g, dtype=torch.bfloat16)
    ks = [torch.randn(s + n, H, D, device="cuda", generator=g, dtype=torch.bfloat16) for s, n in spans]
    vs = [torch.randn_like(k) for k in ks]
    got = stored.varlen_prefill(q[vb.rows], torch.cat(ks), torch.cat(vs), vb, D ** -0.5)
    assert len(calls) == (len(spans) if split else 0)
    want = [prefill_attention(q[off:off + ch.length], k, v, ch.start, D ** -0.5)
            for off, ch, k, v in zip(offsets, chunks, ks, vs)]
    torch.testing.assert_close(got, torch.cat(want), atol=2e-2, rtol=2e-2)
    assert (got - torch.cat(want)).abs().float().mean() < 1e-3


@pytest.mark.parametrize("grain", [1, 4, 7, 512])
@pytest.mark.parametrize("n,L,Hq,H", [(5, 12, 8, 2), (16, 17, 4, 4), (7, 40, 8, 1), (33, 300, 4, 2)])
def test_split_prefill_merges_prefix_and_own_keys_into_causal_attention(n, L, Hq, H, grain):
    """A continuation chunk as attention over its prefix rounded down to ``grain`` keys (no mask)
    plus over the rest and its own keys (top-left causal behind zero rows), merged by log-sum-exp,
    is causal attention over all its keys (CPU: the fp32 twin; grain 512: one causal call)."""
    from zipfusion.attention.prefill_open import prefill_attention
    from zipfusion.attention.prefill_stored import split_prefill
    g = torch.Generator().manual_seed(n * L)
    q, k, v = (torch.randn(m, h, 64, generator=g) for m, h in ((n, Hq), (L, H), (L, H)))
    v[L - n:] *= 1e3                       # one part's values dwarf the other's: weights must be right
    torch.testing.assert_close(split_prefill(q, k, v, 0.3, grain), prefill_attention(q, k, v, L - n, 0.3),
                               atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("n,L,causal", [(5, 5, True), (13, 13, True), (8, 8, True), (3, 29, False), (9, 4, False)])
def test_cudnn_buckets_pad_rows_without_changing_real_rows(n, L, causal):
    """Queries padded to a bucket (causal: keys too, zeros at the end) give the real rows exactly
    the output and log-sum-exp of the unpadded call (CPU: the fp32 twin; on CUDA, cuDNN)."""
    from zipfusion.attention.prefill_open import attend_lse
    g = torch.Generator().manual_seed(n + L)
    q, k, v = (torch.randn(m, h, 32, generator=g) for m, h in ((n, 4), (L, 2), (L, 2)))
    o1, lse1 = attend_lse(q, k, v, causal, 0.3, bucket=1)
    o8, lse8 = attend_lse(q, k, v, causal, 0.3, bucket=8)
    assert o8.shape == o1.shape == (n, 4, 32) and lse8.shape == lse1.shape == (n, 4)
    torch.testing.assert_close(o8, o1, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse8, lse1, atol=1e-5, rtol=1e-5)
    if causal:                          # and the twin is causal attention: row 0 sees key 0 alone
        torch.testing.assert_close(o1[0], v[0].repeat_interleave(2, dim=0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("deterministic", [False, True])
def test_prefill_warm_up_builds_every_causal_bucket_and_a_prefix_call(monkeypatch, deterministic):
    """At engine build on CUDA, cuDNN's graphs are made for every causal bucket a step's prompt
    chunk can take and for a split chunk's prefix call (CPU: cuDNN faked, the calls recorded);
    without cuDNN (the CPU), or in deterministic mode (every chunk attends as decode rows),
    nothing runs."""
    from zipfusion.attention import backend, prefill_open, prefill_stored
    eng = LLM("demo", device="cpu", kv_memory_gb=0.002, max_num_seqs=2, max_num_batched_tokens=64,
              deterministic=deterministic, prefill_split_grain=1024).engine
    calls = []
    for module in (prefill_open, prefill_stored):
        monkeypatch.setattr(module, "attend_lse", lambda q, k, v, causal, scale: calls.append(
            (q.shape[0], k.shape[0], causal)))
    eng.attention.warm_up_prefill(1100)
    assert calls == []                                                  # no cuDNN here
    monkeypatch.setattr(backend, "cudnn_takes", lambda q: {"gqa": True})
    eng.attention.warm_up_prefill(1100)
    B = prefill_open.CUDNN_BUCKET
    assert calls == ([] if deterministic else [(n, n, True) for n in range(B, 1100 + B, B)] + [(B, 1024, False)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA routes of fp32 prefill")
def test_fp32_prefill_on_cuda_leaves_cudnn_to_bf16():
    """cuDNN's SDPA and FlashAttention take bf16/fp16 only: an fp32 prompt, a long fp32 chunk
    split in two, or a step's fp32 "gather" chunks on CUDA attend through SDPA / the fp32 twin,
    as on the CPU."""
    from zipfusion.attention.backend import ChunkView
    from zipfusion.attention.prefill_open import prefill_attention
    from zipfusion.attention.prefill_stored import VarlenBatch, split_prefill, varlen_prefill
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(m, h, 64, generator=g) for m, h in ((1100, 8), (1600, 2), (1600, 2)))
    want = prefill_attention(q, k, v, 500, 0.125)
    cq, ck, cv = q.cuda(), k.cuda(), v.cuda()
    torch.testing.assert_close(split_prefill(cq, ck, cv, 0.125).cpu(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(prefill_attention(cq, ck[:1100], cv[:1100], 0, 0.125).cpu(),
                               prefill_attention(q, k[:1100], v[:1100], 0, 0.125), atol=1e-4, rtol=1e-4)
    vb = VarlenBatch.of([(0, ChunkView(500, 1100, list(range(100))))], torch.device("cuda"))
    torch.testing.assert_close(varlen_prefill(cq, ck, cv, vb, 0.125).cpu(), want, atol=1e-4, rtol=1e-4)


def test_varlen_batch_restores_shared_pages_once_and_keeps_each_chunks_keys():
    """Chunks behind one cached prefix share its pages: the batch restores each page once, and its
    token index gives every chunk exactly its own keys (prefix, then its chunk), in order."""
    from zipfusion.attention.backend import ChunkView
    from zipfusion.attention.prefill_stored import VarlenBatch
    prefix = [7, 3, 9]
    chunks = [ChunkView(48, 20, prefix + [11, 12]), ChunkView(40, 10, prefix + [20])]
    vb = VarlenBatch.of([(4, chunks[0]), (24, chunks[1])], torch.device("cpu"))
    assert vb.pages.tolist() == [3, 7, 9, 11, 12, 20] and vb.cu_k.tolist() == [0, 68, 118]
    assert vb.rows.tolist() == list(range(4, 34)) and (vb.max_q, vb.max_k) == (20, 68)

    def read(pages, n):        # token s of page p restored as the value 1000 p + s
        vals = (pages.to(torch.int64)[:, None] * 1000 + torch.arange(16)).reshape(-1)[:n]
        return vals, -vals
    k, v = vb.keys(read)
    want = [1000 * p + s for ch in chunks for t in range(ch.start + ch.length)
            for p, s in [(ch.pages[t // 16], t % 16)]]
    assert k.tolist() == want and v.tolist() == [-x for x in want]


# ------------------------------------------------------------------------------------------
# Packed decode: rows behind one shared prefix share the kernel's restores (attention/packing.py)
PACK = Tuning(min_shared_pages=2, min_spared_pages=0)       # pack behind 2 shared pages, however few rows
# ------------------------------------------------------------------------------------------

def test_find_groups_takes_the_longest_common_prefix_before_each_newest_token():
    import numpy as np
    from zipfusion.attention.packing import find_groups
    t = np.array([[5, 6, 7, 8, 9], [5, 6, 7, 1, 2], [5, 6, 3, 4, 0], [9, 9, 9, 9, 9], [9, 9, 9, 9, 9],
                  [9, 9, 9, 9, 9], [4, 4, 4, 4, 4]], dtype=np.int32)
    lens = np.array([80, 80, 80, 80, 40, 33, 80])        # full pages before the newest token: 4, 2, 2
    groups = find_groups(lens, t, min_pages=2)
    assert [(rows.tolist(), shared) for rows, shared in groups] == [([0, 1, 2], 2), ([3, 4, 5], 2)]
    assert find_groups(lens, t, min_pages=3) == []       # the 9-rows are cut by rows 4, 5's newest tokens
    assert [r.tolist() for r, _ in find_groups(lens[:2], t[:2], min_pages=3)] == [[0, 1]]
    assert find_groups(lens[6:], t[6:], min_pages=1) == []                 # one row is no group


def _shared_prefix_rows(eng, reqs):
    """Decode rows over the engine's pages: rows 0-2 begin with request 0's two full pages (a
    cached prefix), row 3 stands alone; each row's last page is its own, open."""
    r = reqs
    pages = [r[0].pages, r[0].pages[:2] + r[1].pages, r[0].pages[:2] + r[2].pages, r[3].pages]
    lens = [40, 32 + 21, 32 + 37, 5]
    table = torch.zeros(4, 8, dtype=torch.int32)
    for i, p in enumerate(pages):
        table[i, :len(p)] = torch.tensor(p, dtype=torch.int32)
    return torch.tensor(lens, dtype=torch.int32), table


def test_packed_decode_matches_the_plain_kernel_and_keeps_fused_twin_bits(ckpt):
    """Packed requests (attention/packing.py; G = 2 here, so four rows a request) over the engine's
    pages: the plain kernel's attention up to rounding, fused on compressed pages == twin bits."""
    from zipfusion.testing import reference_decode_attention
    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (40, 21, 37, 5)]
    q = torch.randn(4, 4, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    outs = {}
    for compressed in (True, False):
        llm = LLM(str(ckpt), dtype="bfloat16", device=DEVICE, kv_memory_gb=0.03, attention_backend="kernel",
                  kv_compression=compressed, enable_prefix_caching=False, packed_decode=True, tuning=PACK)
        eng = llm.engine
        reqs = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=3)) for p in ps]
        eng.step()
        eng.scheduler.seal_now()
        lens, table = _shared_prefix_rows(eng, reqs)
        be = eng.attention
        assert be.packed and be.prepare_decode(lens, table) == "eager"    # no packed graph buffers here
        step = be.plan(torch.zeros(4, dtype=torch.int64, device=DEVICE), torch.zeros(4, dtype=torch.int64,
                       device=DEVICE), num_decode=4, block_table=table.to(DEVICE), context_lens=lens.to(DEVICE))
        plan = step.packed
        assert plan.rows.tolist() == [[0, 1, 2, 0], [3, 0, 0, 0]] and plan.slots.tolist() == [0, 1, 2, 4]
        assert plan.spans[0].tolist() == [[32, 40], [48, 69], [80, 117], [0, 0]]
        got = step.decode(0, q)
        plain = be.decode(0, q, table.to(DEVICE), lens.to(DEVICE))
        ref = reference_decode_attention(q, eng.cache.arena, eng.cache.page_loc[0], table.to(DEVICE),
                                         lens.to(DEVICE), eng.cache.layout, be.sm_scale, out_dtype=torch.float64)
        for x in (got, plain):
            assert float((x.double() - ref).norm() / ref.norm()) < 1e-2
        outs[compressed] = got
    assert torch.equal(outs[True].view(torch.int16), outs[False].view(torch.int16))


def test_packed_decode_in_the_engine_keeps_compressed_and_uncompressed_identical(ckpt, monkeypatch):
    """Prefix-cache hits decode as packed requests (eagerly): compressed and uncompressed runs
    give the same tokens and logits, and the same tokens as without packing (greedy, a small
    model: rounding rarely flips one); never packed by default or in deterministic mode."""
    from zipfusion.attention import backend
    planned = []
    real = backend.plan_packed
    monkeypatch.setattr(backend, "plan_packed", lambda *a: planned.append(p := real(*a)) or p)
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(3, 256, (50,), generator=g).tolist()
    ps = [prefix + torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 9, 20)]
    for kw in (dict(), dict(deterministic=True, packed_decode=True)):
        assert not LLM(str(ckpt), dtype="bfloat16", device=DEVICE, kv_memory_gb=0.03, attention_backend="kernel",
                       **kw).engine.attention.packed
    res = {}
    for name, kw in (("fused", dict(kv_compression=True, packed_decode=True)),
                     ("twin", dict(kv_compression=False, packed_decode=True)), ("plain", dict())):
        planned.clear()
        llm = LLM(str(ckpt), dtype="bfloat16", device=DEVICE, kv_memory_gb=0.03, attention_backend="kernel",
                  max_model_len=256, tuning=PACK, **kw)
        eng = llm.engine
        # the prefix's pages cached by a prefill alone; then a prefill over them and one packed
        # decode step (each decode step costs ~10 s of the Triton interpreter here)
        run_to_completion(eng, [eng.add_request(prefix + [7], SamplingParams(temperature=0, max_tokens=1))])
        sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        reqs = [eng.add_request(p, sp) for p in ps]
        run_to_completion(eng, reqs, keep_logits=True)
        plans = [p for p in planned if p is not None]
        assert (max((int((p.rows[:, 1:] != 0).sum()) for p in plans), default=0) == 2) == (name != "plain"), name
        res[name] = reqs
    for a, b, c in zip(res["fused"], res["twin"], res["plain"]):
        assert a.output_ids == b.output_ids == c.output_ids
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the CUDA kernel need a GPU")
def test_packed_decode_replays_packed_cuda_graphs(tmp_path, monkeypatch):
    """On the GPU (head_dim 128, GQA group 4: the CUDA kernel, two rows a packed request) rows
    behind a cached prefix replay the bucket's packed graph: compressed and uncompressed give the
    same tokens and logits, and the logits of the same steps run eagerly up to rounding (an
    eager packed step splits its requests' pages otherwise)."""
    from zipfusion.attention import backend
    save_tiny_checkpoint(tmp_path, num_hidden_layers=2, hidden_size=1024, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=128, max_position_embeddings=2048)
    hows = []
    real = backend.AttentionBackend.prepare_decode
    monkeypatch.setattr(backend.AttentionBackend, "prepare_decode",
                        lambda self, *a, **k: hows.append(h := real(self, *a, **k)) or h)
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(3, 256, (70,), generator=g).tolist()
    ps = [prefix + torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 9, 20, 30, 1)]
    res = {}
    for name, kw in (("fused", dict(kv_compression=True)), ("twin", dict(kv_compression=False)),
                     ("fused eager", dict(kv_compression=True, enforce_eager=True))):
        hows.clear()
        llm = LLM(str(tmp_path), dtype="bfloat16", device="cuda", kv_memory_gb=0.05, attention_backend="kernel",
                  max_model_len=512, packed_decode=True, tuning=PACK, **kw)
        eng = llm.engine
        assert bool(eng.runner.packed_graphs) != kw.get("enforce_eager", False)
        sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        run_to_completion(eng, [eng.add_request(prefix + [7], sp)])        # caches the prefix's pages
        reqs = [eng.add_request(p, sp) for p in ps]
        run_to_completion(eng, reqs, keep_logits=True)
        assert ("packed" in hows) != kw.get("enforce_eager", False), (name, hows)
        res[name] = reqs
    for a, b, c in zip(res["fused"], res["twin"], res["fused eager"]):
        assert a.output_ids == b.output_ids
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
        x, y = torch.stack(a.logits[:len(c.logits)]), torch.stack(c.logits[:len(a.logits)])
        assert float((x - y).abs().max()) < 0.1 * float(y.abs().max()), "graph vs eager packed steps"


def test_pages_checked_on_the_device_before_each_decode_call(ckpt, monkeypatch):
    """check_pages=True (a debugging aid for the H200's async-scheduling hang): every
    decode attention call first asserts its block table, lengths and locations on the device;
    a sound run gives the same tokens with it."""
    import importlib
    da = importlib.import_module("zipfusion.kernels.decode_attention")
    calls = []
    check = da.check_ids_async
    monkeypatch.setattr(da, "check_ids_async", lambda *a: calls.append(a[3].numel()) or check(*a))
    got = {}
    for on in (False, True):
        llm = LLM(str(ckpt), dtype="bfloat16", device=DEVICE, kv_memory_gb=0.03, attention_backend="kernel",
                  check_pages=on)
        assert llm.engine.attention.decode.check_pages is on
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts()[:2]],
                            SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
        got[on] = [o.token_ids for o in outs]
    assert got[True] == got[False]
    layers = llm.engine.model_config.num_hidden_layers
    assert len(calls) == 2 * layers and set(calls) == {2}      # two decode steps of two rows, every layer
