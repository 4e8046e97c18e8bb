"""Every family from a tiny random checkpoint written by transformers' ``save_pretrained``:
fp32 logits and greedy tokens through the engine (chunked prefill, sliding windows reaching
past the chunk) equal transformers'; in bf16, the tokens and logits with KV compression on equal
those with it off."""

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from zipfusion import LLM, SamplingParams  # noqa: E402
from zipfusion.models import build_model, load_config  # noqa: E402
from helpers import ReferenceKVCacheStep, save_tiny_checkpoint  # noqa: E402

W = 8          # sliding windows this short: a 40-token sequence reaches well past them
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=64)
FAMILIES = {
    "qwen2": dict(arch="qwen2"),
    "mistral": dict(arch="mistral", sliding_window=W),
    "phi3": dict(arch="phi3"),
    "gemma2": dict(arch="gemma2", sliding_window=W, layer_types=["sliding_attention", "full_attention"],
                   query_pre_attn_scalar=32, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "gemma3": dict(arch="gemma3", sliding_window=W, layer_types=["sliding_attention", "full_attention"],
                   query_pre_attn_scalar=32, rope_parameters={
                       "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                       "full_attention": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}),
    "qwen3_moe": dict(arch="qwen3_moe", num_experts=4, norm_topk_prob=True, mlp_only_layers=[1], **MOE),
    "qwen3_moe-unnormalised": dict(arch="qwen3_moe", num_experts=4, norm_topk_prob=False, **MOE),
    "mixtral": dict(arch="mixtral", num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    spec = dict(FAMILIES[request.param])
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_checkpoint(folder, **spec)
    return request.param, folder, hf


def test_logits_and_greedy_tokens_match_transformers(family):
    name, folder, hf = family
    cfg = load_config(folder)
    if "window" in name or FAMILIES[name].get("sliding_window"):
        assert any(cfg.sliding_windows)
    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(1))
    ours = build_model(str(folder), dtype=torch.float32)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    got = ours.compute_logits(ours(ids, torch.arange(len(ids)), ReferenceKVCacheStep(cfg)))
    torch.testing.assert_close(got, ref, rtol=2e-4, atol=2e-4)
    # the engine: a 24-token prompt prefilled in chunks of 8 (continuations over stored pages), 16 tokens decoded
    llm = LLM(str(folder), dtype="float32", kv_compression=False, device="cpu", kv_memory_gb=0.01,
              max_num_batched_tokens=8)
    res = llm.generate([ids[:24].tolist()], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1),
                       use_tqdm=False)[0]
    out = res.token_ids
    seq = torch.tensor(ids[:24].tolist() + list(out))
    with torch.no_grad():
        logits = hf(seq[None]).logits[0, 23:-1].float()
    assert list(out) == logits.argmax(-1).tolist()
    ref_lp = logits.log_softmax(-1)[torch.arange(16), torch.tensor(out)]
    got_lp = torch.tensor([lp[t].logprob for lp, t in zip(res.outputs[0].logprobs, out)])
    torch.testing.assert_close(got_lp, ref_lp, rtol=0, atol=1e-4)


def test_bf16_compression_on_equals_off(family):
    name, folder, _ = family
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (37, 21)]
    runs = []
    for compressed in (True, False):
        llm = LLM(str(folder), kv_compression=compressed, device="cpu", kv_memory_gb=0.01, max_num_batched_tokens=16)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3),
                            use_tqdm=False)
        runs.append([(o.token_ids, o.outputs[0].logprobs) for o in outs])
        if compressed:
            assert llm.engine.cache.stored_ratio() < 1.0      # pages really were compressed
    assert runs[0] == runs[1]


