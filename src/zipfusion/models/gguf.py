"""GGUF checkpoints: config, weights and tokenizer from one file, turned into what a Hugging Face
checkpoint would give (llama.cpp's q/k row order undone, Gemma's 1 + w norms loaded as w).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import numpy as np
import torch

GGUF_MAGIC = b"GGUF"
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM"}
GEMMA = ("gemma2", "gemma3")  # stored as 1 + w: loaded back as w
MOE_ARCHITECTURES = {"llama": "MixtralForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}  # with expert_count > 0
PIP_HINT = "pip install gguf  (or, from the zipfusion checkout: pip install -e '.[models]')"

# GGUF tensor name (N: the layer) -> Hugging Face name
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_qkv": "self_attn.qkv_proj", "ffn_gate_inp": "mlp.gate",
}
# per architecture, names that mean another tensor there (Phi-3's ffn_up holds gate|up)
_GEMMA_LAYER = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_ARCH_LAYER = {"phi3": {"ffn_up": "mlp.gate_up_proj"}, "gemma2": _GEMMA_LAYER, "gemma3": _GEMMA_LAYER}
# stacked experts [E, rows, cols] -> expert e's tensor
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
ROPE_FREQS = "rope_freqs.weight"


class MissingDependencyError(ImportError, ValueError):
    """An optional package is missing (a ValueError too: the CLI prints it as one line)."""


def _gguf():
    try:
        import gguf
        import gguf.quants  # noqa: F401
    except ImportError:
        raise MissingDependencyError(f"reading GGUF files needs the gguf package: {PIP_HINT}") from None
    return gguf


def is_gguf_path(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")


class GGUFFile:
    """One opened GGUF file: scalar metadata, tensors by name, dequantization."""

    def __init__(self, path: Path):
        gguf = _gguf()
        self.path = path
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
        try:
            self.reader = gguf.GGUFReader(str(path))
        except Exception as e:  # truncated or corrupt
            raise ValueError(f"{path} is not a valid GGUF file (truncated or corrupt?): "
                             f"{type(e).__name__}: {e}") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        self._types = gguf.GGMLQuantizationType

    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def get(self, key: str, default=None):
        """A scalar, string or (short) array value; ``default`` when absent."""
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as e:
            raise ValueError(f"{self.path}: metadata {key!r} cannot be read ({e})") from None

    @property
    def architecture(self) -> str:
        arch = self.get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError(f"{self.path}: no general.architecture in the GGUF metadata")
        return arch

    def tensor_type(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def supported_types(self) -> set:
        import gguf.quants as q
        T = self._types
        return {T.F32, T.F16} | set(q._type_traits)

    def check_types(self) -> None:
        ok = self.supported_types()
        bad = sorted({t.tensor_type.name for t in self.tensors.values() if t.tensor_type not in ok})
        if bad:
            first = next(t.name for t in self.tensors.values() if t.tensor_type.name == bad[0])
            raise ValueError(f"{self.path}: quantization type(s) {bad} (e.g. tensor {first!r}) cannot be "
                             f"dequantized; supported: {sorted(t.name for t in ok)}")

    def dequantize(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as fp32, in torch's [rows, columns] order."""
        import gguf.quants as q
        t = self.tensors[name]
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists the fastest dimension first
        try:
            arr = q.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ValueError(f"{self.path}: tensor {name!r} has quantization type {t.tensor_type.name}, "
                             "which cannot be dequantized") from None
        arr = np.asarray(arr, dtype=np.float32)
        if arr.size != int(np.prod(shape)):
            raise ValueError(f"{self.path}: tensor {name!r} holds {arr.size} values, its shape {list(shape)} "
                             f"says {int(np.prod(shape))} (corrupt file?)")
        if not arr.flags.writeable or not arr.flags.c_contiguous:
            arr = np.array(arr, dtype=np.float32, order="C")
        return torch.from_numpy(arr.reshape(shape))


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(Path(path))


def open_gguf(path: str | Path) -> GGUFFile:
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    st = path.stat()
    return _open_cached(str(path.resolve()), st.st_size, st.st_mtime_ns)



def _int(f: GGUFFile, key: str, default=None, required: bool = True):
    v = f.get(key, default)
    if isinstance(v, list):
        if v and all(x == v[0] for x in v):
            v = v[0]
        else:
            raise ValueError(f"{f.path}: {key} differs between layers ({v[:8]}...); not supported")
    if v is None:
        if required:
            raise ValueError(f"{f.path}: GGUF metadata lacks {key!r}")
        return None
    return int(v)


