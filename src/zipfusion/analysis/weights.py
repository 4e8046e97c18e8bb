"""How well a checkpoint's weights compress in the weight format, per tensor kind and layer, as the
engine would store them; ``layers`` samples that many layers and estimates the total from them.
"""

from __future__ import annotations

import re
from pathlib import Path
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from ..format.weights import compress_weight
from ..models import model_config, resolve_model
from ..models.compressed_weights import KINDS, kind_of, weight_modules, why_not_compressible
from ..models.loader import INIT_STD, checkpoint_tensors, default_dtype, stacked_name
from .kv_stats import require_matplotlib

KIND_ORDER = list(KINDS.values())


@dataclass
class TensorStat:
    name: str
    kind: str
    layer: int | None
    shape: tuple[int, int]
    original_bytes: int
    stored_bytes: int
    escapes: int
    note: str = ""                # why it stays uncompressed, if it does

    @property
    def ratio(self) -> float:
        return self.stored_bytes / self.original_bytes


@dataclass
class WeightReport:
    model: str
    num_layers: int
    layers: list[int]
    device: str
    seconds: float
    tensors: list[TensorStat] = field(default_factory=list)

    def by_kind(self) -> dict[str, dict]:
        out = {}
        for kind in KIND_ORDER:
            ts = [t for t in self.tensors if t.kind == kind]
            if ts:
                o, s = sum(t.original_bytes for t in ts), sum(t.stored_bytes for t in ts)
                n = sum(t.shape[0] * t.shape[1] for t in ts)
                out[kind] = {"tensors": len(ts), "original_bytes": o, "stored_bytes": s, "ratio": s / o,
                             "escape_share": sum(t.escapes for t in ts) / n}
        return out

    def estimated_total(self) -> tuple[int, int]:
        """(BF16 bytes, stored bytes) of the whole model: the per-layer kinds scaled from the
        sampled layers to all of them."""
        scale = self.num_layers / len(self.layers) if self.layers else 1.0
        o = s = 0.0
        for kind, k in self.by_kind().items():
            f = 1.0 if kind in ("embed", "lm_head") else scale
            o, s = o + f * k["original_bytes"], s + f * k["stored_bytes"]
        return int(o), int(s)

    def to_dict(self) -> dict:
        o, s = self.estimated_total()
        return {"model": self.model, "num_layers": self.num_layers, "layers": self.layers, "device": self.device,
                "seconds": self.seconds, "by_kind": self.by_kind(),
                "model_bytes": o, "model_stored_bytes": s, "model_ratio": s / o if o else 1.0,
                "tensors": [{**t.__dict__, "ratio": t.ratio} for t in self.tensors]}

    def render(self) -> str:
        o, s = self.estimated_total()
        sampled = (f"all {self.num_layers} layers" if len(self.layers) == self.num_layers else
                   f"{len(self.layers)} of {self.num_layers} layers sampled ({', '.join(map(str, self.layers))})")
        lines = [f"weights of {self.model}: {sampled}, in the weight format (stored / BF16 bytes)",
                 f"{'kind':<9}{'tensors':>8}{'BF16 MiB':>12}{'stored MiB':>12}{'ratio':>8}{'escapes':>10}"]
        for kind, k in self.by_kind().items():
            lines.append(f"{kind:<9}{k['tensors']:>8}{k['original_bytes'] / 2**20:>12,.1f}"
                         f"{k['stored_bytes'] / 2**20:>12,.1f}{k['ratio']:>8.3f}{k['escape_share']:>10.4%}")
        est = "" if len(self.layers) == self.num_layers else " (estimated)"
        lines.append(f"model{est}: {_size(o)} -> {_size(s)} ({s / o:.3f})")
        kinds = [k for k in KIND_ORDER if k not in ("embed", "lm_head") and any(t.kind == k for t in self.tensors)]
        lines.append("per layer: ratio (escape share)")
        lines.append(f"{'layer':<7}" + "".join(f"{k:>20}" for k in kinds))
        per = {(t.layer, t.kind): t for t in self.tensors}
        for layer in self.layers:
            cells = [per.get((layer, k)) for k in kinds]
            lines.append(f"{layer:<7}" + "".join(
                f"{t.ratio:>10.3f} ({t.escapes / (t.shape[0] * t.shape[1]):.3%})".rjust(20) if t else " " * 20
                for t in cells))
        kept = [t for t in self.tensors if t.note]
        if kept:
            lines.append("left uncompressed: " + "; ".join(f"{t.name} ({t.note})" for t in kept))
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        require_matplotlib()
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.4))
        for kind in KIND_ORDER:
            ts = sorted((t for t in self.tensors if t.kind == kind and t.layer is not None), key=lambda t: t.layer)
            if ts:
                ax1.plot([t.layer for t in ts], [t.ratio for t in ts], "o-", label=kind)
                ax2.plot([t.layer for t in ts], [100 * t.escapes / (t.shape[0] * t.shape[1]) for t in ts], "o-",
                         label=kind)
        for kind, k in self.by_kind().items():
            if kind in ("embed", "lm_head"):
                ax1.axhline(k["ratio"], ls=":", color="gray")
                ax1.annotate(kind, (0, k["ratio"]), fontsize=8, color="gray")
        ax1.axhline(0.75, color="k", ls="--", lw=1, label="floor (12 bits a value)")
        o, s = self.estimated_total()
        ax1.set(xlabel="layer", ylabel="stored / BF16 bytes", title=f"{self.model}: weights {s / o:.3f} of BF16")
        ax2.set(xlabel="layer", ylabel="values escaped (%)", title="escape share per layer")
        from matplotlib.ticker import MaxNLocator
        for ax in (ax1, ax2):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def _size(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.2f} MiB"