@pytest.mark.parametrize("window, softcap", [(5, None), (None, 2.0), (21, 1.5), (64, None)])
def test_decode_row_equals_last_prefill_row_with_window_and_softcap(window, softcap):
    """A decode row over pages (torch_decode_attention) attends as the last row of a masked
    prefill over the same keys: the window and soft-capping agree on both paths."""
    from zipfusion.attention.decode import torch_decode_attention
    from zipfusion.attention.prefill_open import masked_attention
    g = torch.Generator().manual_seed(0)
    L, Hq, H, D = 45, 4, 2, 16
    q, k, v = (torch.randn(n, h, D, generator=g, dtype=torch.float64) for n, h in ((L, Hq), (L, H), (L, H)))
    kp, vp = (torch.cat([t, torch.full((48 - L, H, D), float("nan"), dtype=t.dtype)]) for t in (k, v))
    pages = torch.stack([kp.view(3, 16, H, D), vp.view(3, 16, H, D)], dim=1)       # [3, 2, 16, H, D]
    dense = masked_attention(q, k, v, 0, 0.3, window, softcap, exact=True)
    for n in (1, 7, 16, 30, 45):                    # context lengths inside, at and past the window
        row = torch_decode_attention(q[n - 1:n], lambda ids: pages[ids], torch.arange(3)[None], torch.tensor([n]),
                                     0.3, exact=True, window=window, softcap=softcap)
        torch.testing.assert_close(row[0], dense[n - 1], rtol=1e-6, atol=1e-6)      # (decode rounds to fp32)
    plain = masked_attention(q, k, v, 0, 0.3, exact=True)
    assert torch.equal(dense, plain) == (softcap is None and window >= L)     # a window past L changes nothing


# published parameter counts (text models; Gemma 3 12B without its vision tower)
SHIPPED = {"qwen2.5-7b": 7.62e9, "mistral-7b": 7.24e9, "phi-3-mini": 3.82e9, "gemma-3-12b": 11.77e9,
           "qwen3-30b-a3b": 30.53e9, "mixtral-8x7b": 46.70e9, "mixtral-8x7b-16l": 23.48e9}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_random_configs(name):
    from zipfusion.models import RANDOM_MODELS, resolve_model
    from zipfusion.models.llama import CausalLM
    cfg = load_config(resolve_model(f"{name}-random").config_path)
    with torch.device("meta"):
        n = sum(p.numel() for p in CausalLM(cfg).parameters())
    assert abs(n - SHIPPED[name]) < 0.01e9
    assert f"{name}-random" in RANDOM_MODELS
    # random weights at small widths: finite, spread logits (Gemma's (1 + w) norms start at w = 0)
    import dataclasses
    from zipfusion.models.loader import random_init
    small = dataclasses.replace(cfg, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, vocab_size=128,
                                num_hidden_layers=6, sliding_windows=cfg.sliding_windows[:6], head_dim=16,
                                num_attention_heads=4, num_key_value_heads=2, num_experts=min(cfg.num_experts, 8),
                                num_experts_per_tok=min(cfg.num_experts_per_tok, 2))
    model = CausalLM(small)
    random_init(model)
    logits = model.compute_logits(model(torch.arange(40), torch.arange(40), ReferenceKVCacheStep(small)))
    assert torch.isfinite(logits).all() and logits.std() > 0.01
    if name == "gemma-3-12b":                 # every 6th layer global, the others local with their own rope
        assert [w is None for w in cfg.sliding_windows[:6]] == [False] * 5 + [True]
        assert cfg.local_rope.theta == 1e4 and cfg.rope.factor == 8.0 and cfg.head_dim == 256


