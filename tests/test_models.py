"""Models: config reading, rope, loading, and logits equal to transformers' (fp32, CPU)."""

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from zipfusion.models import build_model, config_from_dict, load_config, resolve_model  # noqa: E402
from zipfusion.models.layers import rope_inv_freq  # noqa: E402
from zipfusion.models.gguf import is_gguf_path  # noqa: E402
from helpers import ReferenceKVCacheStep, save_tiny_checkpoint  # noqa: E402

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


def our_logits(model, ids):
    hidden = model(ids, torch.arange(len(ids)), ReferenceKVCacheStep(model.config))
    return model.compute_logits(hidden)


def assert_logits_match(hf, ours):
    """Our fp32 logits of 100 random tokens equal transformers' within 1e-4; returns both."""
    ids = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    got = our_logits(ours, ids)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    return got, ref


CASES = {
    "llama": dict(arch="llama"),
    "llama-sharded-llama3-rope-legacy-spelling": dict(arch="llama", max_shard_size="100KB", legacy_rope=True,
                                                       rope_scaling=LLAMA3_SCALING, rope_theta=10000.0),
    "llama-llama3-rope-parameters-spelling": dict(arch="llama", rope_scaling=LLAMA3_SCALING, rope_theta=500000.0),
    "qwen3-tied": dict(arch="qwen3", tie_word_embeddings=True),
    "qwen3": dict(arch="qwen3", seed=3),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path, case):
    hf = save_tiny_checkpoint(tmp_path, **CASES[case])
    got, ref = assert_logits_match(hf, build_model(str(tmp_path), dtype=torch.float32))
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_both_rope_spellings_read_the_same(tmp_path):
    save_tiny_checkpoint(tmp_path / "a", rope_scaling=LLAMA3_SCALING, rope_theta=500000.0)
    save_tiny_checkpoint(tmp_path / "b", rope_scaling=LLAMA3_SCALING, rope_theta=500000.0, legacy_rope=True)
    raw_a = json.loads((tmp_path / "a" / "config.json").read_text())
    raw_b = json.loads((tmp_path / "b" / "config.json").read_text())
    assert "rope_parameters" in raw_a and "rope_scaling" in raw_b and "rope_parameters" not in raw_b
    a, b = load_config(tmp_path / "a"), load_config(tmp_path / "b")
    assert a.rope == b.rope
    assert a.rope.rope_type == "llama3" and a.rope.theta == 500000.0 and a.rope.factor == 8.0


def test_llama3_inv_freq_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hf_cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, head_dim=128, rope_theta=500000.0,
                         rope_scaling={**LLAMA3_SCALING, "original_max_position_embeddings": 8192},
                         max_position_embeddings=131072)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    ours = load_config(resolve_model("llama-3.1-8b-random").config_path)
    torch.testing.assert_close(rope_inv_freq(128, ours.rope), ref.float(), rtol=1e-6, atol=0)


def num_parameters(c) -> int:
    """A ModelConfig's parameter count (embeddings, layers, final norm; lm_head unless tied)."""
    h, i, L, V = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size
    per_layer = h * (c.q_size + 2 * c.kv_size) + c.q_size * h + 3 * h * i + 2 * h
    if c.qk_norm:
        per_layer += 2 * c.head_dim
    return V * h * (1 if c.tie_word_embeddings else 2) + L * per_layer + h


def test_shipped_configs():
    llama = load_config(resolve_model("llama-3.1-8b-random").config_path)
    qwen = load_config(resolve_model("qwen3-8b-random").config_path)
    assert abs(num_parameters(llama) - 8.03e9) < 0.01e9 and llama.rope.rope_type == "llama3"
    assert abs(num_parameters(qwen) - 8.19e9) < 0.01e9 and qwen.qk_norm and not llama.qk_norm
    qwen32 = load_config(resolve_model("qwen3-32b-random").config_path)      # Qwen3-32B: 32.8B parameters
    assert abs(num_parameters(qwen32) - 32.76e9) < 0.01e9 and qwen32.qk_norm and not qwen32.tie_word_embeddings
    assert (qwen32.num_attention_heads, qwen32.num_key_value_heads, qwen32.head_dim) == (64, 8, 128)


