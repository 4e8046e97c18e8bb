"""Tiny random Hugging Face checkpoints for tests (needs transformers): written with
``save_pretrained`` exactly as a Hub model would be, so that tests exercise the real loader."""

from __future__ import annotations

import json
from pathlib import Path

TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
            initializer_range=0.2, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def save_tiny_checkpoint(folder: str | Path, arch: str = "llama", seed: int = 0, max_shard_size: str | None = None,
                         legacy_rope: bool = False, dtype=None, **overrides):
    """Save a random tiny ``arch`` ("llama" or "qwen3") to ``folder``; return the HF model.

    ``legacy_rope=True`` rewrites config.json into the older ``rope_theta`` + ``rope_scaling``
    spelling (what Hub checkpoints carry); otherwise transformers' own ``rope_parameters``.
    The large ``initializer_range`` spreads the logits so greedy choices are not near-ties.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    kwargs = {**TINY, **overrides}
    if arch == "llama":
        cfg, cls = LlamaConfig(**kwargs), LlamaForCausalLM
    elif arch == "qwen3":
        cfg, cls = Qwen3Config(**kwargs), Qwen3ForCausalLM
    else:
        raise ValueError(f"arch must be 'llama' or 'qwen3', got {arch!r}")
    model = cls(cfg).eval()
    if dtype is not None:
        model = model.to(dtype)
    folder = Path(folder)
    model.save_pretrained(str(folder), **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if legacy_rope:
        path = folder / "config.json"
        raw = json.loads(path.read_text())
        params = dict(raw.pop("rope_parameters"))
        raw["rope_theta"] = params.pop("rope_theta")
        raw["rope_scaling"] = params if params.get("rope_type", "default") != "default" else None
        path.write_text(json.dumps(raw, indent=2))
    return model


def save_word_tokenizer(folder: str | Path, vocab_size: int = 256) -> None:
    """A word-level tokenizer.json: token i is the word ``w{i}``; text is words split by spaces.
    Token 2 (``</s>``) is the end-of-sequence token of :data:`TINY`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    vocab["</s>"] = vocab.pop("w2")
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["</s>"])
    tok.save(str(Path(folder) / "tokenizer.json"))
