"""Sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral): a replicated router picks each token's
top-k experts, run as one grouped GEMM over the tokens sorted by expert. Tensor parallelism
splits every expert's intermediate dimension, partial sums all-reduced.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .layers import ReplicatedLinear, _divide, _full, linear
from .parallel import tp


def route(logits: torch.Tensor, k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] fp32, expert ids [T, k]), as transformers does."""
    weights, ids = logits.float().softmax(-1).topk(k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
    """Rows x [M, K] sorted by group -> [M, N], group e times w[e]ᵀ: ``torch._grouped_mm`` where
    it takes the shapes, else (and in deterministic mode) a loop through :func:`~.layers.linear`."""
    E, N, K = w.shape
    grouped = (hasattr(torch, "_grouped_mm") and not deterministic and x.shape[0] > 0
               and (x.dtype == torch.bfloat16 or not x.is_cuda) and (K * x.element_size()) % 16 == 0
               and (N * x.element_size()) % 16 == 0)
    if grouped:
        return torch._grouped_mm(x, w.transpose(1, 2), offs=ends.to(torch.int32))
    return grouped_mm_loop(x, w, ends, deterministic)


def grouped_mm_loop(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, deterministic: bool = False):
    """:func:`grouped_mm` one group at a time (host syncs: not for the GPU path)."""
    out = x.new_empty(x.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = linear(x[start:end], w[e], None, deterministic)
        start = end
    return out


class Experts(nn.Module):
    """E experts' gate|up and down weights, stacked; this rank's share of each expert's I."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str, deterministic: bool):
        super().__init__()
        self._tp = t = tp()
        self.act, self.deterministic = act, deterministic
        self.E, self.h, self.I = num_experts, hidden, intermediate
        self.local_i = _divide(intermediate, t.size, "moe_intermediate_size")
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * self.local_i, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, self.local_i))
# loader shards: gate_up parts 2e (gate), 2e+1 (up); down part e
        self.gate_up_proj.num_parts, self.down_proj.num_parts = 2 * num_experts, num_experts
        _full(self.gate_up_proj, (2 * num_experts * intermediate, hidden), [intermediate] * 2 * num_experts)
        _full(self.down_proj, (num_experts * hidden, intermediate), [hidden] * num_experts)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        r, n = self._tp.rank, self.local_i
        if param is self.gate_up_proj:
            if tuple(loaded.shape) != (self.I, self.h):
                raise ValueError(f"expert tensor of shape {tuple(loaded.shape)} does not fit ({self.I} x {self.h})")
            e, part = divmod(shard, 2)
            param.data[e, part * n:(part + 1) * n].copy_(loaded[r * n:(r + 1) * n])
        else:
            if tuple(loaded.shape) != (self.h, self.I):
                raise ValueError(f"expert tensor of shape {tuple(loaded.shape)} does not fit ({self.h} x {self.I})")
            param.data[shard].copy_(loaded[:, r * n:(r + 1) * n])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, h] -> this rank's partial Σ_k weights · expert(x) [T, h]."""
        from .llama import act_and_mul
        T, k = ids.shape
        flat = ids.flatten()
        order = flat.argsort(stable=True)
# tokens per expert by scatter_add (bincount syncs the host: no CUDA graph)
        ends = torch.zeros(self.E, dtype=torch.int64, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat)).cumsum(0)
        xs = x[order // k]
        y = grouped_mm(act_and_mul(grouped_mm(xs, self.gate_up_proj, ends, self.deterministic), self.act),
                       self.down_proj, ends, self.deterministic)
        out = torch.empty_like(y)
        out[order] = y
        w = weights.to(x.dtype)  # transformers' rounding of the weights
        return (out.view(T, k, -1) * w[..., None]).sum(1) if k > 1 else out * w


class SparseMoE(nn.Module):
    """Router + experts; the output all-reduced over tensor-parallel ranks."""

    def __init__(self, cfg: ModelConfig, deterministic: bool):
        super().__init__()
        self._tp = tp()
        self.k, self.renormalise, self.deterministic = cfg.num_experts_per_tok, cfg.norm_topk_prob, deterministic
        self.gate = ReplicatedLinear(cfg.hidden_size, cfg.num_experts, deterministic)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.hidden_act,
                               deterministic)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.k, self.renormalise)
        return self._tp.all_reduce(self.experts(x, weights, ids), ordered=self.deterministic)