def sample_layers(num_layers: int, n: int | None) -> list[int]:
    """``n`` layers spread evenly over ``num_layers``, first and last included (None: all)."""
    if n is None or n >= num_layers:
        return list(range(num_layers))
    if n < 1:
        raise ValueError(f"--layers must be >= 1, got {n}")
    return sorted({round(i * (num_layers - 1) / max(1, n - 1)) for i in range(n)})


def _layer_of(name: str) -> int | None:
    m = re.search(r"\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def _matrices(source, cfg, layers: set[int], device, seed: int):
    """(our parameter name, 2-D BF16 tensor on ``device``) of every weight matrix in ``layers``
    plus the embedding and LM head: from the checkpoint (q|k|v, gate|up stacked), or drawn."""
    if source.weights_dir is None:
        from ..models.llama import CausalLM
        with torch.device("meta"), default_dtype(torch.bfloat16):
            skeleton = CausalLM(cfg)
        gen = torch.Generator(device=device).manual_seed(seed)
        for name, module in weight_modules(skeleton):
            if _layer_of(name) in layers or _layer_of(name) is None:
                w = torch.empty(module.weight.shape, dtype=torch.bfloat16, device=device)
                yield f"{name}.weight", w.normal_(0.0, INIT_STD, generator=gen)
        return
    parts: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    expected = {"qkv_proj": 3, "gate_up_proj": 2}
    for _, name, tensor in checkpoint_tensors(source.weights_dir, cfg):
        target, part = stacked_name(name)
        layer = _layer_of(target)
        if tensor.dim() != 2 or (layer is not None and layer not in layers) or kind_of(target) == "other":
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        parts[target][part] = tensor.to(torch.bfloat16)
        need = next((n for frag, n in expected.items() if frag in target), 1)
        if len(parts[target]) == need:
            got = parts.pop(target)
            yield target, torch.cat([got[i] for i in range(need)]).to(device)


def analyze_weights(model: str, device: str = "cpu", load_format: str = "auto", layers: int | None = None,
                    seed: int = 0) -> WeightReport:
    source = resolve_model(model, load_format)
    if source.compressed:
        raise ValueError(f"{model} is a compressed checkpoint already: its manifest lists its sizes; "
                         "analyze its source model")
    cfg = model_config(source)
    chosen = sample_layers(cfg.num_hidden_layers, layers)
    t0 = time.perf_counter()
    report = WeightReport(Path(source.name).name, cfg.num_hidden_layers, chosen, str(device), 0.0)
    for name, w in _matrices(source, cfg, set(chosen), torch.device(device), seed):
        module = name.removesuffix(".weight")
        why = why_not_compressible(w)
        cw = None if why else compress_weight(w)
        stored = w.numel() * 2 if cw is None or cw.nbytes >= w.numel() * 2 else cw.nbytes
        report.tensors.append(TensorStat(name, kind_of(module), _layer_of(name), tuple(w.shape), w.numel() * 2,
                                         stored, cw.num_escapes if cw is not None else 0,
                                         why or ("not smaller compressed" if stored == w.numel() * 2 else "")))
        del w, cw
    report.seconds = time.perf_counter() - t0
    return report
