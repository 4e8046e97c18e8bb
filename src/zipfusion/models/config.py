"""Reading a Hugging Face ``config.json`` (either rope spelling) into the few numbers the engine
needs; anything it cannot run raises ``ValueError`` naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# architecture name in config.json -> (model_type, the family's options: ModelConfig fields the
# config.json does not spell out). One decoder runs them all (llama.py).
GEMMA = dict(norm_offset=1.0, sandwich_norm=True, embed_scale=True)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", {}),
    "Qwen3ForCausalLM": ("qwen3", dict(qk_norm=True)),
    "Qwen2ForCausalLM": ("qwen2", dict(qkv_bias=True)),
    "MistralForCausalLM": ("mistral", {}),
    "Phi3ForCausalLM": ("phi3", {}),
    "Gemma2ForCausalLM": ("gemma2", GEMMA),
    "Gemma3ForCausalLM": ("gemma3_text", dict(GEMMA, qk_norm=True)),
    "Qwen3MoeForCausalLM": ("qwen3_moe", dict(qk_norm=True)),
    "MixtralForCausalLM": ("mixtral", {}),
}
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# image-text checkpoints whose text model runs alone: (its architecture, the text_config defaults
# transformers fills in, which Hub configs leave out)
TEXT_OF_MULTIMODAL = {"Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", dict(
    vocab_size=262208, head_dim=256, query_pre_attn_scalar=256, rms_norm_eps=1e-6, rope_theta=1e6,
    rope_local_base_freq=1e4, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072,
    sliding_window=4096, sliding_window_pattern=6, num_key_value_heads=4, tie_word_embeddings=True))}
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
    hidden_act: str = "silu"                  # or "gelu_tanh" (GeGLU)
    sliding_windows: tuple = ()               # per layer: keys older than this many are masked (None: all seen)
    local_rope: RopeConfig | None = None      # rope of the sliding layers, where it differs (Gemma 3)
    attn_scale: float | None = None           # softmax scale (None: head_dim ** -0.5)
    attn_softcap: float | None = None         # scores -> c·tanh(scores / c) before the softmax
    final_softcap: float | None = None        # logits -> c·tanh(logits / c)
    norm_offset: float = 0.0                  # RMSNorm weight (offset + w), in fp32 (Gemma: 1)
    sandwich_norm: bool = False               # norms after attention and around the MLP (Gemma)
    embed_scale: bool = False                 # embeddings x sqrt(hidden_size), in the model dtype (Gemma)
    num_experts: int = 0                      # mixture of experts: experts a sparse layer holds
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False              # the top-k routing weights renormalised to sum to 1
    dense_layers: tuple = ()                  # layers of an MoE model that run the dense MLP
    attention_bias: bool = False              # q, k, v and o projections have biases
    qkv_bias: bool = False                    # q, k, v only (Qwen2)
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

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    def window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers


def _rope_from(raw: dict, layer_type: str = "full_attention") -> RopeConfig:
    """Both spellings -> RopeConfig. ``rope_parameters`` wins when present; its per-layer-type
    form gives ``layer_type``'s (Gemma 3: "sliding_attention" for its local layers)."""
    params = raw.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise ValueError("config.json: rope_parameters must be an object")
        if isinstance(params.get(layer_type), dict):
            params = params[layer_type]
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling = params
    elif layer_type == "sliding_attention" and "rope_local_base_freq" in raw:
        theta, scaling = raw["rope_local_base_freq"], {}         # Gemma 3's older spelling
    else:
        theta = raw.get("rope_theta", 10000.0)
        scaling = raw.get("rope_scaling") or {}
    if float(scaling.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise ValueError("config.json: partial_rotary_factor != 1 (rope over part of a head) is not supported")
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


def _layer_types(raw: dict, model_type: str, layers: int) -> list[str]:
    """Each layer's "sliding_attention" or "full_attention": config.json's ``layer_types`` (what
    transformers 5 writes), else each family's older rule."""
    if isinstance(raw.get("layer_types"), list):
        types = raw["layer_types"]
        if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
            raise ValueError(f"config.json: layer_types must list {layers} of 'sliding_attention' / 'full_attention'")
        return types
    window = raw.get("sliding_window")
    if model_type == "gemma2":
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if model_type == "gemma3_text":
        every = raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6))
        return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)]
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        start = raw.get("max_window_layers", layers) if raw.get("use_sliding_window") else layers
        return ["sliding_attention" if i >= start else "full_attention" for i in range(layers)]
    return ["sliding_attention" if window else "full_attention"] * layers     # mistral, mixtral, phi3