def _llama3_rope(f: GGUFFile, arch: str, theta: float, head_dim: int) -> dict:
    """Find the llama3 rope scaling that gives ``rope_freqs.weight``'s per-frequency divisors."""
    from .config import RopeConfig
    from .layers import rope_inv_freq
    got = f.dequantize(ROPE_FREQS).flatten()
    if got.numel() != head_dim // 2:
        raise ValueError(f"{f.path}: {ROPE_FREQS} has {got.numel()} values, expected {head_dim // 2}")
    factor = float(f.get(f"{arch}.rope.scaling.factor", 0.0) or got.max())
    orig = _int(f, f"{arch}.rope.scaling.original_context_length", 8192, required=False) or 8192
    base = rope_inv_freq(head_dim, RopeConfig(theta=theta))
    for low, high in ((1.0, 4.0),):
        params = dict(rope_type="llama3", factor=factor, low_freq_factor=low, high_freq_factor=high,
                      original_max_position_embeddings=orig)
        scaled = rope_inv_freq(head_dim, RopeConfig(theta=theta, **params))
        if torch.allclose(base / scaled, got.float(), rtol=1e-4, atol=1e-5):
            return params
    raise ValueError(f"{f.path}: {ROPE_FREQS} (rope frequency factors {got[:4].tolist()}...) matches no llama3 "
                     "rope scaling zipfusion knows; this rope scaling is not supported")


