"""Test helpers, outside the package, shared by test modules (which never import each other):
arenas laid out for the attention tests, pages written into and read back from a memory
manager, a live server on loopback, and tiny random Hugging Face checkpoints written with
``save_pretrained`` exactly as a Hub model would be (needs transformers), so that tests
exercise the real loader."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path

import numpy as np
import torch

from zipfusion.analysis.synthetic import pages_with_fraction
from zipfusion.format import PageLayout, encode_pages_into, from_blocks, page_sizes
from zipfusion.memory.page_table import STORED

SMALL_LAYOUT = PageLayout(1, 64)           # open page 4096 bytes, smallest compressed 3088


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16)


def fill(m, ids, fractions, seed=0):
    """Write pages of :data:`SMALL_LAYOUT` with a given compressible fraction per layer into a
    memory manager; returns {(layer, id): page}."""
    written = {}
    for layer, frac in enumerate(fractions):
        pages = pages_with_fraction(len(ids), SMALL_LAYOUT.num_kv_heads, SMALL_LAYOUT.head_dim, frac,
                                    seed=seed * 100 + layer)
        for i, pid in enumerate(ids):
            m.open_page(layer, pid).copy_(pages[i])
            written[layer, pid] = pages[i].clone()
    return written


def assert_contents(m, written):
    """Every page :func:`fill` wrote reads back with the same bits."""
    for (layer, pid), page in written.items():
        got = m.read_pages(layer, [pid])[0]
        assert torch.equal(bits(got), bits(page)), (layer, pid, m.page_state(pid))


@contextlib.contextmanager
def live_server(app):
    """uvicorn on 127.0.0.1 (a free port) in a thread; yields the base URL (needs the server extra)."""
    import uvicorn

    from zipfusion.server import bind_socket
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()


def assert_packed_books(m) -> None:
    """A memory manager's packed books, recomputed from its page table's stored pages: each
    packed chunk's live bytes and pages, each layer's held chunks and live bytes, and the kept
    reclaimable bound (a change that leaves it stale fails)."""
    P = m.packed
    ids = np.nonzero(m.table.state == STORED)[0]
    chunks = ((m.table.loc[:, ids] & ~1) // m.chunk_bytes).ravel()
    sizes = m.table.size[:, ids].ravel()
    assert (P.live_bytes == np.bincount(chunks, weights=sizes, minlength=P.live_bytes.size)).all()
    assert (P.live_pages == np.bincount(chunks, minlength=P.live_pages.size)).all()
    assert P.held.tolist() == [len(c) for c in P.chunks]
    assert (P.layer_live == m.table.size[:, ids].sum(1)).all()
    kept, P._bound = P.reclaimable_bound(), None
    assert (kept == P.reclaimable_bound()).all(), "reclaimable_bound kept past a change"


def pages_from_block_bits(block_bits, num_kv_heads=1, head_dim=128):
    """[n, 512] int bit patterns -> pages whose blocks, in format order, are those blocks (the
    last page filled up by repeating blocks)."""
    layout = PageLayout(num_kv_heads, head_dim)
    n = block_bits.shape[0]
    pad = (-n) % layout.num_blocks
    if pad:
        block_bits = torch.cat([block_bits, block_bits[torch.arange(pad) % n]])
    x = block_bits.to(torch.int32).to(torch.int16).view(torch.bfloat16)
    return from_blocks(x.view(-1, num_kv_heads, 2, layout.blocks_per_head, 512)).contiguous()


def _window_bulk(b: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """[n, 512] patterns whose exponents fill [b, min(b+15, 255)] (both ends present), random
    signs and fractions: a block whose window is fixed at base b (even)."""
    n = b.shape[0]
    top = (b + 15).clamp(max=255).to(torch.int32)
    e = (b[:, None].to(torch.int32) + torch.randint(0, 16, (n, 512), generator=g,
                                                    dtype=torch.int32)).clamp(max=top[:, None])
    e[:, 0], e[:, 1] = b, top
    return (torch.randint(0, 2, (n, 512), generator=g, dtype=torch.int32) << 15) | (e << 7) \
        | torch.randint(0, 128, (n, 512), generator=g, dtype=torch.int32)


def escape_pattern_blocks(seed: int = 0) -> torch.Tensor:
    """All 65,536 BF16 patterns as escapes (format v2): 16,384 blocks, block i holding patterns
    4i .. 4i+3 (one sign and exponent e) at value indices (i + 128 j) % 512, j = 0..3 (every
    index, several groups), the other 508 values filling a window just above e (d = -1 or -2)
    or just below it (d = 16 or 17), alternating where both fit: each block needs exactly 4
    escapes."""
    g = torch.Generator().manual_seed(seed)
    pats = torch.arange(65536, dtype=torch.int32).view(-1, 4)
    e = (pats[:, 0] >> 7) & 0xFF
    i = torch.arange(pats.shape[0])
    above = (e + 1 + 1) // 2 * 2                      # window above e: b = e+1 rounded up to even
    below = (e - 16) // 2 * 2                         # window below e: b + 15 < e
    use_above = ((i % 2 == 0) | (below < 0)) & (above <= 240)
    blocks = _window_bulk(torch.where(use_above, above, below), g)
    pos = (i[:, None] + 128 * torch.arange(4)) % 512
    blocks.scatter_(1, pos, pats)
    return blocks


def adversarial_escape_blocks(seed: int = 0) -> torch.Tensor:
    """Blocks at the escape limit: exactly MAX_ESCAPES (4) and 5 outliers (zeros, subnormals,
    inf, NaN, tiny and huge values), outliers sharing one group, one word, and b/2 = 126, 0."""
    g = torch.Generator().manual_seed(seed)
    bulk = _window_bulk(torch.tensor([120] * 8 + [240, 0], dtype=torch.int32), g)
    specials = torch.tensor([0x0000, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFFC1, 0x0080, 0x7F7F],
                            dtype=torch.int32)
    for r, (where, vals) in enumerate([
            ([3, 100, 200, 511], specials[:4]),       # 4 below the window: compressed
            ([3, 100, 200, 511, 7], specials[:5]),    # 5: raw
            ([8, 9, 10, 11], specials[4:]),           # 4 in one group (inf, NaN, tiny, huge)
            ([0, 1, 500, 501], specials[[0, 4, 5, 3]]),   # two words with both halves escaped
            ([17], specials[:1]),                     # one zero
            ([17, 18, 19, 20, 21], specials[:5]),     # 5 consecutive: raw
            ([511], specials[4:5]),                   # +inf in the last value
            ([256, 257, 258], specials[5:])]):        # 3
        bulk[r, where] = vals
    bulk[8] = (bulk[8] & 0x807F) | ((254 + torch.arange(512) % 2) << 7).to(torch.int32)
    bulk[8, 0] = 0x0000                               # exponents 254, 255 + a zero: b/2 = 126
    bulk[9, 5] = 0x4000                               # exponents 0..15 + 2.0: b/2 = 0, escaped
    return bulk


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


class ReferenceKVCacheStep:
    """The model's KVCacheStep for one sequence, no cache (a reference for tests): torch rope,
    dense causal attention with the model's scale, sliding windows and soft-capping."""

    def __init__(self, cfg):
        self.cfg = cfg

    def store(self, layer, q, k, v, cos, sin):
        from zipfusion.models.layers import apply_rope
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, layer, q, k, v):
        from zipfusion.attention.prefill_open import prefill_attention
        c = self.cfg
        return prefill_attention(q, k, v, 0, c.softmax_scale, c.window(layer), c.attn_softcap)


