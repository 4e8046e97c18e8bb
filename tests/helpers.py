"""Test helpers, outside the package: arenas laid out for the attention tests, and tiny random
Hugging Face checkpoints written with ``save_pretrained`` exactly as a Hub model would be (needs
transformers), so that tests exercise the real loader."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from zipfusion.format import PageLayout, encode_pages_into, page_sizes


def build_arena(pages: torch.Tensor, compressed: torch.Tensor, *, seed: int = 0,
                gap_bytes: int = 64, device=None, chunk: int = 1024
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Lay pages [P, 2, 16, H, D] out in a fresh arena, in a random order with random gaps.

    ``compressed[i]`` (bool) stores page i compressed (reference encoder), else open. Returns
    (arena uint8, page_loc int64 [P]: offset for compressed pages, offset | 1 for open ones).
    Gaps and unused bytes hold random bytes, so that a kernel reading outside a page shows.
    """
    device = torch.device(device) if device is not None else pages.device
    P, _, _, H, D = pages.shape
    layout = PageLayout(H, D)
    g = torch.Generator().manual_seed(seed)
    compressed = compressed.to(torch.bool).cpu()
    sizes = torch.full((P,), layout.open_page_bytes, dtype=torch.int64)
    comp_idx = torch.nonzero(compressed).flatten()
    for c in comp_idx.split(chunk):
        sizes[c] = page_sizes(pages[c.to(pages.device)].to(device)).cpu()
    order = torch.randperm(P, generator=g)
    gaps = torch.randint(0, gap_bytes // 16 + 1, (P,), generator=g) * 16
    ends = torch.cumsum(gaps[order] + sizes[order], 0)
    loc = torch.empty(P, dtype=torch.int64)
    loc[order] = ends - sizes[order]
    total = int(ends[-1]) + 16 if P else 16
    dg = torch.Generator(device=device).manual_seed(seed)
    arena = torch.randint(0, 256, (total,), generator=dg, dtype=torch.uint8, device=device)
    for c in comp_idx.split(chunk):
        encode_pages_into(pages[c.to(pages.device)].to(device), arena, loc[c].to(device))
    n = layout.open_page_bytes
    for c in torch.nonzero(~compressed).flatten().split(max(1, chunk // 8)):
        idx = loc[c].to(device)[:, None] + torch.arange(n, device=device)
        arena[idx.flatten()] = pages[c.to(pages.device)].to(device).contiguous().view(
            torch.uint8).flatten()
    page_loc = torch.where(compressed, loc, loc | 1).to(device)
    return arena, page_loc

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
