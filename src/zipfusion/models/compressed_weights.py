"""Compressed weights in a model: the linear layers' and embeddings' BF16 matrices replaced by
:class:`~zipfusion.format.weights.CompressedWeight` (``models.layers.linear`` / ``embedding``
dispatch on the type), and the compressed checkpoint: config, tokenizer, safetensors of the
planes (``NAME.lo``, ...) and of every other parameter, and :data:`MANIFEST` (versions, the
source's identity, file sizes, each tensor's SHA-256), refused in one line where they disagree.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..format.weights import FORMAT_VERSION, WEIGHT_BLOCK, CompressedWeight, compress_weight
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

WEIGHT_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)
# module name fragment -> tensor kind (the analyzer's rows)
KINDS = {"qkv_proj": "qkv", "o_proj": "o", "gate_up_proj": "gate_up", "down_proj": "down",
         "embed_tokens": "embed", "lm_head": "lm_head"}
MANIFEST = "zipfusion_weights.json"
CHECKPOINT_FORMAT = "zipfusion-compressed-weights"
CHECKPOINT_VERSION = 1
SHARD_BYTES = 2 << 30              # safetensors file size the writer aims at
PLANES = tuple(f.name for f in dataclasses.fields(CompressedWeight) if f.name != "shape")

log = logging.getLogger("zipfusion.models")


@dataclass
class WeightSizes:
    """The model's weight matrices: bytes as BF16 and as held, and those left uncompressed (why)."""
    original_bytes: int = 0
    stored_bytes: int = 0
    compressed: int = 0
    kept: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.stored_bytes / self.original_bytes if self.original_bytes else 1.0

    @property
    def saved_bytes(self) -> int:
        return self.original_bytes - self.stored_bytes


def kind_of(name: str) -> str:
    """``model.layers.3.self_attn.qkv_proj`` -> ``qkv`` (see :data:`KINDS`)."""
    return next((k for frag, k in KINDS.items() if frag in name.split(".")), "other")


def weight_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, WEIGHT_LAYERS)]


def why_not_compressible(w: torch.Tensor) -> str | None:
    """Why ``w`` stays as it is (None: compress it): the format covers 2-D BF16 matrices whose
    rows hold at least one whole block."""
    if w.dim() != 2 or w.dtype != torch.bfloat16:
        return f"{w.dtype} {tuple(w.shape)}, not a 2-D bfloat16 matrix"
    if w.shape[1] < WEIGHT_BLOCK:
        return f"rows of {w.shape[1]} values, fewer than a block ({WEIGHT_BLOCK})"
    return None


def set_weight(module: nn.Module, weight: CompressedWeight) -> None:
    """Replace ``module.weight`` (a parameter) by ``weight``; the parameter is let go of."""
    module._parameters.pop("weight", None)
    module.weight = weight


def compressed_weights(model: nn.Module) -> list[tuple[CompressedWeight, torch.Tensor | None]]:
    """The compressed layers' (weight, bias or None) pairs."""
    return [(m.weight, getattr(m, "bias", None)) for _, m in weight_modules(model)
            if isinstance(m.weight, CompressedWeight)]