def test_kv_analyzer_runs_on_each_family(family):
    """``zipfusion analyze``'s measurement over a family's KV: every layer's full pages sized, the
    captured K/V those of the model's own forward (sliding windows and soft-capping applied)."""
    from zipfusion.analysis.model_kv import analyze_ids, capture_kv
    name, folder, hf = family
    net = build_model(str(folder))                                     # bf16, as analyze runs it
    ids = torch.randint(3, 256, (48,), generator=torch.Generator().manual_seed(2))
    report = analyze_ids(net, [ids.tolist()], model=name)
    assert len(report.layers) == net.config.num_hidden_layers and report.pages == 3
    assert 0.5 < report.size_ratio <= 1.0 and name in report.headline()
    # in fp32, the last layer's V is transformers' (its input went through every earlier layer), rounded to bf16
    v_last = capture_kv(build_model(str(folder), dtype=torch.float32), ids)[-1][1]
    with torch.no_grad():
        ref = hf(ids[None], use_cache=True).past_key_values.layers[-1].values[0].transpose(0, 1)   # [T, H, D]
    assert len(ref) >= W - 1                                          # (a sliding layer's cache keeps its window only)
    torch.testing.assert_close(v_last[-len(ref):].float(), ref.bfloat16().float(), rtol=1e-2, atol=1e-3)


def _grouped_case(device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    E, N, K, M = 6, 48, 64, 40
    w = torch.randn(E, N, K, generator=g).to(device, dtype)
    counts = torch.tensor([7, 0, 13, 1, 0, 19])                         # empty experts included
    x = torch.randn(M, K, generator=g).to(device, dtype)
    return x, w, counts.cumsum(0).to(device)


def test_grouped_mm_equals_its_loop_twin():
    """The grouped GEMM (torch._grouped_mm where present) and the per-expert loop agree, and
    each group really is multiplied by its own expert."""
    from zipfusion.models.moe import grouped_mm, grouped_mm_loop
    x, w, ends = _grouped_case("cpu", torch.float32)
    ref = torch.cat([x[s:e] @ w[i].T for i, (s, e) in enumerate(zip([0] + ends[:-1].tolist(), ends.tolist()))])
    torch.testing.assert_close(grouped_mm_loop(x, w, ends), ref)
    torch.testing.assert_close(grouped_mm(x, w, ends), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grouped_mm(x, w, ends, deterministic=True), ref, rtol=1e-6, atol=1e-5)


@pytest.mark.gpu
def test_gpu_grouped_mm_bf16_equals_the_loop():
    """CUDA, bf16: torch's grouped GEMM (the serving path) against the loop of cuBLAS GEMMs."""
    from zipfusion.models.moe import grouped_mm, grouped_mm_loop
    x, w, ends = _grouped_case("cuda", torch.bfloat16)
    torch.testing.assert_close(grouped_mm(x, w, ends).float(), grouped_mm_loop(x, w, ends).float(),
                               rtol=1.6e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("name,extra", [("qwen3_moe", {}), ("mixtral", {}), ("gemma2", {}), ("mistral", {}),
                                        ("gemma3", dict(head_dim=256))])
def test_gpu_family_compression_on_equals_off(tmp_path, name, extra):
    """CUDA, bf16, our kernels and CUDA graphs: tokens with KV compression on equal those with
    it off (MoE through the grouped GEMM; windowed and soft-capped layers through the Triton
    decode kernel; head_dim 256)."""
    save_tiny_checkpoint(tmp_path, **FAMILIES[name], **extra)
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (37, 90)]
    runs = []
    for c in (True, False):
        llm = LLM(str(tmp_path), kv_compression=c, device="cuda", kv_memory_gb=0.05)
        assert llm.engine.graph_buckets                                  # CUDA graphs were captured
        runs.append([o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40,
                                                                               ignore_eos=True), use_tqdm=False)])
    assert runs[0] == runs[1]