def test_random_init_stays_finite_over_many_layers():
    raw = json.loads(resolve_model("llama-3.1-8b-random").config_path.read_text())
    raw.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
               head_dim=64, vocab_size=512)                       # 32 layers, small widths
    from zipfusion.models.llama import CausalLM
    from zipfusion.models.loader import random_init
    model = CausalLM(config_from_dict(raw))
    random_init(model)
    logits = our_logits(model, torch.arange(64))
    assert torch.isfinite(logits).all() and logits.std() > 0


def _raw(**kw):
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
                num_hidden_layers=1, num_attention_heads=2)
    base.update(kw)
    return base


@pytest.mark.parametrize("raw, match", [
    (_raw(architectures=["FalconForCausalLM"], model_type="falcon"), "FalconForCausalLM"),
    (_raw(sliding_window=None, layer_types=["sliding_attention"]), "sliding_window"),
    (_raw(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}), "partial_rotary_factor"),
    (_raw(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "yarn"),
    (_raw(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor"),
    (_raw(hidden_act="gelu"), "hidden_act"),
    (_raw(num_key_value_heads=3, num_attention_heads=4), "multiple"),
    (_raw(hidden_size=0), "hidden_size"),
])
def test_unsupported_configs_say_what(raw, match):
    with pytest.raises(ValueError, match=match):
        config_from_dict(raw)


def test_missing_things_say_what(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))
    save_tiny_checkpoint(tmp_path / "m", max_shard_size="100KB")
    shard = sorted((tmp_path / "m").glob("*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match="missing"):
        build_model(str(tmp_path / "m"), dtype=torch.float32)


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file
    save_tiny_checkpoint(tmp_path)
    f = tmp_path / "model.safetensors"
    sd = load_file(str(f))
    del sd["model.layers.1.self_attn.k_proj.weight"]
    save_file(sd, str(f), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.qkv_proj\.weight\[1\]"):
        build_model(str(tmp_path), dtype=torch.float32)


def test_random_weights_from_checkpoint_config(tmp_path):
    save_tiny_checkpoint(tmp_path)
    src = resolve_model(str(tmp_path), load_format="random")
    assert src.weights_dir is None
    m = build_model(src, dtype=torch.float32)
    w = m.model.layers[0].mlp.gate_up_proj.weight
    assert abs(float(w.std()) - 0.02) < 0.002


def test_bf16_model_keeps_fp32_rope_frequencies(tmp_path):
    save_tiny_checkpoint(tmp_path, rope_scaling=LLAMA3_SCALING, rope_theta=500000.0)
    m = build_model(str(tmp_path), dtype=torch.bfloat16)
    assert m.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.bfloat16
    assert m.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(m.rotary.inv_freq, rope_inv_freq(64, load_config(tmp_path).rope))


# -- GGUF: tiny files written the way llama.cpp's converter writes them (no network) -------------

GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
              "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
              "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp"}

GEMMA_GGUF_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                    "post_feedforward_layernorm": "post_ffw_norm"}
CHATML = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}")


def llama_cpp_permute(w, n_head):
    """What llama.cpp's convert_hf_to_gguf does to Llama q/k rows (written from its description)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gpt2_byte_spelling() -> dict:
    """GPT-2's byte -> printable character table (byte-level BPE vocabularies spell bytes this way)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}


def save_tiny_gguf(path, hf, arch="llama", weight_type="F32", tokenizer=False, rope_freqs=None, meta=None):
    """Write ``hf`` (a tiny transformers model) as a GGUF file the way llama.cpp lays one out."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter
    cfg = hf.config
    w = GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)       # (Gemma 3: per layer type)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(__import__("gguf").RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if arch in ("gemma2", "gemma3"):                  # what llama.cpp's converter writes for Gemma
        if getattr(cfg, "attn_logit_softcapping", None):
            w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        if getattr(cfg, "final_logit_softcapping", None):
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
        if arch == "gemma3":
            w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    for k, v in (meta or {}).items():
        w.add_uint32(k, v) if isinstance(v, int) else w.add_string(k, v)
    if tokenizer:
        spell = gpt2_byte_spelling()
        tokens = [spell[b] for b in range(256)]
        tokens[1], tokens[2], tokens[3] = "<|im_start|>", "<|im_end|>", "hi"       # bytes 1-3 never occur
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types([3 if i in (1, 2) else 1 for i in range(256)])
        w.add_token_merges(["h i"])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_chat_template(CHATML)
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.numpy().astype(np.float32))
    for name in [n for n in sd if ".experts." in n]:     # transformers 5 holds experts stacked: [E, 2I, h], [E, h, I]
        t, blk = sd.pop(name), f"blk.{name.split('.')[2]}"
        if name.endswith("gate_up_proj"):
            w.add_tensor(f"{blk}.ffn_gate_exps.weight", np.ascontiguousarray(t[:, :t.shape[1] // 2]))
            w.add_tensor(f"{blk}.ffn_up_exps.weight", np.ascontiguousarray(t[:, t.shape[1] // 2:]))
        else:
            w.add_tensor(f"{blk}.ffn_down_exps.weight", np.ascontiguousarray(t))
    for name, t in sd.items():
        if name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            gname = "output.weight"
        elif name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            parts = name.split(".")
            mod, kind = ".".join(parts[3:-1]), parts[-1]
            names = {**GGUF_NAMES, **GEMMA_GGUF_NAMES} if arch in ("gemma2", "gemma3") else GGUF_NAMES
            gname = f"blk.{parts[2]}.{names[mod]}.{kind}"
            if arch == "llama" and mod == "self_attn.q_proj":
                t = llama_cpp_permute(t, cfg.num_attention_heads)
            elif arch == "llama" and mod == "self_attn.k_proj":
                t = llama_cpp_permute(t, cfg.num_key_value_heads)
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            t = t + 1.0                               # llama.cpp stores Gemma's norms as 1 + w
        if t.ndim == 2 and weight_type == "F16":
            w.add_tensor(gname, t.astype(np.float16))
        elif t.ndim == 2 and weight_type == "Q8_1":        # a type gguf cannot dequantize
            from gguf import GGML_QUANT_SIZES
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_1]
            rows, cols = t.shape
            w.add_tensor(gname, np.zeros((rows, cols // block * size), np.uint8), raw_dtype=GGMLQuantizationType.Q8_1)
        else:
            w.add_tensor(gname, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama3_rope_freqs(theta, head_dim, scaling):
    """The divisors llama.cpp stores as rope_freqs.weight, from transformers' own llama3 rope."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hf_cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, rope_theta=theta,
                         rope_scaling=scaling, max_position_embeddings=131072)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    base = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    return (base / scaled.float()).float()


