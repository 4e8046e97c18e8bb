"""attention_backend="flashinfer": option checks, the page-table conversion and the arena view
on the CPU; FlashInfer's kernel against the twin (and inside a CUDA graph) on the GPU."""

import sys

import numpy as np
import pytest
import torch

from zipfusion.config import EngineConfig
from zipfusion.attention.backend import AttentionBackend
from zipfusion.memory.kv_cache import ArenaKVCache
from zipfusion.format import PAGE_TOKENS
from zipfusion.format.layout import loc_offset
from zipfusion.kernels import flashinfer_decode as fid


# ------------------------------------------------------------------------------ options
@pytest.mark.parametrize("kw, match", [
    (dict(), "kv_compression=False"),
    (dict(kv_compression=False, deterministic=True), "batch-invariant"),
])
def test_config_rejects_what_flashinfer_cannot_serve(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(attention_backend="flashinfer", **kw)


def test_config_accepts_flashinfer_and_rejects_unknown_backend():
    EngineConfig(attention_backend="flashinfer", kv_compression=False, device="cuda")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="flash")


def test_config_accepts_flashinfer_over_fp8_pages():
    c = EngineConfig(attention_backend="flashinfer", kv_cache_dtype="fp8", device="cuda")
    assert c.kv_cache_dtype == "fp8" and c.kv_compression is False       # fp8 turns compression off
    with pytest.raises(ValueError, match="reads uncompressed pages only"):
        EngineConfig(attention_backend="flashinfer", kv_cache_dtype="fp8_lossless", device="cuda")


def test_backend_rejects_flashinfer_on_cpu():
    cache = ArenaKVCache(1, 2, 64, 1 << 20, "cpu", kv_compression=False)
    with pytest.raises(ValueError, match="CUDA only"):
        AttentionBackend(cache, "flashinfer", kv_compression=False, num_qo_heads=4, sm_scale=0.125)


def test_engine_rejects_flashinfer_off_cuda():
    from zipfusion.engine import LLMEngine
    with pytest.raises(ValueError, match="CUDA only"):
        LLMEngine(EngineConfig("demo", device="cpu", kv_compression=False, attention_backend="flashinfer"))


@pytest.mark.parametrize("kind", ["flashinfer", "kernel"])
def test_engine_rejects_our_page_kernels_on_a_dense_cache(kind, monkeypatch):
    """float32 pages are dense: the kernels that read bf16 pages refuse them (checked before the
    model is built: it is never built here)."""
    from zipfusion.engine import LLMEngine, llm_engine
    monkeypatch.setattr(llm_engine, "build_model", lambda *a, **k: pytest.fail("model built before the check"))
    with pytest.raises(ValueError, match="reads bfloat16 pages"):
        LLMEngine(EngineConfig("demo", device="cpu", dtype="float32", kv_compression=False, attention_backend=kind))


def test_missing_flashinfer_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)         # import flashinfer -> ImportError
    with pytest.raises(ImportError, match="pip install flashinfer-python"):
        fid.import_flashinfer()


# ------------------------------------------------------------------------------ page table
def reference_plan(lens, table):
    indptr, ids, last = [0], [], []
    for n, row in zip(lens.tolist(), table.tolist()):
        p = -(-n // PAGE_TOKENS)
        ids += row[:p]
        indptr.append(indptr[-1] + p)
        last.append(n - PAGE_TOKENS * (p - 1))
    return indptr, ids, last


@pytest.mark.parametrize("seed", range(4))
def test_paged_plan_matches_reference(seed):
    g = torch.Generator().manual_seed(seed)
    B, W = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g))
    lens = torch.randint(1, PAGE_TOKENS * W + 1, (B,), generator=g, dtype=torch.int32)
    table = torch.randint(0, 1000, (B, W), generator=g, dtype=torch.int32)
    indptr, ids, last = fid.paged_plan(lens, table)
    ref = reference_plan(lens, table)
    assert indptr.dtype == np.int32 and last.dtype == np.int32
    assert indptr.tolist() == ref[0] and ids.tolist() == ref[1] and last.tolist() == ref[2]


def test_paged_plan_rejects_bad_lengths():
    with pytest.raises(ValueError, match="context_lens must be in 1..32"):
        fid.paged_plan(np.array([33]), np.zeros((1, 2), dtype=np.int32))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_arena_view_indices_address_the_open_pages(fp8):
    """The arena as FlashInfer's NHD [N, 2, 16, H, D] pages (bf16, or float8_e4m3fn over FP8
    pages), indexed by page_indices, holds each open page's bytes as they lie in the arena -- for
    BF16 what read_pages returns -- in every layer (each layer's pages live in its own chunks)."""
    from zipfusion.memory.fp8_kv_cache import Fp8KVCache
    cache = (Fp8KVCache(3, 2, 64, 1 << 20, "cpu") if fp8 else
             ArenaKVCache(3, 2, 64, 1 << 20, "cpu", kv_compression=False))
    ids = cache.alloc(5)
    g = torch.Generator().manual_seed(0)
    cache.arena.copy_(torch.randint(0, 255, cache.arena.shape, generator=g, dtype=torch.uint8))
    ob = cache.layout.open_page_bytes
    n = cache.arena.numel() // ob
    pages = cache.arena[:n * ob].view(torch.float8_e4m3fn if fp8 else torch.bfloat16).view(n, 2, PAGE_TOKENS, 2, 64)
    ids_t = torch.tensor(ids)
    for layer in range(3):
        idx = fid.page_indices(cache.page_loc[layer], ids_t, ob)
        assert idx.dtype == torch.int32
        got = pages[idx.long()]
        start = loc_offset(cache.page_loc[layer, ids])                  # each page's first byte
        want = cache.arena[start[:, None] + torch.arange(ob)]
        assert torch.equal(got.view(torch.uint8).reshape(len(ids), -1), want)
        if not fp8:
            assert torch.equal(got.view(torch.int16), cache.read_pages(layer, ids).view(torch.int16))


