"""FP8 + lossless: how small the lossless block format stores a model's KV quantized to E4M3
(``zipfusion analyze --kv-dtype fp8``), per-tensor (1.0) and per-head scales, under each block
design; reported as stored / FP8 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..format.fp8 import head_scales, quantize_e4m3
from ..format.fp8_blocks import DESIGNS, MODE_NAMES, PAGE_ALIGN, block_sizes, exponent_field, fp8_block_meta, record_bytes
from ..format.layout import PAGE_TOKENS, to_blocks
from .kv_stats import full_pages

SCALES = ("tensor", "head")


@dataclass
class FP8LayerStats:
    layer: int
    fp8_bytes: int
    stored: dict = field(default_factory=dict)         # (scale, design) -> (K bytes, V bytes), records split evenly
    modes: dict = field(default_factory=dict)  # scale -> [4] adaptive blocks per mode
    escapes: dict = field(default_factory=dict)
    entropy_bits: dict = field(default_factory=dict)  # scale -> summed per-block exponent entropy
    blocks: int = 0

    def ratio(self, scale: str, design: str) -> float:
        return sum(self.stored[scale, design]) / self.fp8_bytes


def _pages(x: torch.Tensor, P: int) -> torch.Tensor:
    return x[:P * PAGE_TOKENS]


def fp8_layer_stats(layer: int, k: torch.Tensor, v: torch.Tensor) -> FP8LayerStats:
    """One layer's K and V ([tokens, H, D], any float dtype) under every scale and design."""
    H, D, layout, P = full_pages(k, v)
    k, v = _pages(k, P), _pages(v, P)
    stats = FP8LayerStats(layer=layer, fp8_bytes=P * 2 * PAGE_TOKENS * H * D)
    records = P * H * record_bytes(layout)
    for scale in SCALES:
        qk = quantize_e4m3(k, head_scales(k) if scale == "head" else 1.0)
        qv = quantize_e4m3(v, head_scales(v) if scale == "head" else 1.0)
        pages = torch.stack([qk, qv]).view(2, P, PAGE_TOKENS, H, D).transpose(0, 1).contiguous()
        for design in DESIGNS:
            meta = fp8_block_meta(pages, design)
            size = block_sizes(meta)
            page = 2 * H * record_bytes(layout) + size.flatten(1).sum(1)  # [P], before padding
            pad = int((-page % PAGE_ALIGN).sum())  # counted with V, the page's end
            stats.stored[scale, design] = (records + int(size[:, :, 0].sum()), records + int(size[:, :, 1].sum()) + pad)
            if design == "adaptive":
                stats.modes[scale] = torch.bincount(((meta >> 4) & 3).flatten(), minlength=4).tolist()
                stats.escapes[scale] = int((meta >> 6).sum())
        stats.entropy_bits[scale] = float(block_entropy(to_blocks(pages)).sum())
    stats.blocks = P * layout.num_blocks
    return stats


def block_entropy(blocks: torch.Tensor) -> torch.Tensor:
    """E4M3 blocks [..., 512] -> each block's exponent entropy in bits per value (a reference)."""
    e = exponent_field(blocks)
    p = torch.nn.functional.one_hot(e, 16).sum(-2).double() / e.shape[-1]
    return -(p * torch.log2(p.clamp(min=1e-300))).sum(-1)


@dataclass
class FP8Report:
    layers: list[FP8LayerStats]

    def ratio(self, scale: str, design: str, role: int | None = None) -> float:
        """Stored / FP8 bytes over all layers (``role``: that half alone)."""
        total = sum(s.fp8_bytes for s in self.layers)
        if role is None:
            return sum(sum(s.stored[scale, design]) for s in self.layers) / total
        return sum(s.stored[scale, design][role] for s in self.layers) / (total / 2)

    def entropy_reference(self, scale: str) -> float:
        bits = sum(s.entropy_bits[scale] for s in self.layers) / sum(s.blocks for s in self.layers)
        return (4 + bits) / 8

    def as_dict(self) -> dict:
        """Plain numbers for JSON."""
        out = {"ratio_is": "stored bytes / FP8 bytes (full pages, records included)", "scales": {}}
        for scale in SCALES:
            modes = [sum(s.modes[scale][m] for s in self.layers) for m in range(4)]
            out["scales"][scale] = {
                "designs": {d: {"ratio": self.ratio(scale, d), "key": self.ratio(scale, d, 0),
                                "value": self.ratio(scale, d, 1),
                                "layers": [s.ratio(scale, d) for s in self.layers]} for d in DESIGNS},
                "adaptive_blocks_by_mode": dict(zip(MODE_NAMES, (m / sum(modes) for m in modes))),
                "adaptive_escape_nibbles_per_block": 8 * sum(s.escapes[scale] for s in self.layers) / sum(modes),
                "block_entropy_reference": self.entropy_reference(scale),
            }
        return out

    def render(self) -> str:
        designs = list(DESIGNS)
        lines = ["FP8 E4M3 + lossless blocks: stored / FP8 bytes (scale tensor = 1.0; head = amax/448 per "
                 "layer, KV head, K/V)",
                 f"{'layer':>5} " + " ".join(f"{s[:4] + ' ' + d:>13}" for s in SCALES for d in designs)]
        for st in self.layers:
            lines.append(f"{st.layer:>5} " + " ".join(f"{st.ratio(s, d):>13.1%}" for s in SCALES for d in designs))
        for s in SCALES:
            parts = ", ".join(f"{d} {self.ratio(s, d):.1%} (K {self.ratio(s, d, 0):.1%}, V {self.ratio(s, d, 1):.1%})"
                              for d in designs)
            lines.append(f"all   scale {s}: {parts}; ideal per-block entropy coder {self.entropy_reference(s):.1%}")
        best = self.ratio("tensor", "adaptive")
        lines.append(f"FP8-lossless (adaptive, scale 1.0) stores {best:.1%} of FP8 = {best / 2:.1%} of BF16; "
                     f"goal <= 90%: {'met' if best <= 0.90 else 'not met'}")
        return "\n".join(lines)

    def plot(self, path: str, title: str = "FP8 + lossless") -> None:
        """PNG: per layer, stored / FP8 bytes of each design."""
        from .kv_stats import require_matplotlib
        require_matplotlib()
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator, PercentFormatter

        fig, ax = plt.subplots(figsize=(11, 4.4))
        idx = [s.layer for s in self.layers]
        width = 0.8 / len(DESIGNS)
        for i, d in enumerate(DESIGNS):
            ax.bar([x + (i - 1.5) * width for x in idx], [s.ratio("tensor", d) for s in self.layers], width,
                   label=f"{d}, scale 1.0: {self.ratio('tensor', d):.1%}")
        ax.plot(idx, [s.ratio("head", "adaptive") for s in self.layers], "k.-",
                label=f"adaptive, per-head scale: {self.ratio('head', 'adaptive'):.1%}")
        ax.axhline(0.90, color="r", ls="--", lw=1, label="goal 90 %")
        ax.axhline(0.75, color="k", ls=":", lw=1, label="2-bit floor 75 %")
        ax.set(xlabel="layer", ylabel="stored / FP8 bytes", ylim=(0.70, 1.0), title=title)
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=8, ncol=3, loc="upper center")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def analyze_fp8(layers) -> FP8Report:
    """``layers``: (K, V) pairs, each [tokens, num_kv_heads, head_dim]."""
    layers = list(layers)
    if not layers:
        raise ValueError("no layers to analyse")
    return FP8Report([fp8_layer_stats(i, k, v) for i, (k, v) in enumerate(layers)])
