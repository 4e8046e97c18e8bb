"""Finding, loading and randomly initialising models: a Hub id, a checkpoint folder, a ``.gguf``
file, ``"demo"`` or a shipped config with random weights (:data:`RANDOM_MODELS`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import LOAD_FORMATS
from .config import ModelConfig, load_config
from .compressed_weights import compress_model, is_compressed_checkpoint, load_compressed
from .gguf import is_gguf_path
from .layers import rope_inv_freq, weight_loaders
from .llama import STACKED, CausalLM
from .parallel import tp

PACKAGE_DIR = Path(__file__).resolve().parent
DEMO_DIR = PACKAGE_DIR / "demo"
CONFIG_DIR = PACKAGE_DIR / "configs"
# shipped configs of real models, run with random weights (benchmarks, capacity)
RANDOM_MODELS = {f"{name}-random": CONFIG_DIR / f"{name}.json" for name in (
    "llama-3.1-8b", "qwen3-8b", "qwen3-32b", "qwen2.5-7b", "mistral-7b", "phi-3-mini", "gemma-3-12b", "qwen3-30b-a3b",
    "mixtral-8x7b", "mixtral-8x7b-16l")}
INIT_STD = 0.02
PROGRESS_EVERY_S = 10.0

log = logging.getLogger("zipfusion.models")


class BuildProgress:
    """Logs that a model build starts, where it is every ``every`` seconds and how long it took."""

    def __init__(self, name: str, every: float | None = None, what: str = ""):
        self.name, self.what, self.t0 = name, what, time.perf_counter()
        self.every = PROGRESS_EVERY_S if every is None else every
        self.phase, self.done, self.total = "allocating the parameters", 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zipfusion-build-progress", daemon=True)

    def __enter__(self):
        log.info("loading model %s%s ...", self.name, f" ({self.what})" if self.what else "")
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        if exc[0] is None:
            log.info("model %s loaded in %.1f s", self.name, time.perf_counter() - self.t0)

    def step(self, phase: str, done: int, total: int) -> None:
        self.phase, self.done, self.total = phase, done, total

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            share = f": {self.done / self.total:.0%} of {self.total / 1e9:.2f}B parameters" if self.total else ""
            log.info("building model %s: %s%s (%.0f s so far)", self.name, self.phase, share,
                     time.perf_counter() - self.t0)


@dataclass
class ModelSource:
    """Where config, weights and tokenizer are. For a GGUF checkpoint all three are the .gguf file."""
    name: str
    config_path: Path
    weights_dir: Path | None  # None: random weights
    tokenizer_dir: Path | None
    compressed: bool = False


def _resolve_gguf(name: str, path: Path, load_format: str) -> ModelSource:
    from .gguf import has_tokenizer, open_gguf
    if load_format == "safetensors":
        raise ValueError(f"model {name!r} is a GGUF file; pass load_format='auto' or 'gguf'")
    open_gguf(path)  # not a GGUF file / gguf not installed: say so now
    tok = path if has_tokenizer(path) else None
    return ModelSource(name, path, None if load_format == "random" else path, tok)


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.txt"]
TOKENIZER_PATTERNS = ["*.json", "tokenizer.model", "*.jinja", "*.txt"]


def is_hub_id(name: str) -> bool:
    """``ORG/NAME`` that names no local file or folder."""
    return bool(HUB_ID.match(name)) and not Path(name).expanduser().exists()


def hub_snapshot(repo_id: str, revision: str | None = None, patterns: list[str] = HUB_PATTERNS) -> Path:
    """The local folder of a Hub snapshot at ``revision``, downloaded into the Hub cache unless
    there (HF_HUB_OFFLINE=1: the cache only)."""
    from ..config import environment
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ValueError(f"model {repo_id!r} is a Hugging Face Hub id: loading it needs huggingface_hub "
                         "(pip install huggingface_hub)") from None
    env = environment()
    try:
        folder = snapshot_download(repo_id, revision=revision, cache_dir=env.hf_cache,
                                   local_files_only=env.hf_offline, allow_patterns=patterns)
    except Exception as e:  # one line for network, auth, missing repo or revision
        where = "in the Hub cache " + str(env.hf_cache) + " (HF_HUB_OFFLINE=1)" if env.hf_offline else "on the Hub"
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise FileNotFoundError(f"model {repo_id!r}{f' revision {revision!r}' if revision else ''}: not found "
                                f"{where} ({type(e).__name__}: {first}); pass a Hub id, a checkpoint folder or "
                                "a .gguf file") from None
    return Path(folder)


def resolve_tokenizer(name: str | None) -> Path | None:
    """``--tokenizer``: a Hub id (its tokenizer files only) or a folder / .gguf file."""
    if name is None:
        return None
    if is_hub_id(name):
        return hub_snapshot(name, None, TOKENIZER_PATTERNS)
    path = Path(name).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"tokenizer {name!r}: no such folder or Hub id")
    return path


def resolve_model(model: str | Path, load_format: str = "auto", revision: str | None = None) -> ModelSource:
    """Name or path -> where config, weights and tokenizer are."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    name = str(model)
    if name == "demo":
        if not (DEMO_DIR / "config.json").is_file():
            raise FileNotFoundError(f"the demo model is missing from the package ({DEMO_DIR}); "
                                    "reinstall zipfusion")
        path = DEMO_DIR
    elif name.lower() in RANDOM_MODELS:
        return ModelSource(name.lower(), RANDOM_MODELS[name.lower()], None, None)
    elif is_hub_id(name):
        path = hub_snapshot(name, revision, TOKENIZER_PATTERNS if load_format == "random" else HUB_PATTERNS)
    else:
        path = Path(name).expanduser()
        if not path.exists():
            what = "no such GGUF file" if is_gguf_path(name) else "no such folder"
            raise FileNotFoundError(
                f"model {name!r}: {what}; pass a Hub id (ORG/NAME), a checkpoint folder (config.json + *.safetensors), "
                f"a .gguf file, 'demo', or one of {sorted(RANDOM_MODELS)}")
    if path.is_file():
        if is_gguf_path(path):
            return _resolve_gguf(name, path, load_format)
        if path.name.endswith(".json"):
            return ModelSource(name, path, None, None)
        raise ValueError(f"model {name!r} is a file; pass the checkpoint folder or a .gguf file instead")
    if load_format == "gguf" or not (path / "config.json").is_file():
        ggufs = sorted(p for p in path.glob("*") if is_gguf_path(p) and p.is_file())
        if len(ggufs) == 1:
            return _resolve_gguf(name, ggufs[0], load_format)
        if len(ggufs) > 1:
            raise ValueError(f"model folder {path} holds several GGUF files "
                             f"({', '.join(p.name for p in ggufs[:4])}); pass one of them")
        raise FileNotFoundError(f"model folder {path} has no .gguf file" if load_format == "gguf" else
                                f"model folder {path} has no config.json (and no .gguf file)")
    has_tok = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    if load_format == "random":
        return ModelSource(name, path / "config.json", None, path if has_tok else None)
    if not list(path.glob("*.safetensors")):
        raise FileNotFoundError(f"model folder {path} has no *.safetensors weights "
                                "(pass load_format='random' for random weights)")
    return ModelSource(name, path / "config.json", path, path if has_tok else None,
                       compressed=is_compressed_checkpoint(path))


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shard(s) that are missing: {missing}")
        return [folder / f for f in files]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    return files


