"""One decoder for every family, differing only by ModelConfig options; it knows the KV cache only
through :class:`KVCacheStep`. Parameter names are Hugging Face's, q|k|v and gate|up stacked.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import (ColumnParallelLinear, ParallelLMHead, RMSNorm, RotaryEmbedding,
                     RowParallelLinear, VocabParallelEmbedding, linear)
from .moe import SparseMoE
from .parallel import tp

# checkpoint name fragment -> (our stacked parameter's fragment, part index)
STACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}

class KVCacheStep(Protocol):
    """What a model needs from the KV cache during one forward step."""

    def store(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotate q and k by position, write k and v into the cache; return the rotated q, k and v."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of the step's queries over their requests' cached K/V -> [T, Hq, D]."""


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, deterministic: bool):
        super().__init__()
        t = tp().size
        if cfg.num_key_value_heads % t:
            raise ValueError(f"tensor_parallel_size={t} does not divide the model's {cfg.num_key_value_heads} KV heads")
        self.layer = layer
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_attention_heads // t  # this rank's heads
        self.num_kv_heads = cfg.num_key_value_heads // t
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.q_size, cfg.kv_size, cfg.kv_size],
                                             bias=cfg.attention_bias or cfg.qkv_bias, deterministic=deterministic)
        self.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, bias=cfg.attention_bias,
                                        deterministic=deterministic)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, deterministic, cfg.norm_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, deterministic, cfg.norm_offset)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, kv: KVCacheStep):
        T = x.shape[0]
        qs, ks = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([qs, ks, ks], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = kv.store(self.layer, q, k, v, cos, sin)
        o = kv.attend(self.layer, q, k, v)
        return self.o_proj(o.reshape(T, qs))


def act_and_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) · up of a stacked gate|up: SiLU or GELU's tanh approximation (GeGLU)."""
    if act == "silu" and gate_up.is_cuda:  # models/merged_ops.py
        from .merged_ops import silu_and_mul
        return silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, deterministic: bool):
        super().__init__()
        self.act = cfg.hidden_act
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=cfg.mlp_bias,
                                                 deterministic=deterministic)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias,
                                           deterministic=deterministic)

    def forward(self, x):
        return self.down_proj(act_and_mul(self.gate_up_proj(x), self.act))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, deterministic: bool):
        super().__init__()
        self.self_attn = Attention(cfg, layer, deterministic)
        self.mlp = SparseMoE(cfg, deterministic) if cfg.is_moe_layer(layer) else MLP(cfg, deterministic)
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, deterministic, cfg.norm_offset)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.sandwich = cfg.sandwich_norm
        if self.sandwich:
            self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def forward(self, x, residual, cos, sin, kv: KVCacheStep):
        """Returns this layer's output and the residual stream before it (summed by the next norm)."""
        if self.sandwich:                   # Gemma: h += norm(attn(norm(h))); h += norm(mlp(norm(h)))
            h = x if residual is None else x + residual
            h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cos, sin, kv))
            return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h))), h
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, kv)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, deterministic: bool):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, deterministic) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, deterministic, cfg.norm_offset)


class CausalLM(nn.Module):
    """The causal LM of every family: ``forward(input_ids [T], positions [T], kv) -> hidden [T, h]``;
    ``deterministic`` (fixed at construction): batch-invariant arithmetic."""

    def __init__(self, cfg: ModelConfig, deterministic: bool = False):
        super().__init__()
        self.config = cfg
        self.deterministic = deterministic  # read by compute_logits
        self.model = Backbone(cfg, deterministic)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope)
# sliding layers' own rope (Gemma 3), else the one rope
        self.local_rotary = RotaryEmbedding(cfg.head_dim, cfg.local_rope) if cfg.local_rope else None
        self._tp = tp()
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVCacheStep) -> torch.Tensor:
        cfg = self.config
        x = self.model.embed_tokens(input_ids)
        if cfg.embed_scale:
            x = x * torch.tensor(cfg.hidden_size ** 0.5, dtype=x.dtype)
        rope = self.rotary.cos_sin(positions)
        local = self.local_rotary.cos_sin(positions) if self.local_rotary is not None else rope
        residual = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, *(local if cfg.window(i) else rope), kv)
        return self.model.norm(x) if residual is None else self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, h] -> logits [n, vocab] fp32 (tensor parallel: gathered on every rank)."""
        logits = linear(hidden, self.lm_head_weight, None, self.deterministic).float()
        if self._tp.size > 1:
            logits = self._tp.all_gather_last(logits)[:, :self.config.vocab_size]
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
