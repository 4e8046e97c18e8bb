"""How well does a model's KV compress? Per-layer statistics of the page format's block rule
over full pages: compressible fraction and stored bytes under format v2 (what the engine writes)
and v1, exponent spans and values outside each block's window.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..format.layout import (ESCAPE_FLAG, MAX_ESCAPES, PAGE_TOKENS, RAW_MARK, PageLayout,
                              block_bytes, to_blocks)
from ..format.reference import block_base_half

SPAN_BINS = 33   # spans 0..31 and ">= 32"
OUTLIER_BINS = MAX_ESCAPES + 2  # blocks with 0, 1..4 (escaped in v2), 5+ (raw) values outside


@dataclass
class LayerStats:
    """One layer: the format the engine writes (v2) and, with ``_v1``, the seed format."""
    layer: int
    key_fraction: float
    value_fraction: float
    open_bytes: int
    compressed_bytes: int
    key_spans: torch.Tensor
    value_spans: torch.Tensor
    key_fraction_v1: float = 0.0
    value_fraction_v1: float = 0.0
    compressed_bytes_v1: int = 0
    key_outliers: torch.Tensor = None
    value_outliers: torch.Tensor = None
    key_below: int = 0  # the rest: above
    value_below: int = 0


@dataclass
class KVReport:
    num_kv_heads: int
    head_dim: int
    pages: int
    layers: list[LayerStats] = field(default_factory=list)
    model: str | None = None  # for the plot's title
    fp8: object = None  # the FP8 + lossless sizes (fp8_stats.FP8Report)

    def _mean(self, field: str) -> float:
        return sum(getattr(s, field) for s in self.layers) / len(self.layers) if self.layers else 0.0

    def _ratio(self, field: str) -> float:
        open_bytes = sum(s.open_bytes for s in self.layers)
        return sum(getattr(s, field) for s in self.layers) / open_bytes if open_bytes else 1.0

    @property
    def compressible_fraction(self) -> float:
        return (self.key_fraction + self.value_fraction) / 2

    @property
    def key_fraction(self) -> float:
        return self._mean("key_fraction")

    @property
    def value_fraction(self) -> float:
        return self._mean("value_fraction")

    @property
    def size_ratio(self) -> float:
        """Compressed bytes / open bytes over all layers."""
        return self._ratio("compressed_bytes")

    @property
    def v1(self) -> dict:
        k, v = self._mean("key_fraction_v1"), self._mean("value_fraction_v1")
        return {"compressible_fraction": (k + v) / 2, "key_fraction": k, "value_fraction": v,
                "size_ratio": self._ratio("compressed_bytes_v1")}

    def outliers(self) -> dict:
        """Per role: blocks by values outside their window, and the share of escapes below it."""
        out = {}
        for role in ("key", "value"):
            hist = sum(getattr(s, f"{role}_outliers") for s in self.layers)
            escaped = int((hist[1:-1] * torch.arange(1, OUTLIER_BINS - 1)).sum())
            below = sum(getattr(s, f"{role}_below") for s in self.layers)
            out[role] = {"blocks_by_outliers": (hist / hist.sum()).tolist(),
                         "below_window": below / escaped if escaped else float("nan")}
        return out

    @property
    def capacity_gain(self) -> float:
        """How many times more tokens fit in the same KV memory once pages are compressed."""
        return 1.0 / self.size_ratio

    def render(self) -> str:
        lines = [f"KV compressibility: {len(self.layers)} layers, {self.pages} full pages of 16 tokens "
                 f"per layer, {self.num_kv_heads} KV heads x {self.head_dim}; format v2 (escapes) "
                 "and v1 (none)",
                 f"{'layer':>5} {'K blocks':>9} {'V blocks':>9} {'size':>7} {'K v1':>7} {'V v1':>7} "
                 f"{'size v1':>7}"]
        for s in self.layers:
            lines.append(f"{s.layer:>5} {s.key_fraction:>9.1%} {s.value_fraction:>9.1%} "
                         f"{s.compressed_bytes / s.open_bytes:>7.1%} {s.key_fraction_v1:>7.1%} "
                         f"{s.value_fraction_v1:>7.1%} {s.compressed_bytes_v1 / s.open_bytes:>7.1%}")
        v1 = self.v1
        lines.append(f"all   compressible blocks {self.compressible_fraction:.1%} (v1 "
                     f"{v1['compressible_fraction']:.1%}); KV size {self.size_ratio:.1%} of BF16 "
                     f"(v1 {v1['size_ratio']:.1%}; floor 75%); "
                     f"{self.capacity_gain:.3f}x tokens in the same memory")
        worst = min(self.layers, key=lambda s: s.key_fraction + s.value_fraction, default=None)
        if worst is not None:
            lines.append(f"least compressible layer: {worst.layer} (K {worst.key_fraction:.1%}, "
                         f"V {worst.value_fraction:.1%}); the shared chunk pool lends it other layers' savings")
        if self.fp8 is not None:
            lines += ["", self.fp8.render()]
        return "\n".join(lines)

    def headline(self) -> str:
        return (f"{self.model or 'KV'}: stored at {self.size_ratio:.1%} of BF16 with format v2, "
                f"{self.v1['size_ratio']:.1%} with v1 ({self.capacity_gain:.3f}x tokens in the same memory)\n"
                f"{len(self.layers)} layers x {self.pages} pages of {PAGE_TOKENS} tokens x "
                f"{self.num_kv_heads} KV heads x {self.head_dim}")

    def plot(self, path: str, title: str | None = None) -> None:
        """PNG: per layer the stored size under v2 beside v1, and blocks by values outside their
        window."""
        require_matplotlib()
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import PercentFormatter

        v1 = self.v1
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw={"width_ratios": [3, 2]})
        idx = [s.layer for s in self.layers]
        v2_sizes = [s.compressed_bytes / s.open_bytes for s in self.layers]
        v1_sizes = [s.compressed_bytes_v1 / s.open_bytes for s in self.layers]
        ax1.bar([i - 0.2 for i in idx], v2_sizes, 0.4, label=f"v2 (escapes): {self.size_ratio:.1%} overall")
        ax1.bar([i + 0.2 for i in idx], v1_sizes, 0.4, label=f"v1 (no escapes): {v1['size_ratio']:.1%} overall")
        ax1.axhline(1.0, color="k", lw=1, label="raw (BF16)")
        ax1.axhline(0.75, color="k", ls="--", lw=1, label="floor (every block compressed)")
        low = min(v2_sizes + v1_sizes + [0.75])
        ax1.set(xlabel="layer", ylabel="stored size / BF16 size", ylim=(low - 0.03, 1.03),
                title="Stored KV size per layer: v2 vs v1")
        ax1.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax1.legend(loc="center", ncol=2, fontsize=9)
        for role, dx in (("key", -0.2), ("value", 0.2)):
            share = [100 * x for x in self.outliers()[role]["blocks_by_outliers"]]
            ax2.bar([i + dx for i in range(OUTLIER_BINS)], share, 0.4, label=role[0].upper())
        ax2.axvspan(0.5, MAX_ESCAPES + 0.5, color="tab:green", alpha=0.12)
        ax2.axvspan(MAX_ESCAPES + 0.5, OUTLIER_BINS - 0.5, color="tab:red", alpha=0.12)
        for x, what in ((0, "v1 and v2\ncompress"), ((1 + MAX_ESCAPES) / 2, "v2 compresses (escapes),\nv1 stores raw"),
                        (OUTLIER_BINS - 1, "raw")):
            ax2.text(x, 104, what, ha="center", va="center", fontsize=9)
        ax2.set_xticks(range(OUTLIER_BINS), [str(i) for i in range(MAX_ESCAPES + 1)] + [f"{MAX_ESCAPES + 1}+"])
        ax2.set(xlabel="values outside the block's 16-exponent window", ylabel="% of 512-value blocks",
                ylim=(0, 112), title="All blocks, by values outside their window")
        ax2.legend(loc="center right")
        fig.suptitle(self.headline() if title is None else title)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


class PlotUnavailable(ImportError, ValueError):
    """matplotlib is missing (a ValueError too: the CLI prints it as one line)."""


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


def _outlier_stats(bits: torch.Tensor):
    """Blocks [..., 512] -> (metadata bytes, outlier histogram, escaped values below the window)."""
    meta = block_base_half(bits)
    e = (bits >> 7) & 0xFF
    b = (2 * (meta & 0x7F))[..., None]
    below = ((e < b) & ((meta & ESCAPE_FLAG) != 0)[..., None] & (meta != RAW_MARK)[..., None])
    n_out = ((e < b) | (e > b + 15)).sum(-1)
    n_out = torch.where(meta == RAW_MARK, OUTLIER_BINS - 1, n_out)
    return meta, torch.bincount(n_out.flatten(), minlength=OUTLIER_BINS), int(below.sum())


def full_pages(k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, PageLayout, int]:
    """(H, D, layout, P) of one layer's K and V: P full pages; ValueError for other shapes."""
    if k.shape != v.shape or k.dim() != 3:
        raise ValueError(f"expected K and V of shape [tokens, num_kv_heads, head_dim], got "
                         f"{list(k.shape)} and {list(v.shape)}")
    T, H, D = k.shape
    P = T // PAGE_TOKENS
    if P == 0:
        raise ValueError(f"need at least {PAGE_TOKENS} tokens (one full page) to analyse, got {T}")
    return H, D, PageLayout(H, D), P