# checkpoint spellings of the same tensors (Gemma 3's, Mixtral's experts); image parts not loaded
IMAGE_PARTS = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector)\.")
RENAMES = [(re.compile(r"^(language_model\.model|model\.language_model)\."), "model."),
           (re.compile(r"^language_model\.lm_head\."), "lm_head."),(re.compile(r"\.block_sparse_moe\."), ".mlp."), (re.compile(r"(\.experts\.\d+)\.w1\."), r"\1.gate_proj."),
           (re.compile(r"(\.experts\.\d+)\.w3\."), r"\1.up_proj."), (re.compile(r"(\.experts\.\d+)\.w2\."), r"\1.down_proj.")]
EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def stacked_name(name: str) -> tuple[str, int]:
    """Checkpoint tensor name -> (our parameter, the part of it the tensor fills)."""
    for pattern, repl in RENAMES:
        name = pattern.sub(repl, name)
    m = EXPERT.match(name)
    if m:
        e, which = int(m.group(2)), m.group(3)
        if which == "down_proj":
            return f"{m.group(1)}.down_proj", e
        return f"{m.group(1)}.gate_up_proj", 2 * e + (which == "up_proj")
    for frag, (stacked, part) in STACKED.items():
        if f".{frag}." in name:
            return name.replace(frag, stacked), part
    return name, 0


