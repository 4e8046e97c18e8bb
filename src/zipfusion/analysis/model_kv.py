"""Run a model over text and report how well the KV it writes compresses (one causal pass per
text, every layer's rotated K and V captured, then :func:`~.kv_stats.analyze_kv`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from ..attention.prefill_open import prefill_attention
from ..format.layout import PAGE_TOKENS
from ..models import build_model, load_tokenizer, resolve_model
from ..models.layers import apply_rope
from ..models.llama import KVCacheStep
from .fp8_stats import analyze_fp8
from .kv_stats import KVReport, analyze_kv

# the default text: prose, a list and Python code
SAMPLE_TEXT = """\
The KV cache of a language model holds, for every token already seen, the keys and values that
attention reads at each later step. During decoding with long contexts, reading it dominates
the time of every step, and its size decides how many requests fit on one GPU at once.

Shopping list for the week: apples, flour, two dozen eggs, olive oil, rice, lentils, coffee,
tomatoes, a loaf of bread, cheese, and something for the cat.

def merge_sorted(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]

In the spring the river rose over its banks, and the village moved its market to the hill,
where it stayed for the rest of the season. Nobody complained; the view was better.
"""


class _CaptureKVCacheStep(KVCacheStep):
    """A ``KVCacheStep`` for one causal pass with no cache that keeps each layer's K and V."""

    def __init__(self, cfg, on_layer=None):
        self.cfg, self.kv, self.on_layer = cfg, {}, on_layer

    def store(self, layer, q, k, v, cos, sin):
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        self.kv[layer] = (k.to(torch.bfloat16).cpu(), v.to(torch.bfloat16).cpu())
        if self.on_layer is not None:
            self.on_layer()
        return q, k, v

    def attend(self, layer, q, k, v):
        c = self.cfg
        return prefill_attention(q, k, v, 0, c.softmax_scale, c.window(layer), c.attn_softcap)


@torch.inference_mode()
def capture_kv(model, input_ids: torch.Tensor, on_layer=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One forward pass over ``input_ids`` [T]: each layer's (K, V) [T, H, D] bf16."""
    capture = _CaptureKVCacheStep(model.config, on_layer)
    model(input_ids, torch.arange(input_ids.numel(), device=input_ids.device), capture)
    return [capture.kv[i] for i in range(len(capture.kv))]


def load_for_analysis(model: str, *, device: str = "cpu", load_format: str = "auto"):
    """(bf16 model, tokenizer) for ``model`` (a checkpoint folder, a .gguf file, "demo")."""
    source = resolve_model(model, load_format)
    tokenizer = load_tokenizer(source.tokenizer_dir)
    if tokenizer is None:
        raise ValueError(f"model {model!r} has no tokenizer, so text cannot be fed to it; analyse a "
                         "checkpoint folder that has tokenizer.json, or a GGUF file with tokenizer metadata")
    return build_model(source, dtype=torch.bfloat16, device=device), tokenizer


def text_ids(tokenizer, text: str, max_tokens: int) -> list[int]:
    ids = tokenizer.encode(text)[:max_tokens]
    if len(ids) < PAGE_TOKENS:
        raise ValueError(f"a text of {len(ids)} tokens fills no {PAGE_TOKENS}-token page; give longer texts")
    return ids


def merge_full_pages(per_text: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (K, V) of several texts, each text cut to whole 16-token pages, concatenated."""
    def whole(x):
        return x[: x.shape[0] // PAGE_TOKENS * PAGE_TOKENS]
    return [(torch.cat([whole(t[i][0]) for t in per_text]), torch.cat([whole(t[i][1]) for t in per_text]))
            for i in range(len(per_text[0]))]


def analyze_ids(net, ids_list: list[list[int]], *, progress: bool = False, model: str | None = None,
                kv_dtype: str = "bf16") -> KVReport:
    """Compressibility of the KV ``net`` writes for each token sequence (``kv_dtype="fp8"``: the
    FP8 + lossless sizes too)."""
    check_kv_dtype(kv_dtype)
    from tqdm.auto import tqdm

    device = next(net.parameters()).device
    layers = net.config.num_hidden_layers
    tokens = sum(map(len, ids_list))
    with tqdm(total=len(ids_list) * layers, unit="layer", disable=not progress,
              desc=f"Running the model over {len(ids_list)} text(s), {tokens} tokens") as bar:
        per_text = [capture_kv(net, torch.tensor(ids, device=device), on_layer=bar.update) for ids in ids_list]
    if progress:
        print(f"Measuring how the KV of {layers} layers compresses ...", file=sys.stderr)
    layers_kv = merge_full_pages(per_text)
    report = analyze_kv(layers_kv)
    report.model = model
    if kv_dtype == "fp8":
        report.fp8 = analyze_fp8(layers_kv)
    return report


KV_DTYPES = ("bf16", "fp8")


def check_kv_dtype(kv_dtype: str) -> None:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")


def analyze_model(model: str, texts: list[str] | None = None, *, device: str = "cpu",
                  max_tokens: int = 4096, load_format: str = "auto", progress: bool = True,
                  kv_dtype: str = "bf16") -> KVReport:
    """Compressibility of ``model``'s KV over ``texts`` (default: :data:`SAMPLE_TEXT`)."""
    check_kv_dtype(kv_dtype)
    net, tokenizer = load_for_analysis(model, device=device, load_format=load_format)
    ids_list = [text_ids(tokenizer, text, max_tokens) for text in (texts or [SAMPLE_TEXT])]
    return analyze_ids(net, ids_list, progress=progress, model=Path(str(model)).name, kv_dtype=kv_dtype)