def test_kernel_route_takes_the_windowed_layers(tmp_path):
    """Gemma 2 (a sliding-window layer, soft-capped scores) through our kernels (the Triton
    interpreter here; the kernel's window and cap are tested bit for bit in
    test_decode_attention.py): the windowed layer's decode rows go through the kernel, and the
    tokens and log-probabilities are those of the torch route."""
    save_tiny_checkpoint(tmp_path, **FAMILIES["gemma2"])
    prompt = torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2)
    runs = {}
    for backend in ("kernel", "torch"):
        llm = LLM(str(tmp_path), kv_compression=False, device="cpu", kv_memory_gb=0.01, attention_backend=backend)
        att = llm.engine.attention
        assert att.masked.route is att.decode and att.masked.layers == {0, 1}     # (soft-capping: both layers)
        o = llm.generate([prompt], sp, use_tqdm=False)[0]
        runs[backend] = o.token_ids, torch.tensor([lp.logprob for d in o.outputs[0].logprobs for lp in d.values()])
    assert runs["kernel"][0] == runs["torch"][0]
    torch.testing.assert_close(runs["kernel"][1], runs["torch"][1], rtol=0, atol=0.01)      # (bf16 kernel, fp32 torch)


def test_gemma3_text_model_of_an_image_text_checkpoint(tmp_path):
    """google/gemma-3-{4,12,27}b-it are Gemma3ForConditionalGeneration checkpoints: their text
    model runs alone (text_config over transformers' defaults, the image tower left unloaded);
    logits equal transformers' text-only forward of the whole model."""
    import transformers
    torch.manual_seed(0)
    text = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=W, initializer_range=0.2,
                layer_types=["sliding_attention", "full_attention"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=299, boi_token_index=297, eoi_token_index=298)
    hf = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    hf.save_pretrained(str(tmp_path))
    mc = load_config(tmp_path)
    assert mc.architecture == "Gemma3ForCausalLM" and mc.vocab_size == 300 and mc.sliding_windows == (W, None)
    ids = torch.randint(3, 290, (30,), generator=torch.Generator().manual_seed(3))
    ours = build_model(str(tmp_path), dtype=torch.float32)
    with torch.no_grad():
        ref = hf(input_ids=ids[None]).logits[0].float()
    got = ours.compute_logits(ours(ids, torch.arange(len(ids)), ReferenceKVCacheStep(mc)))
    torch.testing.assert_close(got, ref, rtol=2e-4, atol=2e-4)


def test_windowed_family_deterministic_and_fp8(tmp_path):
    """Mistral's sliding window in deterministic mode (prefill tokens as decode rows over the
    pages: compression on = off, and a prompt's tokens the same alone or batched) and over FP8
    pages (the torch route for its windowed layers)."""
    save_tiny_checkpoint(tmp_path, **FAMILIES["mistral"])
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (37, 21)]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def run(ps, **kw):
        llm = LLM(str(tmp_path), device="cpu", kv_memory_gb=0.01, max_num_batched_tokens=16, **kw)
        return [o.token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
    on = run(prompts, deterministic=True)
    assert on == run(prompts, deterministic=True, kv_compression=False) and on[:1] == run(prompts[:1], deterministic=True)
    fp8 = run(prompts, kv_cache_dtype="fp8")
    assert len(fp8[0]) == 10 and sum(a == b for a, b in zip(fp8[0], on[0])) >= 5        # lossy, yet close


@pytest.mark.gpu
@pytest.mark.parametrize("start,n,G,D", [(0, 300, 4, 256), (700, 129, 2, 64)])
def test_gpu_window_prefill_equals_masked_attention(start, n, G, D):
    """CUDA, bf16: FlashAttention's sliding window (a whole prompt, and a chunk after a prefix)
    against masked_attention's fp32 torch."""
    from zipfusion.attention.prefill_open import masked_attention
    from zipfusion.attention.prefill_stored import window_prefill
    g = torch.Generator().manual_seed(start)
    H, L, window = 2, start + n, 100
    q, k, v = (torch.randn(m, h, D, generator=g).to("cuda", torch.bfloat16) for m, h in ((n, H * G), (L, H), (L, H)))
    got = window_prefill(q, k, v, start, D ** -0.5, window)
    ref = masked_attention(q.float(), k.float(), v.float(), start, D ** -0.5, window, exact=True)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
