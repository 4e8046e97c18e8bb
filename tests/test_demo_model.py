"""The embedded demo model (src/zipfusion/models/demo/): files, size, config, tokenizer, and
that the KV it produces survives the page format bit for bit."""

from __future__ import annotations

import functools
import json
import math
import struct
from pathlib import Path

import pytest
import torch

from zipfusion.format import RAW_MARK, analyze_pages, decode_page, encode_page

DEMO = Path(__file__).resolve().parents[1] / "src" / "zipfusion" / "models" / "demo"
SIZE_BUDGET = 4_000_000                  # bytes, the whole directory
REQUIRED = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "README.md"]
GENESIS = ("In the beginning God created the heaven and the earth.\n"
           "And the earth was without form, and void; and darkness was upon the face of the deep. "
           "And the Spirit of God moved upon the face of the waters.\n"
           "And God said, Let there be light: and there was light.")


def config() -> dict:
    return json.loads((DEMO / "config.json").read_text())


def safetensors_header(path: Path) -> dict:
    """The JSON header of a .safetensors file (8-byte little-endian length, then JSON)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


# --------------------------------------------------------------------------------------------
# Files, size, config
# --------------------------------------------------------------------------------------------

def test_files_exist_and_fit_the_budget():
    for name in REQUIRED:
        assert (DEMO / name).is_file(), f"missing {DEMO / name}"
    total = sum(f.stat().st_size for f in DEMO.iterdir() if f.is_file())
    assert total <= SIZE_BUDGET, f"demo model is {total:,} bytes, budget {SIZE_BUDGET:,}"


def test_config_is_a_llama_with_head_dim_64():
    c = config()
    assert c["architectures"] == ["LlamaForCausalLM"]
    assert c["model_type"] == "llama"
    assert c["head_dim"] == 64 == c["hidden_size"] // c["num_attention_heads"]
    assert c["num_attention_heads"] % c["num_key_value_heads"] == 0
    assert c["tie_word_embeddings"] is True
    assert c["torch_dtype"] == "bfloat16"
    assert 0 <= c["bos_token_id"] < c["vocab_size"] and 0 <= c["eos_token_id"] < c["vocab_size"]


def test_weights_are_bf16_and_match_the_config():
    c = config()
    hdr = safetensors_header(DEMO / "model.safetensors")
    tensors = {k: v for k, v in hdr.items() if k != "__metadata__"}
    assert all(v["dtype"] == "BF16" for v in tensors.values())
    assert "lm_head.weight" not in tensors                       # tied to the embedding
    H, D, Hq = c["num_key_value_heads"], c["head_dim"], c["num_attention_heads"]
    hidden, inter, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    assert tensors["model.embed_tokens.weight"]["shape"] == [c["vocab_size"], hidden]
    for i in range(L):
        p = f"model.layers.{i}."
        assert tensors[p + "self_attn.q_proj.weight"]["shape"] == [Hq * D, hidden]
        assert tensors[p + "self_attn.k_proj.weight"]["shape"] == [H * D, hidden]
        assert tensors[p + "self_attn.v_proj.weight"]["shape"] == [H * D, hidden]
        assert tensors[p + "self_attn.o_proj.weight"]["shape"] == [hidden, Hq * D]
        assert tensors[p + "mlp.gate_proj.weight"]["shape"] == [inter, hidden]
    assert f"model.layers.{L}.self_attn.q_proj.weight" not in tensors


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------

def tokenizer():
    pytest.importorskip("tokenizers", reason="needs the `tokenizers` package")
    return _load_tokenizer()


@functools.lru_cache(maxsize=1)
def _load_tokenizer():
    import tokenizers
    return tokenizers.Tokenizer.from_file(str(DEMO / "tokenizer.json"))


def test_tokenizer_has_bos_eos_matching_the_config():
    tok, c = tokenizer(), config()
    tc = json.loads((DEMO / "tokenizer_config.json").read_text())
    assert tok.token_to_id(tc["bos_token"]) == c["bos_token_id"]
    assert tok.token_to_id(tc["eos_token"]) == c["eos_token_id"]
    assert tok.get_vocab_size() == c["vocab_size"]
    ids = tok.encode("In the beginning").ids
    assert ids[0] == c["bos_token_id"] and len(ids) > 1


@pytest.mark.parametrize("text", [GENESIS, "", "  two  spaces\tand a tab\n", "Zoë naïve 東京 🙂 1+1=2",
                                  "JESUS WEPT.", "a" * 300])
def test_tokenizer_round_trips(text):
    tok = tokenizer()
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=True) == text


try:
    from hypothesis import given, settings, strategies as st

    @settings(max_examples=60, deadline=None)
    @given(st.text(max_size=80))
    def test_tokenizer_round_trips_any_text(text):
        tok = tokenizer()
        if "<|" in text:            # could spell a special token, which decodes to nothing
            return
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=True) == text
except ImportError:                  # pragma: no cover
    pass


# --------------------------------------------------------------------------------------------
# transformers: load, generate, KV through the page format
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers", reason="needs the `transformers` package")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM.from_pretrained(str(DEMO), dtype=torch.bfloat16).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(DEMO))
    return model, tok


def test_transformers_loads_and_generates(hf):
    model, tok = hf
    assert model.config.head_dim == 64
    enc = tok("In the beginning", return_tensors="pt")
    assert enc.input_ids[0, 0].item() == tok.bos_token_id
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    assert out.shape == (1, enc.input_ids.shape[1] + 8) or int(out[0, -1]) == tok.eos_token_id
    new = out[0, enc.input_ids.shape[1]:]
    assert int(new.min()) >= 0 and int(new.max()) < model.config.vocab_size
    text = tok.decode(out[0], skip_special_tokens=True)
    assert text.startswith("In the beginning")
    print("greedy:", repr(text))


def test_model_is_trained_on_kjv(hf):
    """Loss on Genesis 1:1-3 is far below that of a uniform guess (ln vocab, ~7.6)."""
    model, tok = hf
    ids = tok(GENESIS, return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.float().item()
    print(f"loss on Genesis 1:1-3: {loss:.3f} (uniform: {math.log(model.config.vocab_size):.3f})")
    assert loss < 0.5 * math.log(model.config.vocab_size)


def test_chat_template_renders(hf):
    _, tok = hf
    text = tok.apply_chat_template([{"role": "user", "content": "Who made the light?"}],
                                   tokenize=False, add_generation_prompt=True)
    assert "Who made the light?" in text


def kv_pages(past, layer: int) -> torch.Tensor:
    """One layer of a transformers cache -> full pages [P, 2, 16, H, D] bf16."""
    if hasattr(past, "layers"):                      # transformers >= 4.56
        k, v = past.layers[layer].keys, past.layers[layer].values
    elif hasattr(past, "key_cache"):
        k, v = past.key_cache[layer], past.value_cache[layer]
    else:
        k, v = past[layer]
    kv = torch.stack([k[0], v[0]]).to(torch.bfloat16)            # [2, H, T, D]
    T = kv.shape[2] // 16 * 16
    kv = kv[:, :, :T].permute(0, 2, 1, 3)                         # [2, T, H, D]
    return kv.unflatten(1, (-1, 16)).permute(1, 0, 2, 3, 4).contiguous()


def test_kv_of_the_model_round_trips_through_the_page_format(hf):
    model, tok = hf
    ids = tok(GENESIS, return_tensors="pt").input_ids[:, :48]
    assert ids.shape[1] == 48
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    past = out["cache"] if "cache" in out else out["past_key_values"]     # transformers 5.2x / 4.x
    c = model.config
    compressed = total = 0
    for layer in range(c.num_hidden_layers):
        pages = kv_pages(past, layer)
        assert pages.shape == (3, 2, 16, c.num_key_value_heads, 64)
        for page in pages:
            buf = encode_page(page)
            back = decode_page(buf, c.num_key_value_heads, 64)
            assert torch.equal(back.view(torch.int16), page.view(torch.int16))
        base = analyze_pages(pages)
        compressed += int((base != RAW_MARK).sum())
        total += base.numel()
    fraction = compressed / total
    print(f"demo model KV: {compressed}/{total} blocks compressible ({fraction:.1%})")
    assert fraction > 0