def raw_config(f: GGUFFile) -> dict:
    """The GGUF metadata as a config.json-shaped dict (what :func:`config_from_dict` reads)."""
    arch = f.architecture
    if arch not in ARCHITECTURES:
        raise ValueError(f"{f.path}: GGUF architecture {arch!r} is not supported; zipfusion runs "
                         f"{sorted(ARCHITECTURES)}")
    experts = _int(f, f"{arch}.expert_count", 0, required=False) or 0
    if experts and arch not in MOE_ARCHITECTURES:
        raise ValueError(f"{f.path}: mixture-of-experts GGUF of architecture {arch!r} is not supported; "
                         f"zipfusion runs {sorted(MOE_ARCHITECTURES)} ones")
    moe = {}
    if experts:
        ffn = _int(f, f"{arch}.feed_forward_length", 0, required=False) or 0
        moe = {"architectures": [MOE_ARCHITECTURES[arch]], "num_local_experts": experts,
               "num_experts_per_tok": _int(f, f"{arch}.expert_used_count"),
               "moe_intermediate_size": _int(f, f"{arch}.expert_feed_forward_length", ffn, required=False),
               "norm_topk_prob": bool(f.get(f"{arch}.expert_weights_norm", True))}
    hidden = _int(f, f"{arch}.embedding_length")
    heads = _int(f, f"{arch}.attention.head_count")
    kv_heads = _int(f, f"{arch}.attention.head_count_kv", heads)
    head_dim = _int(f, f"{arch}.attention.key_length", None, required=False) or (hidden // heads if heads else 0)
    v_dim = _int(f, f"{arch}.attention.value_length", head_dim, required=False)
    if v_dim != head_dim:
        raise ValueError(f"{f.path}: key length {head_dim} != value length {v_dim}; not supported")
    rot = _int(f, f"{arch}.rope.dimension_count", head_dim, required=False)
    if rot != head_dim:
        raise ValueError(f"{f.path}: rope over {rot} of {head_dim} head dimensions (partial rotary) "
                         "is not supported")
    if "token_embd.weight" not in f.tensors:
        raise ValueError(f"{f.path}: no token_embd.weight tensor")
    vocab = int(f.tensors["token_embd.weight"].shape[-1])
    theta = float(f.get(f"{arch}.rope.freq_base", 10000.0))
    scaling_type = f.get(f"{arch}.rope.scaling.type", "none") or "none"
    rope_scaling = None
    if ROPE_FREQS in f.tensors:
        rope_scaling = _llama3_rope(f, arch, theta, head_dim)
    elif scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(f.get(f"{arch}.rope.scaling.factor", 1.0))}
    elif scaling_type != "none":
        rope_scaling = {"rope_type": scaling_type}
    elif f.has(f"{arch}.rope.scale_linear"):
        rope_scaling = {"rope_type": "linear", "factor": float(f.get(f"{arch}.rope.scale_linear"))}
    gemma = _gemma_config(f, arch, hidden, heads, head_dim) if arch in GEMMA else {}
    eos = [f.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    eos = list(dict.fromkeys(int(e) for e in eos if e is not None))
    return {
        "architectures": [ARCHITECTURES[arch]], "model_type": arch,
        "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": _int(f, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _int(f, f"{arch}.block_count"),
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": float(f.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": _int(f, f"{arch}.context_length", 8192, required=False),
        "rope_theta": theta, "rope_scaling": rope_scaling, "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "attention_bias": "blk.0.attn_output.bias" in f.tensors,
        "eos_token_id": eos or None, "bos_token_id": f.get("tokenizer.ggml.bos_token_id"),
        "sliding_window": _int(f, f"{arch}.attention.sliding_window", None, required=False),
        "gguf": {"file": str(f.path), "name": f.get("general.name"),
                 "file_type": f.get("general.file_type")},
    } | moe | gemma


def _gemma_config(f: GGUFFile, arch: str, hidden: int, heads: int, head_dim: int) -> dict:
    """Gemma 2/3 settings llama.cpp keeps in metadata or its code: soft-capping, local layers,
    local rope base and query scale."""
    layers = _int(f, f"{arch}.block_count")
    out = {"model_type": "gemma3_text" if arch == "gemma3" else arch, "hidden_activation": "gelu_pytorch_tanh",
           "query_pre_attn_scalar": hidden // heads if layers in (46, 62) else head_dim,
           "attn_logit_softcapping": f.get(f"{arch}.attn_logit_softcapping"),
           "final_logit_softcapping": f.get(f"{arch}.final_logit_softcapping")}
    pattern = f.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        out["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    elif pattern:
        out["sliding_window_pattern"] = int(pattern)
    if arch == "gemma3":
        out["rope_local_base_freq"] = 10000.0
    return out


def gguf_config(path: str | Path):
    """ModelConfig of a .gguf file."""
    from .config import config_from_dict
    f = open_gguf(path)
    try:
        return config_from_dict(raw_config(f))
    except ValueError as e:
        msg = str(e)
        raise ValueError(msg.replace("config.json:", f"{f.path}:")) from None


def has_tokenizer(path: str | Path) -> bool:
    f = open_gguf(path)
    return f.has("tokenizer.ggml.model") and f.has("tokenizer.ggml.tokens")



def hf_name(name: str, arch: str = "llama") -> str | None:
    """GGUF tensor name -> Hugging Face name (None for ``rope_freqs``; experts: with ``{e}``)."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    if name == ROPE_FREQS:
        return None
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _EXPERTS:
        return f"model.layers.{m.group(1)}.mlp.experts.{{e}}.{_EXPERTS[m.group(2)]}.{m.group(3)}"
    names = {**_PER_LAYER, **_ARCH_LAYER.get(arch, {})}
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"unexpected GGUF tensor {name!r}")


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (pairs rotated together stored side by side) into Hugging
    Face's half-split order, for weights [n_heads*D, in] and biases [n_heads*D]."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"cannot un-permute {rows} rows over {n_heads} heads")
    d2 = rows // n_heads // 2
    return w.reshape(n_heads, d2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_weights(path: str | Path, cfg):
    """(Hugging Face name, fp32 tensor) for every parameter tensor in the file."""
    f = open_gguf(path)
    f.check_types()
    permute = f.architecture == "llama"
    for name in f.tensors:
        if name == ROPE_FREQS:
            continue  # read into the config's rope scaling
        try:
            target = hf_name(name, f.architecture)
        except ValueError:
            raise ValueError(f"{f.path}: unexpected tensor {name!r} for {cfg.architecture}") from None
        w = f.dequantize(name)
        if f.architecture in GEMMA and name.endswith("norm.weight"):
            w = w - 1.0
        if "{e}" in target:
            for e in range(w.shape[0]):
                yield target.format(e=e), w[e]
            continue
        if permute and ".attn_q." in name:
            w = unpermute_qk(w, cfg.num_attention_heads)
        elif permute and ".attn_k." in name:
            w = unpermute_qk(w, cfg.num_key_value_heads)
        yield target, w