def config_from_dict(raw: dict) -> ModelConfig:
    """A parsed config.json -> ModelConfig, or ValueError naming what cannot run."""
    if not isinstance(raw, dict):
        raise TypeError(f"config must be a dict, got {type(raw).__name__}")
    archs = raw.get("architectures") or []
    multimodal = next((a for a in archs if a in TEXT_OF_MULTIMODAL), None)
    if multimodal is not None:                  # its text model: text_config over the defaults
        text_arch, defaults = TEXT_OF_MULTIMODAL[multimodal]
        raw = {**defaults, **{k: raw[k] for k in ("eos_token_id", "bos_token_id") if k in raw},
               **(raw.get("text_config") or {}), "architectures": [text_arch]}
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
    model_type, family = SUPPORTED_ARCHITECTURES[arch]
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
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if act not in ACTIVATIONS:
        raise ValueError(f"config.json: hidden_act {act!r} is not supported; zipfusion runs {sorted(ACTIVATIONS)}")
    layers = raw["num_hidden_layers"]
    types = _layer_types(raw, model_type, layers)
    window = raw.get("sliding_window")
    if "sliding_attention" in types and not (isinstance(window, int) and window > 0):
        raise ValueError(f"config.json: sliding-window layers need a positive sliding_window, got {window!r}")
    windows = tuple(window if t == "sliding_attention" else None for t in types)
    local_rope = _rope_from(raw, "sliding_attention") if "sliding_attention" in types else None
    experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
    moe = {}
    if experts:
        every = int(raw.get("decoder_sparse_step", 1) or 1)
        moe = dict(num_experts=experts, num_experts_per_tok=int(raw["num_experts_per_tok"]),
                   moe_intermediate_size=int(raw.get("moe_intermediate_size") or raw["intermediate_size"]),
                   norm_topk_prob=bool(raw.get("norm_topk_prob", model_type == "mixtral")),
                   dense_layers=tuple(i for i in range(layers)
                                      if i in (raw.get("mlp_only_layers") or []) or (i + 1) % every))
        if not 0 < moe["num_experts_per_tok"] <= experts:
            raise ValueError(f"config.json: num_experts_per_tok must be in 1..{experts}")
    scalar = raw.get("query_pre_attn_scalar")
    if raw.get("pretraining_tp", 1) not in (1, None):
        raise ValueError("config.json: pretraining_tp > 1 is not supported")
    return ModelConfig(
        architecture=arch, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"], num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
        rope=_rope_from(raw), qk_norm=family.get("qk_norm", False),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)), qkv_bias=family.get("qkv_bias", False),
        mlp_bias=bool(raw.get("mlp_bias", False)), hidden_act=ACTIVATIONS[act],
        sliding_windows=windows if any(windows) else (),
        local_rope=local_rope if local_rope is not None and local_rope != _rope_from(raw) else None,
        attn_scale=float(scalar) ** -0.5 if scalar else None,
        attn_softcap=raw.get("attn_logit_softcapping") or None,
        final_softcap=raw.get("final_logit_softcapping") or None,
        norm_offset=family.get("norm_offset", 0.0), sandwich_norm=family.get("sandwich_norm", False),
        embed_scale=family.get("embed_scale", False), **moe,
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