def layer_stats(layer: int, k: torch.Tensor, v: torch.Tensor) -> LayerStats:
    """Statistics of one layer's K and V, each [tokens, H, D] bf16."""
    if k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
        raise TypeError(f"KV must be bfloat16 to measure the BF16 format, got {k.dtype}/{v.dtype}")
    H, D, layout, P = full_pages(k, v)
    pages = torch.stack([k[:P * PAGE_TOKENS], v[:P * PAGE_TOKENS]])
    pages = pages.view(2, P, PAGE_TOKENS, H, D).transpose(0, 1).contiguous().cpu()
    blocks = to_blocks(pages)
    spans_k, spans_v = _spans(blocks[:, :, 0]), _spans(blocks[:, :, 1])
    ok_k, ok_v = int(spans_k[:16].sum()), int(spans_v[:16].sum())  # v1: span <= 15
    bits = blocks.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    meta_k, out_k, below_k = _outlier_stats(bits[:, :, 0])
    meta_v, out_v, below_v = _outlier_stats(bits[:, :, 1])
    n = P * H * layout.blocks_per_head
    stored = P * layout.header_bytes + int(block_bytes(meta_k).sum() + block_bytes(meta_v).sum())
    return LayerStats(layer=layer, key_fraction=int((meta_k != RAW_MARK).sum()) / n,
                      value_fraction=int((meta_v != RAW_MARK).sum()) / n,
                      open_bytes=P * layout.open_page_bytes, compressed_bytes=stored,
                      key_spans=spans_k, value_spans=spans_v,
                      key_fraction_v1=ok_k / n, value_fraction_v1=ok_v / n,
                      compressed_bytes_v1=P * layout.page_bytes(0) - (ok_k + ok_v) * 256,
                      key_outliers=out_k, value_outliers=out_v, key_below=below_k, value_below=below_v)


def analyze_kv(layers) -> KVReport:
    """``layers``: (K, V) pairs, each [tokens, num_kv_heads, head_dim] bf16."""
    layers = list(layers)
    if not layers:
        raise ValueError("no layers to analyse")
    T, H, D = layers[0][0].shape
    stats = [layer_stats(i, k, v) for i, (k, v) in enumerate(layers)]
    return KVReport(num_kv_heads=H, head_dim=D, pages=T // PAGE_TOKENS, layers=stats)
