"""How well does a model's KV compress? Per-layer statistics of the page format's block rule.

Input is what attention layers wrote: for each layer, K and V as [tokens, num_kv_heads, head_dim]
BF16. Only full pages (16 tokens) are compressed by the engine, so a trailing partial page is
left out. For each layer and role the report gives the fraction of compressible 512-value blocks,
the distribution of exponent spans (max exponent minus the even base; <= 15 compresses), the
bytes the format saves and what that means for concurrent requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..format.layout import PAGE_TOKENS, PageLayout, to_blocks

SPAN_BINS = 33   # spans 0..31 and ">= 32"


@dataclass
class LayerStats:
    layer: int
    key_fraction: float
    value_fraction: float
    open_bytes: int
    compressed_bytes: int
    key_spans: torch.Tensor      # [SPAN_BINS] block counts
    value_spans: torch.Tensor


@dataclass
class KVReport:
    num_kv_heads: int
    head_dim: int
    pages: int                    # full pages per layer that were analysed
    layers: list[LayerStats] = field(default_factory=list)

    @property
    def compressible_fraction(self) -> float:
        if not self.layers:
            return 0.0
        return sum(s.key_fraction + s.value_fraction for s in self.layers) / (2 * len(self.layers))

    @property
    def key_fraction(self) -> float:
        """Compressible fraction of K blocks over all layers (every layer has as many blocks)."""
        return sum(s.key_fraction for s in self.layers) / len(self.layers) if self.layers else 0.0

    @property
    def value_fraction(self) -> float:
        return sum(s.value_fraction for s in self.layers) / len(self.layers) if self.layers else 0.0

    @property
    def size_ratio(self) -> float:
        """Compressed bytes / open bytes over all layers (0.75 is the format's floor)."""
        open_bytes = sum(s.open_bytes for s in self.layers)
        return sum(s.compressed_bytes for s in self.layers) / open_bytes if open_bytes else 1.0

    @property
    def capacity_gain(self) -> float:
        """How many times more tokens fit in the same KV memory once pages are compressed."""
        return 1.0 / self.size_ratio

    def render(self) -> str:
        lines = [f"KV compressibility: {len(self.layers)} layers, {self.pages} full pages of 16 tokens "
                 f"per layer, {self.num_kv_heads} KV heads x {self.head_dim}",
                 f"{'layer':>5} {'K blocks':>9} {'V blocks':>9} {'size':>7}"]
        for s in self.layers:
            lines.append(f"{s.layer:>5} {s.key_fraction:>9.1%} {s.value_fraction:>9.1%} "
                         f"{s.compressed_bytes / s.open_bytes:>7.1%}")
        lines.append(f"all   compressible blocks {self.compressible_fraction:.1%}; KV size "
                     f"{self.size_ratio:.1%} of BF16 (floor 75%); "
                     f"{self.capacity_gain:.3f}x tokens in the same memory")
        worst = min(self.layers, key=lambda s: s.key_fraction + s.value_fraction, default=None)
        if worst is not None:
            lines.append(f"least compressible layer: {worst.layer} (K {worst.key_fraction:.1%}, "
                         f"V {worst.value_fraction:.1%}); the shared chunk pool lends it other layers' savings")
        return "\n".join(lines)

    def plot(self, path: str, title: str | None = None) -> None:
        """PNG: per-layer compressible fractions, and the spans of all blocks."""
        require_matplotlib()
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
        idx = [s.layer for s in self.layers]
        ax1.bar([i - 0.2 for i in idx], [s.key_fraction for s in self.layers], 0.4, label="K")
        ax1.bar([i + 0.2 for i in idx], [s.value_fraction for s in self.layers], 0.4, label="V")
        ax1.set(xlabel="layer", ylabel="compressible 512-value blocks", ylim=(0, 1.15),
                title="Blocks that compress, per layer")
        ax1.legend(loc="upper center", ncol=2)
        k = sum(s.key_spans for s in self.layers)
        v = sum(s.value_spans for s in self.layers)
        spans = list(range(SPAN_BINS))
        ax2.bar([x - 0.2 for x in spans], k.tolist(), 0.4, label="K")
        ax2.bar([x + 0.2 for x in spans], v.tolist(), 0.4, label="V")
        ax2.axvline(15.5, color="k", ls="--", lw=1)
        ax2.text(15.7, ax2.get_ylim()[1] * 0.9, "raw beyond 15")
        ax2.set(xlabel="exponent span (max e - even base; last bin >= 32)", ylabel="blocks",
                title="Exponent spans of all blocks")
        ax2.legend()
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


class PlotUnavailable(ImportError, ValueError):
    """matplotlib is missing (a ValueError too, so the CLI prints it as one line)."""


def require_matplotlib() -> None:
    """Raise :class:`PlotUnavailable` with what to install, before any long analysis runs."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install matplotlib "
                              "(it comes with pip install -e '.[models]' from the zipfusion checkout)") from None


def _spans(blocks: torch.Tensor) -> torch.Tensor:
    e = (blocks.contiguous().view(torch.int16).to(torch.int32) >> 7) & 0xFF
    span = e.amax(-1) - (e.amin(-1) & ~1)
    return torch.bincount(span.clamp(max=SPAN_BINS - 1).flatten(), minlength=SPAN_BINS)


def layer_stats(layer: int, k: torch.Tensor, v: torch.Tensor) -> LayerStats:
    """Statistics of one layer's K and V, each [tokens, H, D] bf16."""
    if k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
        raise TypeError(f"KV must be bfloat16 to measure the BF16 format, got {k.dtype}/{v.dtype}")
    if k.shape != v.shape or k.dim() != 3:
        raise ValueError(f"expected K and V of shape [tokens, num_kv_heads, head_dim], got "
                         f"{list(k.shape)} and {list(v.shape)}")
    T, H, D = k.shape
    layout = PageLayout(H, D)
    P = T // PAGE_TOKENS
    if P == 0:
        raise ValueError(f"need at least {PAGE_TOKENS} tokens (one full page) to analyse, got {T}")
    pages = torch.stack([k[:P * PAGE_TOKENS], v[:P * PAGE_TOKENS]])   # [2, T, H, D]
    pages = pages.view(2, P, PAGE_TOKENS, H, D).transpose(0, 1).contiguous().cpu()
    blocks = to_blocks(pages)                                          # [P, H, 2, nb, 512]
    spans_k, spans_v = _spans(blocks[:, :, 0]), _spans(blocks[:, :, 1])
    ok_k = int(spans_k[:16].sum())
    ok_v = int(spans_v[:16].sum())
    n = P * H * layout.blocks_per_head
    return LayerStats(layer=layer, key_fraction=ok_k / n, value_fraction=ok_v / n,
                      open_bytes=P * layout.open_page_bytes,
                      compressed_bytes=P * layout.page_bytes(0) - (ok_k + ok_v) * 256,
                      key_spans=spans_k, value_spans=spans_v)


def analyze_kv(layers) -> KVReport:
    """``layers``: iterable of (K, V) pairs, each [tokens, num_kv_heads, head_dim] bf16."""
    layers = list(layers)
    if not layers:
        raise ValueError("no layers to analyse")
    T, H, D = layers[0][0].shape
    stats = [layer_stats(i, k, v) for i, (k, v) in enumerate(layers)]
    return KVReport(num_kv_heads=H, head_dim=D, pages=T // PAGE_TOKENS, layers=stats)