# arch -> (transformers config class, model class) names
TINY_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"), "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"), "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}


def save_tiny_checkpoint(folder: str | Path, arch: str = "llama", seed: int = 0, max_shard_size: str | None = None,
                         legacy_rope: bool = False, dtype=None, **overrides):
    """Save a random tiny ``arch`` (a key of :data:`TINY_ARCHS`) to ``folder``; return the HF model.

    ``legacy_rope=True`` rewrites config.json into the older ``rope_theta`` + ``rope_scaling``
    spelling (what Hub checkpoints carry); otherwise transformers' own ``rope_parameters``.
    The large ``initializer_range`` spreads the logits so greedy choices are not near-ties.
    """
    import torch
    import transformers

    torch.manual_seed(seed)
    kwargs = {**TINY, **overrides}
    if arch not in TINY_ARCHS:
        raise ValueError(f"arch must be one of {sorted(TINY_ARCHS)}, got {arch!r}")
    cfg_name, cls_name = TINY_ARCHS[arch]
    cfg = getattr(transformers, cfg_name)(**kwargs)
    model = getattr(transformers, cls_name)(cfg).eval()
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


WEIGHT_SPECIALS = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-39, 3e38, 1e-20, -7.0]


def adversarial_weight(n, k, seed, scale=0.02, share=0.02):
    """A Gaussian BF16 weight [n, k] with a ``share`` of its values replaced by specials (±0,
    ±inf, NaN, subnormals, outliers that escape)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * scale).bfloat16()
    flat = w.view(-1)
    idx = torch.randint(0, flat.numel(), (max(1, int(flat.numel() * share)),), generator=g)
    sp = torch.tensor(WEIGHT_SPECIALS).bfloat16()
    flat[idx] = sp[torch.randint(0, len(sp), idx.shape, generator=g)]
    return w
