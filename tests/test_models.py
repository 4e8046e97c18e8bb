"""Models: config reading, rope, loading, and logits equal to transformers' (fp32, CPU)."""

import json

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from zipfusion.models import build_model, config_from_dict, load_config, resolve_model  # noqa: E402
from zipfusion.models.layers import apply_rope, rope_inv_freq  # noqa: E402
from zipfusion.models.testing import save_tiny_checkpoint  # noqa: E402

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


class DenseCausal:
    """Reference KV for one sequence, no cache: torch rope, dense causal attention."""

    def store(self, layer, q, k, v, cos, sin):
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, layer, q, k, v):
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        return o.transpose(0, 1)


def our_logits(model, ids):
    hidden = model(ids, torch.arange(len(ids)), DenseCausal())
    return model.compute_logits(hidden)


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
    ours = build_model(str(tmp_path), dtype=torch.float32)
    ids = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    got = our_logits(ours, ids)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
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


def test_shipped_configs():
    llama = load_config(resolve_model("llama-3.1-8b-random").config_path)
    qwen = load_config(resolve_model("qwen3-8b-random").config_path)
    assert abs(llama.num_parameters() - 8.03e9) < 0.01e9 and llama.rope.rope_type == "llama3"
    assert abs(qwen.num_parameters() - 8.19e9) < 0.01e9 and qwen.qk_norm and not llama.qk_norm


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
    (_raw(architectures=["MistralForCausalLM"], model_type="mistral"), "MistralForCausalLM"),
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