GGUF_CASES = {
    "qwen2": dict(arch="qwen2"),
    "phi3-fused": dict(arch="phi3"),
    "qwen3moe": dict(arch="qwen3moe", hf_arch="qwen3_moe", hf=dict(num_experts=4, num_experts_per_tok=2,
                                                                   moe_intermediate_size=64, norm_topk_prob=True)),
    "mixtral-as-llama": dict(arch="llama", hf_arch="mixtral", hf=dict(num_local_experts=4, num_experts_per_tok=2)),
    "gemma2": dict(arch="gemma2", hf=dict(sliding_window=8, query_pre_attn_scalar=64, attn_logit_softcapping=5.0,
                                          final_logit_softcapping=3.0)),
    "gemma3": dict(arch="gemma3", hf=dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                          query_pre_attn_scalar=64, rope_parameters={
                                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                              "full_attention": {"rope_type": "linear", "rope_theta": 1e6,
                                                                 "factor": 4.0}})),
    "llama-f32": dict(arch="llama"),
    "llama-f16": dict(arch="llama", weight_type="F16"),
    "qwen3-tied": dict(arch="qwen3", hf=dict(tie_word_embeddings=True)),
    "llama3.1-rope-freqs": dict(arch="llama", hf=dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})),
}


@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_gguf_logits_match_transformers(tmp_path, case):
    pytest.importorskip("gguf")
    spec = GGUF_CASES[case]
    hf = save_tiny_checkpoint(tmp_path / "hf", arch=spec.get("hf_arch", spec["arch"]), **spec.get("hf", {}))
    rope_freqs = None
    if "rope_scaling" in spec.get("hf", {}):
        rope_freqs = llama3_rope_freqs(500000.0, 64, spec["hf"]["rope_scaling"])
        assert rope_freqs.max() == 8.0 and rope_freqs.min() == 1.0       # the scaling really matters here
    path = save_tiny_gguf(tmp_path / "m.gguf", hf, arch=spec["arch"], weight_type=spec.get("weight_type", "F32"),
                          rope_freqs=rope_freqs)
    if spec.get("weight_type") == "F16":                # the reference gets the same fp16-rounded matrices
        with torch.no_grad():
            for p in hf.parameters():
                if p.dim() == 2:
                    p.copy_(p.half().float())
    cfg, ref_cfg = load_config(path), load_config(tmp_path / "hf")
    for key in ("architecture", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "tie_word_embeddings", "qk_norm", "rope", "qkv_bias", "num_experts", "num_experts_per_tok",
                "moe_intermediate_size", "norm_topk_prob", "sliding_windows", "local_rope", "attn_scale", "attn_softcap",
                "final_softcap", "norm_offset"):
        assert getattr(cfg, key) == getattr(ref_cfg, key), key
    assert_logits_match(hf, build_model(str(path), dtype=torch.float32))