def _safetensors_tensors(folder: Path):
    from safetensors import safe_open

    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if "rotary_emb" in name or IMAGE_PARTS.match(name):
                    continue
                yield file.name, name, f.get_tensor(name)


def _gguf_tensors(file: Path, cfg: ModelConfig):
    from .gguf import iter_weights
    for name, tensor in iter_weights(file, cfg):
        yield file.name, name, tensor


def checkpoint_tensors(folder: Path, cfg: ModelConfig):
    """(file name, tensor name, tensor) of every tensor in ``folder`` or a .gguf file."""
    return _gguf_tensors(folder, cfg) if is_gguf_path(folder) else _safetensors_tensors(folder)


def load_weights(model: CausalLM, folder: Path, progress: BuildProgress | None = None) -> set[torch.dtype]:
    """Fill ``model`` from a checkpoint; every parameter must be found. Returns the checkpoint's dtypes."""
    tensors = checkpoint_tensors(folder, model.config)
    params = dict(model.named_parameters())
    loaders = weight_loaders(model)
    done: set[tuple[str, int]] = set()
    dtypes: set[torch.dtype] = set()
    total, loaded_numel = sum(p.numel() for p in params.values()), 0
    for file, name, tensor in tensors:
        if progress is not None:
            loaded_numel += tensor.numel()
            progress.step(f"loading weights from {file}", min(loaded_numel, total), total)
        target, part = stacked_name(name)
        if target == "lm_head.weight" and model.lm_head is None:
            continue
        if target not in params:
            raise ValueError(f"{file}: unexpected tensor {name!r} for {model.config.architecture}")
        param = params[target]
        dtypes.add(tensor.dtype)
        loaded = tensor.to(param.dtype)
        loader = loaders.get(target)
        sizes = getattr(param, "part_sizes", None)
        if loader is not None and sizes and target == name and loaded.shape[0] == sum(sizes):
            for i, piece in enumerate(loaded.to(param.device).split(sizes)):  # fused in the checkpoint (Phi-3)
                loader(param, piece, i)
                done.add((target, i))
            continue
        elif loader is not None:
            loader(param, loaded.to(param.device), part)
        else:
            if tuple(loaded.shape) != tuple(param.shape):
                raise ValueError(f"{file}: {name} has shape {tuple(loaded.shape)}, "
                                 f"expected {tuple(param.shape)}")
            param.data.copy_(loaded)
        done.add((target, part))
    missing = []
    for pname, p in params.items():
        parts = getattr(p, "num_parts", 1)
        missing += [f"{pname}[{i}]" if parts > 1 else pname for i in range(parts) if (pname, i) not in done]
    if missing:
        raise ValueError(f"checkpoint {folder} lacks weights for: {missing[:8]}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    return dtypes


def random_init(model: CausalLM, seed: int = 0, std: float = INIT_STD, progress: BuildProgress | None = None) -> None:
    """Normal(0, std) for matrices and embeddings, ones for norms, zeros for biases."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    total, done = sum(p.numel() for p in model.parameters()), 0
    loaders = weight_loaders(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if progress is not None:
                progress.step("random weights", done, total)
                done += p.numel()
            if name.endswith("norm.weight"):
                p.fill_(1.0 - model.config.norm_offset)
            elif name.endswith("bias"):
                p.zero_()
            elif getattr(p, "full_shape", None) is not None and tuple(p.full_shape) != tuple(p.shape):
# a tensor-parallel shard: the whole tensor as at TP=1, this rank's part kept
                full = torch.empty(p.full_shape, dtype=p.dtype, device=p.device).normal_(0.0, std, generator=gen)
                parts = full.split(p.part_sizes) if p.part_sizes else [full]
                for i, part in enumerate(parts):
                    loaders[name](p, part, i)
            else:
                p.normal_(0.0, std, generator=gen)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(source: ModelSource | str, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                seed: int = 0, deterministic: bool = False, weight_compression: bool = False) -> CausalLM:
    """Construct the model on ``device`` in ``dtype`` and load or randomly initialise its weights
    (``weight_compression``: then compress them)."""
    if isinstance(source, str):
        source = resolve_model(source)
    cfg = load_config(source.config_path)
    dt = str(dtype).replace("torch.", "")
    if source.compressed:
        return _build_compressed(source, cfg, dtype, device, deterministic)
    gguf = source.weights_dir is not None and is_gguf_path(source.weights_dir)
    what = (f"random weights, {dt}" if source.weights_dir is None else f"GGUF, dequantized to {dt}"
            if gguf else f"safetensors, {dt}")
    with BuildProgress(source.name if source.weights_dir is None else Path(source.name).name,
                       what=f"{what}, on {device}") as progress:
        with torch.device(device), default_dtype(dtype):
            model = CausalLM(cfg, deterministic=deterministic)
        model.to(dtype=dtype)
        _set_rope(model, cfg)
        dtypes = set()
        if source.weights_dir is None:
            random_init(model, seed=seed, progress=progress)
        else:
            dtypes = load_weights(model, source.weights_dir, progress=progress)
        if weight_compression:
            progress.step("compressing the weights", 0, 0)
            compress_model(model, note=compression_note(gguf, dtypes))
    return model.eval().requires_grad_(False)


def _set_rope(model: CausalLM, cfg: ModelConfig) -> None:
    """Rope frequencies in fp32, computed afresh (a dtype conversion would round them)."""
    model.rotary.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope).to(model.rotary.inv_freq.device)
    if model.local_rotary is not None:
        model.local_rotary.inv_freq = rope_inv_freq(cfg.head_dim, cfg.local_rope).to(model.rotary.inv_freq.device)


def compression_note(gguf: bool, dtypes: set[torch.dtype]) -> str:
    if gguf:
        return " (GGUF: its tensors dequantized to bfloat16 first)"
    cast = ", ".join(sorted(str(d).replace("torch.", "") for d in dtypes - {torch.bfloat16}))
    return f" (the checkpoint's {cast} tensors cast to bfloat16 first)" if cast else ""


def _build_compressed(source: ModelSource, cfg: ModelConfig, dtype: torch.dtype, device, deterministic: bool):
    """A compressed checkpoint, loaded as written (BF16, one rank)."""
    if dtype != torch.bfloat16:
        raise ValueError(f"model {source.name!r} is a compressed checkpoint (BF16 weights); pass dtype='bfloat16'")
    if tp().size > 1:
        raise ValueError(f"model {source.name!r} is a compressed checkpoint, which loads on one GPU; with "
                         "tensor_parallel_size > 1 pass its source model (each rank compresses its shard)")
    with BuildProgress(Path(source.name).name, what=f"compressed checkpoint, on {device}") as progress:
        with torch.device("meta"), default_dtype(dtype):
            model = CausalLM(cfg, deterministic=deterministic)
        model.to(dtype=dtype)
        load_compressed(model, source.weights_dir, torch.device(device), progress=progress)
        _set_rope(model, cfg)
    return model.eval().requires_grad_(False)


def model_config(source: ModelSource | str) -> ModelConfig:
    if isinstance(source, str):
        source = resolve_model(source)
    return load_config(source.config_path)