def other_matrices(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Weight tensors outside the linear layers (MoE experts' stacked matrices): held as they are."""
    inside = {id(m.weight) for _, m in weight_modules(model)}
    return [(n, p) for n, p in model.named_parameters() if p.dim() >= 2 and id(p) not in inside]


def weight_sizes(model: nn.Module) -> WeightSizes:
    """The weight matrices' sizes: the linear layers' and embeddings', and any other (experts)."""
    sizes = WeightSizes()
    for _, p in other_matrices(model):
        sizes.original_bytes += p.numel() * p.element_size()
        sizes.stored_bytes += p.numel() * p.element_size()
    for _, m in weight_modules(model):
        w = m.weight
        if isinstance(w, CompressedWeight):
            sizes.original_bytes += w.original_nbytes
            sizes.stored_bytes += w.nbytes
            sizes.compressed += 1
        else:
            sizes.original_bytes += w.numel() * w.element_size()
            sizes.stored_bytes += w.numel() * w.element_size()
    return sizes


def compress_model(model: nn.Module, note: str = "") -> WeightSizes:
    """Compress every weight matrix of ``model`` in place on its device, one at a time (the BF16
    copy freed before the next), with a progress bar; a tensor the format cannot hold or that
    would not shrink stays as it is, named in one log line. ``note``: said in the log line."""
    from tqdm.auto import tqdm

    kept = [f"{n} (not a linear layer's: MoE router or stacked experts)" for n, _ in other_matrices(model)]
    modules = [(n, m) for n, m in weight_modules(model) if not isinstance(m.weight, CompressedWeight)]
    on_cuda = any(m.weight.is_cuda for _, m in modules)
    # the planes go to a pool of their own: the freed BF16 copies leave whole segments that
    # empty_cache gives back, not holes between planes that the KV arena could not use
    pool = torch.cuda.MemPool() if on_cuda else None
    for name, module in tqdm(modules, desc="compressing weights", unit="tensor", mininterval=2.0, leave=False):
        w = module.weight
        why = why_not_compressible(w)
        cw = compress_weight(w.detach()) if why is None else None
        if cw is not None and cw.nbytes >= w.numel() * w.element_size():
            why = "not smaller compressed"
        if why:
            kept.append(f"{name}.weight ({why})")
            continue
        if pool is not None and cw.device.type == "cuda":
            with torch.cuda.use_mem_pool(pool, device=cw.device):
                cw = dataclasses.replace(cw, **{f: getattr(cw, f).clone() for f in PLANES})
        set_weight(module, cw)
        del w, cw
        if pool is not None:
            torch.cuda.empty_cache()              # the freed copy's segment, for the pool's next planes
    if on_cuda:
        model._weight_pool = pool                 # lives as long as the planes
        torch.cuda.empty_cache()                  # the freed BF16 copies: free for the KV budget
    sizes = weight_sizes(model)
    sizes.kept = kept
    if kept:
        log.info("weights left uncompressed (%d): %s", len(kept), "; ".join(kept))
    log.info("weights compressed%s: %d of %d matrices, %.3f GiB -> %.3f GiB (%.3f)", note, sizes.compressed,
             len(modules), sizes.original_bytes / 2**30, sizes.stored_bytes / 2**30, sizes.ratio)
    return sizes


# -- the compressed checkpoint ------------------------------------------------------------------------
def tensors_identity(model: nn.Module) -> str:
    """A hash of every weight's name, shape and dtype (a compressed one as the BF16 it holds): the
    same for the model compressed and for its uncompressed skeleton."""
    rows = [(n, list(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    rows += [(f"{n}.weight", list(m.weight.shape), "torch.bfloat16") for n, m in weight_modules(model)
             if isinstance(m.weight, CompressedWeight)]
    return _sha(json.dumps(sorted(rows)).encode())


def _sha(data) -> str:
    return hashlib.sha256(data).hexdigest()


def _tensor_sha(t: torch.Tensor) -> str:
    return _sha(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def _stored_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a compressed checkpoint holds: every plane of every compressed weight, every parameter."""
    out = {n: p.detach() for n, p in model.named_parameters()}
    for n, m in weight_modules(model):
        if isinstance(m.weight, CompressedWeight):
            out.update({f"{n}.weight.{k}": t for k, t in m.weight.tensors().items()})
    return out


def save_compressed(model: nn.Module, source, out: str | Path, tokenizer=None) -> dict:
    """Write ``model`` (compressed: :func:`compress_model`) built from ``source`` (a
    loader.ModelSource) as a compressed checkpoint in the new folder ``out``; returns the manifest."""
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out} is not empty; pass a new folder")
    out.mkdir(parents=True, exist_ok=True)
    config_bytes = json.dumps(model.config.extra, indent=2, sort_keys=True).encode()
    (out / "config.json").write_bytes(config_bytes)
    gen = Path(source.config_path).parent / "generation_config.json"
    if Path(source.config_path).name == "config.json" and gen.is_file():
        shutil.copy(gen, out / "generation_config.json")
    if tokenizer is not None:
        tokenizer.save(out)
    tensors = _stored_tensors(model)
    shards, size = [[]], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    entries, files = {}, {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        part = {n: tensors[n].cpu().contiguous() for n in names}
        save_file(part, str(out / file))
        files[file] = (out / file).stat().st_size
        entries.update({n: {"file": file, "sha256": _tensor_sha(t)} for n, t in part.items()})
    sizes = weight_sizes(model)
    manifest = {
        "format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "weight_format_version": FORMAT_VERSION,
        "source": {"name": source.name, "config_sha256": _sha(config_bytes),
                   "tensors_sha256": tensors_identity(model)},
        "compressed": sorted(f"{n}.weight" for n, m in weight_modules(model) if isinstance(m.weight, CompressedWeight)),
        "original_bytes": sizes.original_bytes, "stored_bytes": sizes.stored_bytes,
        "files": files, "tensors": entries,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def is_compressed_checkpoint(folder: Path) -> bool:
    return (Path(folder) / MANIFEST).is_file()


def read_manifest(folder: Path) -> dict:
    """The folder's manifest, checked against the folder (ValueError, one line, if it disagrees)."""
    folder = Path(folder)
    where = f"compressed checkpoint {folder}"
    try:
        m = json.loads((folder / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: {MANIFEST} cannot be read ({exc}); write it again with "
                         "zipfusion compress-weights") from None
    if not isinstance(m, dict) or m.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{where}: {MANIFEST} is not a {CHECKPOINT_FORMAT} manifest")
    if m.get("version") != CHECKPOINT_VERSION or m.get("weight_format_version") != FORMAT_VERSION:
        raise ValueError(f"{where}: unknown format version {m.get('version')}/{m.get('weight_format_version')} "
                         f"(this zipfusion reads {CHECKPOINT_VERSION}/{FORMAT_VERSION}); write it again with "
                         "zipfusion compress-weights from the source model")
    shape = {"source": dict, "files": dict, "tensors": dict, "compressed": list}
    if any(not isinstance(m.get(k), t) for k, t in shape.items()) or not all(
            isinstance(m["source"].get(k), str) for k in ("name", "config_sha256", "tensors_sha256")):
        raise ValueError(f"{where}: {MANIFEST} lacks entries it must have (source, files, tensors, compressed); "
                         "write it again with zipfusion compress-weights")
    try:
        config_sha = _sha((folder / "config.json").read_bytes())
    except OSError:
        raise ValueError(f"{where}: config.json is missing") from None
    if config_sha != m["source"]["config_sha256"]:
        raise ValueError(f"{where}: config.json is not the one its weights were written for (its hash differs "
                         f"from the manifest's, model {m['source']['name']!r}); the folder mixes two models")
    for file, size in m["files"].items():
        path = folder / file
        actual = path.stat().st_size if path.is_file() else None
        if actual != size:
            raise ValueError(f"{where}: {file} is " + ("missing" if actual is None else f"{actual} bytes") +
                             f", the manifest says {size} (truncated or damaged); copy or write it again")
    return m


def load_compressed(model: nn.Module, folder: Path, device: torch.device, progress=None) -> WeightSizes:
    """Fill ``model`` (built on the meta device) from the compressed checkpoint in ``folder``,
    every tensor's SHA-256 checked (ValueError, one line, naming what is wrong)."""
    from safetensors import SafetensorError, safe_open

    m = read_manifest(folder)
    where = f"compressed checkpoint {folder}"
    if tensors_identity(model) != m["source"]["tensors_sha256"]:
        raise ValueError(f"{where}: its tensors are not this model's (names, shapes or dtypes differ from "
                         f"config.json's model); write it again with zipfusion compress-weights")
    compressed = {name.removesuffix(".weight") for name in m["compressed"]}
    expected = {f"{n}.weight.{k}" for n in compressed for k in PLANES}
    expected |= {n for n, _ in model.named_parameters() if n.removesuffix(".weight") not in compressed}
    if expected != set(m["tensors"]):
        raise ValueError(f"{where}: its manifest lists other tensors than this model's "
                         f"({len(set(m['tensors']) ^ expected)} differ); write it again with "
                         "zipfusion compress-weights")
    handles, tensors = {}, {}
    try:
        for i, (name, entry) in enumerate(m["tensors"].items()):
            file = entry["file"]
            if file not in handles:
                handles[file] = safe_open(str(folder / file), framework="pt")
            t = handles[file].get_tensor(name)
            if _tensor_sha(t) != entry["sha256"]:
                raise ValueError(f"{where}: checksum mismatch in {name} ({file}): the file is damaged; "
                                 "copy or write it again")
            tensors[name] = t.to(device)
            if progress is not None:
                progress.step("loading compressed weights", i + 1, len(m["tensors"]))
    except SafetensorError as exc:
        raise ValueError(f"{where}: a weight file cannot be read ({exc}); copy or write it again") from None
    finally:
        handles.clear()
    for name, module in weight_modules(model):
        if name in compressed:
            planes = {k: tensors.pop(f"{name}.weight.{k}") for k in PLANES}
            set_weight(module, CompressedWeight(tuple(module.weight.shape), **planes))
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[name])
    sizes = weight_sizes(model)
    log.info("weights loaded compressed: %d tensors, %.3f GiB -> %.3f GiB (%.3f)", sizes.compressed,
             sizes.original_bytes / 2**30, sizes.stored_bytes / 2**30, sizes.ratio)
    return sizes

