"""Reading a Hugging Face ``config.json`` into the few numbers the engine needs.

Rope settings come in two spellings: ``rope_theta`` + ``rope_scaling`` (Hub checkpoints,
transformers 4) and ``rope_parameters`` (what transformers 5 writes). Both end up in
:class:`RopeConfig`. Anything the engine cannot run raises ``ValueError`` naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# architecture name in config.json -> (model_type, has per-head q/k RMSNorm)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", False),
    "Qwen3ForCausalLM": ("qwen3", True),
}
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: tuple = ()
    bos_token_id: int | None = None
    torch_dtype: str | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


def _rope_from(raw: dict) -> RopeConfig:
    """Both spellings -> RopeConfig. ``rope_parameters`` wins when present."""
    params = raw.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise ValueError("config.json: rope_parameters must be an object")
        if "full_attention" in params and isinstance(params["full_attention"], dict):
            params = params["full_attention"]     # per-layer-type form: all layers are full attention here
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling = params
    else:
        theta = raw.get("rope_theta", 10000.0)
        scaling = raw.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"config.json: rope type {rope_type!r} is not supported; "
                         f"zipfusion runs {SUPPORTED_ROPE_TYPES}")
    kwargs = dict(theta=float(theta), rope_type=rope_type)
    if rope_type in ("llama3", "linear"):
        if "factor" not in scaling:
            raise ValueError(f"config.json: rope type {rope_type!r} needs a 'factor'")
        kwargs["factor"] = float(scaling["factor"])
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in scaling:
                raise ValueError(f"config.json: llama3 rope scaling needs {key!r}")
        kwargs.update(low_freq_factor=float(scaling["low_freq_factor"]),
                      high_freq_factor=float(scaling["high_freq_factor"]),
                      original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
    return RopeConfig(**kwargs)


def _eos_ids(raw: dict) -> tuple:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))


def config_from_dict(raw: dict) -> ModelConfig:
    """A parsed config.json -> ModelConfig, or ValueError naming what cannot run."""
    if not isinstance(raw, dict):
        raise TypeError(f"config must be a dict, got {type(raw).__name__}")
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type")
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        by_type = {t: a for a, (t, _) in SUPPORTED_ARCHITECTURES.items()}
        if not archs and model_type in by_type:
            arch = by_type[model_type]
        elif raw.get("auto_map"):
            raise ValueError(f"config.json: architecture {archs or model_type!r} needs remote code (trust_remote_code: "
                             f"its auto_map names {sorted(set(map(str, raw['auto_map'].values())))[:3]}), which "
                             f"zipfusion does not run; it runs {sorted(SUPPORTED_ARCHITECTURES)}")
        else:
            raise ValueError(f"config.json: architecture {archs or model_type!r} is not supported; "
                             f"zipfusion runs {sorted(SUPPORTED_ARCHITECTURES)}")
    _, qk_norm = SUPPORTED_ARCHITECTURES[arch]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"):
        if not isinstance(raw.get(key), int) or raw[key] <= 0:
            raise ValueError(f"config.json: {key!r} must be a positive integer, got {raw.get(key)!r}")
    heads = raw["num_attention_heads"]
    kv_heads = raw.get("num_key_value_heads") or heads
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    if heads % kv_heads:
        raise ValueError(f"config.json: num_attention_heads={heads} is not a multiple of "
                         f"num_key_value_heads={kv_heads}")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act {raw.get('hidden_act')!r} is not supported (only silu)")
    if raw.get("use_sliding_window"):
        raise ValueError("config.json: sliding-window attention is not supported")
    if raw.get("pretraining_tp", 1) not in (1, None):
        raise ValueError("config.json: pretraining_tp > 1 is not supported")
    return ModelConfig(
        architecture=arch, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"], num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
        rope=_rope_from(raw), qk_norm=qk_norm,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)), mlp_bias=bool(raw.get("mlp_bias", False)),
        eos_token_ids=_eos_ids(raw), bos_token_id=raw.get("bos_token_id"),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"), extra=raw)


def load_config(path: str | Path) -> ModelConfig:
    """Read ``path`` (a config.json, a folder holding one, or a .gguf file's metadata)."""
    path = Path(path)
    if path.name.lower().endswith(".gguf"):
        from .gguf import gguf_config
        return gguf_config(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no config.json at {file}; pass a Hugging Face checkpoint folder")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    cfg = config_from_dict(raw)
    gen = file.parent / "generation_config.json"
    if gen.is_file():
        try:
            eos = _eos_ids(json.loads(gen.read_text()))
        except json.JSONDecodeError:
            eos = ()
        if eos:
            cfg = ModelConfig(**{**cfg.__dict__, "eos_token_ids": tuple(dict.fromkeys(cfg.eos_token_ids + eos))})
    return cfg