# ------------------------------------------------------------------------------ GPU
def _filled_cache(H=8, D=128, lens=(8192, 100, 17, 1), seed=0):
    cache = ArenaKVCache(2, H, D, 512 << 20, "cuda", kv_compression=False)
    W = -(-max(lens) // PAGE_TOKENS)
    table = torch.zeros(len(lens), W, dtype=torch.int32)
    for b, n in enumerate(lens):
        p = -(-n // PAGE_TOKENS)
        table[b, :p] = torch.tensor(cache.alloc(p), dtype=torch.int32)
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = cache.arena.view(torch.bfloat16)
    bf.copy_(torch.randn(bf.shape, generator=g, device="cuda").to(torch.bfloat16))
    return cache, table, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True])
def test_flashinfer_matches_twin_on_the_arena(graph):
    pytest.importorskip("flashinfer")
    from zipfusion.kernels import decode_attention_uncompressed
    cache, table, lens = _filled_cache()
    B, Hq, D, scale = table.shape[0], 32, 128, 128 ** -0.5
    attn = AttentionBackend(cache, "flashinfer", kv_compression=False, num_qo_heads=Hq, sm_scale=scale)
    q = torch.randn(B, Hq, D, device="cuda").to(torch.bfloat16)
    attn.prepare_decode(lens, table, graph=graph)
    dt, dl = table.cuda(), lens.cuda()
    if graph:
        out = torch.empty(2, B, Hq, D, dtype=torch.bfloat16, device="cuda")
        for _ in range(2):                                      # warm-up (JIT, plan caches)
            attn.decode(0, q, dt, dl)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for layer in range(2):
                out[layer].copy_(attn.decode(layer, q, dt, dl))
        lens[1] = 300                                           # a new step: longer context, re-plan
        dl.copy_(lens)
        attn.prepare_decode(lens, table, graph=True)
        g.replay()
        torch.cuda.synchronize()
        got = list(out)
    else:
        got = [attn.decode(layer, q, dt, dl) for layer in range(2)]
    for layer in range(2):
        want = decode_attention_uncompressed(q, cache.arena, cache.page_loc[layer], dt, dl, cache.layout, scale)
        torch.testing.assert_close(got[layer].float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", [dict(kv_compression=False), dict(kv_cache_dtype="fp8")], ids=["bf16", "fp8"])
def test_engine_generates_with_flashinfer_like_our_kernel(tmp_path, kv):
    """Whole engine (CUDA graphs, mixed prefill + decode steps) over BF16 or FP8 pages: greedy
    tokens as our kernel's (FP8: FlashInfer folds the scales in, so only the first tokens must
    agree). GQA group 4, head_dim 128: the same FlashInfer build as the Llama-8B shape."""
    pytest.importorskip("flashinfer")
    pytest.importorskip("transformers")
    from zipfusion import LLM, SamplingParams
    from helpers import save_tiny_checkpoint
    save_tiny_checkpoint(tmp_path, hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=128)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 250, (n,), generator=g).tolist()} for n in (300, 40, 77)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {}
    for backend in ("auto", "flashinfer"):
        llm = LLM(str(tmp_path), device="cuda", kv_memory_gb=0.1, attention_backend=backend, max_num_seqs=8, **kv)
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        del llm
    assert all(len(o) == 8 for o in outs["flashinfer"])
    assert all(a[:1] == b[:1] for a, b in zip(outs["auto"], outs["flashinfer"]))
    if "kv_cache_dtype" not in kv:
        assert sum(a == b for a, b in zip(outs["auto"], outs["flashinfer"])) >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.5, 2.0)])
def test_flashinfer_fp8_matches_our_fp8_kernel(scales):
    """FlashInfer's FP8 decode over the FP8 cache's pages (its scales folded into the softmax and
    the output) against our FP8 kernel (dequantize, then BF16 arithmetic): the same attention
    to bf16 rounding, not the same bits."""
    pytest.importorskip("flashinfer")
    from zipfusion.memory.fp8_kv_cache import Fp8KVCache
    from zipfusion.kernels.fp8_attention import decode_attention_fp8
    lens = (8192, 100, 17, 1)
    cache = Fp8KVCache(2, 8, 128, 256 << 20, "cuda", k_scale=scales[0], v_scale=scales[1])
    W = -(-max(lens) // PAGE_TOKENS)
    table = torch.zeros(len(lens), W, dtype=torch.int32)
    for b, n in enumerate(lens):
        p = -(-n // PAGE_TOKENS)
        table[b, :p] = torch.tensor(cache.alloc(p), dtype=torch.int32)
    g = torch.Generator(device="cuda").manual_seed(0)
    vals = (torch.randn(cache.arena.shape, generator=g, device="cuda") * 2).to(torch.float8_e4m3fn)
    cache.arena.copy_(vals.view(torch.uint8))
    B, Hq, D, scale = len(lens), 32, 128, 128 ** -0.5
    attn = AttentionBackend(cache, "flashinfer", kv_compression=False, num_qo_heads=Hq, sm_scale=scale)
    q = torch.randn(B, Hq, D, device="cuda").to(torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    attn.prepare_decode(lens_t, table)
    dt, dl = table.cuda(), lens_t.cuda()
    for layer in range(2):
        got = attn.decode(layer, q, dt, dl)
        want = decode_attention_fp8(q, cache.arena, cache.page_loc[layer], dt, dl, cache.layout, scale,
                                    k_scale=scales[0], v_scale=scales[1])
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)