def test_gguf_tokenizer_and_chat_template_from_the_file(tmp_path):
    pytest.importorskip("gguf")
    from zipfusion import LLM, SamplingParams
    hf = save_tiny_checkpoint(tmp_path / "hf")
    path = save_tiny_gguf(tmp_path / "m.gguf", hf, tokenizer=True)
    llm = LLM(str(path), device="cpu", kv_memory_gb=0.01)
    tok = llm.tokenizer
    assert tok.encode("hi") == [3] and tok.encode("ih") == [ord("i"), ord("h")] and tok.encode("<|im_end|>") == [2]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert 2 in llm.engine.eos_token_ids and llm.engine.model_config.bos_token_id == 1
    out = llm.generate([text], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 4
    # a folder holding one .gguf (and no config.json) names the same model
    (tmp_path / "only").mkdir()
    (tmp_path / "m.gguf").rename(tmp_path / "only" / "m.gguf")
    src = resolve_model(str(tmp_path / "only"))
    assert is_gguf_path(src.config_path) and src.config_path == tmp_path / "only" / "m.gguf" and src.tokenizer_dir == src.config_path


def test_gguf_errors_are_one_line(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    from zipfusion.models import gguf as zg
    hf = save_tiny_checkpoint(tmp_path / "hf")
    good = save_tiny_gguf(tmp_path / "good.gguf", hf)
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        resolve_model(str(tmp_path / "nope.gguf"))
    (tmp_path / "text.gguf").write_bytes(b"hello, I am not a model")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        resolve_model(str(tmp_path / "text.gguf"))
    (tmp_path / "cut.gguf").write_bytes(good.read_bytes()[:300])
    with pytest.raises(ValueError, match="not a valid GGUF file"):
        build_model(str(tmp_path / "cut.gguf"), dtype=torch.float32)
    save_tiny_gguf(tmp_path / "gpt2.gguf", hf, arch="gpt2")
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        build_model(str(tmp_path / "gpt2.gguf"), dtype=torch.float32)
    save_tiny_gguf(tmp_path / "moe.gguf", hf, arch="qwen3", meta={"qwen3.expert_count": 8})
    with pytest.raises(ValueError, match="mixture-of-experts"):
        build_model(str(tmp_path / "moe.gguf"), dtype=torch.float32)
    save_tiny_gguf(tmp_path / "q81.gguf", hf, weight_type="Q8_1")
    with pytest.raises(ValueError, match=r"quantization type\(s\) \['Q8_1'\].*cannot be dequantized"):
        build_model(str(tmp_path / "q81.gguf"), dtype=torch.float32)
    with pytest.raises(ValueError, match="GGUF file; pass load_format='auto' or 'gguf'"):
        resolve_model(str(good), load_format="safetensors")
    # the gguf package missing: say what to install (a ValueError too, so the CLI prints one line)
    monkeypatch.setitem(__import__("sys").modules, "gguf", None)
    zg._open_cached.cache_clear()
    with pytest.raises(ValueError, match=r"pip install gguf"):
        resolve_model(str(good))
    from zipfusion.cli import main
    assert main(["generate", "--model", str(good), "--prompt", "x", "--device", "cpu"]) == 2
