"""Building blocks: RMSNorm, rotary embedding, tensor-parallel linear layers (Megatron split:
column-parallel keeps output rows, row-parallel input columns and all-reduces). Each layer's
``weight_loader`` cuts the checkpoint tensor to this rank's part.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..format.weights import CompressedWeight, restore_weight
from ..kernels import weight_linear as wl
from .config import RopeConfig
from .parallel import tp


# deterministic mode on CUDA: GEMMs run on blocks of exactly this many rows
DETERMINISTIC_ROWS = 128


def linear(x: torch.Tensor, weight: torch.Tensor | CompressedWeight, bias: torch.Tensor | None = None,
           deterministic: bool = False) -> torch.Tensor:
    """y = x Wᵀ + b; W a tensor or a :class:`CompressedWeight`. ``deterministic``: a row's bits must not
    depend on the batch, so on CUDA rows go in blocks of exactly DETERMINISTIC_ROWS (one cuBLAS
    shape), on the CPU in fp64; a compressed W is then restored into a reused buffer."""
    if isinstance(weight, CompressedWeight):
        if not deterministic:
            return wl.weight_linear(x, weight, bias)
        weight = wl.restore_buffer(weight) if weight.device.type == "cuda" else restore_weight(weight)
    if not deterministic:
        return F.linear(x, weight, bias)
    if not x.is_cuda:
        y = x.double() @ weight.double().t()
        return (y if bias is None else y + bias.double()).float().to(x.dtype)
    R, M = DETERMINISTIC_ROWS, x.shape[0]
    if M == 0:
        return F.linear(x, weight, bias)
    xp = F.pad(x, (0, 0, 0, -M % R))
    return torch.cat([F.linear(xp[i:i + R], weight, bias) for i in range(0, xp.shape[0], R)])[:M]


def embedding(ids: torch.Tensor, weight: torch.Tensor | CompressedWeight) -> torch.Tensor:
    """Rows ``ids`` of the embedding table (a compressed one restores only those rows)."""
    if isinstance(weight, CompressedWeight):
        return wl.gather_rows(weight, ids)
    return F.embedding(ids, weight)


class RMSNorm(nn.Module):
    """y = w · x / rms(x), statistics in fp32 (``offset``: Gemma's (offset + w)).
    ``norm(x, residual)`` returns ``(norm(x + residual), x + residual)``, one kernel on CUDA."""

    def __init__(self, dim: int, eps: float, deterministic: bool = False, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.offset = eps, offset
        self.deterministic = deterministic   # CPU: statistics in fp64

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.is_cuda and not self.offset:   # models/merged_ops.py
            from .merged_ops import rmsnorm
            return rmsnorm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = residual = x + residual
        dtype = x.dtype
        x32 = x.float()
        if self.deterministic:
            inv = torch.rsqrt(x32.double().pow(2).mean(-1, keepdim=True) + self.eps).float()
        else:
            inv = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            y = ((x32 * inv) * (self.offset + self.weight.float())).to(dtype)
        else:
            y = self.weight * (x32 * inv).to(dtype)
        return y if residual is None else (y, residual)


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {d}")
    return n // d


def weight_loaders(model: nn.Module) -> dict:
    """Parameter name -> its layer's ``weight_loader``."""
    return {f"{mn}.{pn}" if mn else pn: mod.weight_loader
            for mn, mod in model.named_modules() if hasattr(mod, "weight_loader")
            for pn, _ in mod.named_parameters(recurse=False)}


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ (+ b), W's output rows split over ranks; ``output_sizes`` fuses projections."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, deterministic: bool = False):
        super().__init__()
        self._tp = t = tp()
        self.deterministic = deterministic
        self.output_sizes = list(output_sizes)
        self.local_sizes = [_divide(n, t.size, "output size") for n in output_sizes]
        self.in_features = in_features
        self.weight = nn.Parameter(torch.empty(sum(self.local_sizes), in_features))
        self.weight.num_parts = len(output_sizes)
        _full(self.weight, (sum(output_sizes), in_features), self.output_sizes)
        if bias:
            self.bias = nn.Parameter(torch.empty(sum(self.local_sizes)))
            self.bias.num_parts = len(output_sizes)
            _full(self.bias, (sum(output_sizes),), self.output_sizes)
        else:
            self.bias = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        t = self._tp
        size = self.local_sizes[shard]
        if loaded.shape[0] != self.output_sizes[shard] or (param.dim() == 2 and loaded.shape[1] != self.in_features):
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit part {shard} "
                             f"({self.output_sizes[shard]} x {self.in_features})")
        start = sum(self.local_sizes[:shard])
        param.data[start:start + size].copy_(loaded[t.rank * size:(t.rank + 1) * size])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.deterministic)


class ReplicatedLinear(nn.Module):
    """y = x Wᵀ, the whole W on every rank (a router)."""

    def __init__(self, in_features: int, out_features: int, deterministic: bool = False):
        super().__init__()
        self.deterministic = deterministic
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, None, self.deterministic)


class RowParallelLinear(nn.Module):
    """y = Σ_ranks x_r W_rᵀ (+ b): input columns split over ranks, partial sums all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, deterministic: bool = False):
        super().__init__()
        self._tp = t = tp()
        self.deterministic = deterministic           # the all-reduce adds in rank order
        self.in_features, self.out_features = in_features, out_features
        self.local_in = _divide(in_features, t.size, "input size")
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in))
        _full(self.weight, (out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        if bias:
            _full(self.bias, (out_features,))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        if param.dim() == 1:
            param.data.copy_(loaded)
            return
        if tuple(loaded.shape) != (self.out_features, self.in_features):
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit "
                             f"({self.out_features} x {self.in_features})")
        r = self._tp.rank
        param.data.copy_(loaded[:, r * self.local_in:(r + 1) * self.local_in])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._tp.all_reduce(linear(x, self.weight, None, self.deterministic), ordered=self.deterministic)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embeddings, the vocabulary split over ranks (zeros for tokens of other ranks, so
    the all-reduce is exact); its rows also serve as the tied LM head's shard."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self._tp = t = tp()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.shard = -(-num_embeddings // t.size)
        self.start = t.rank * self.shard
        self.weight = nn.Parameter(torch.empty(self.shard, embedding_dim))
        _full(self.weight, (num_embeddings, embedding_dim))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        if tuple(loaded.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit "
                             f"({self.num_embeddings} x {self.embedding_dim})")
        part = loaded[self.start:self.start + self.shard]
        param.data.zero_()
        param.data[:part.shape[0]].copy_(part)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self._tp.size == 1:
            return embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.shard)
        y = embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[:, None], 0)
        return self._tp.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """An untied LM head: :class:`VocabParallelEmbedding`'s rows and split, weights only."""

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__(vocab_size, hidden_size)


def _full(param: nn.Parameter, shape: tuple, parts: list[int] | None = None) -> None:
    """Note a sharded parameter's whole shape, so a random model is the same at every TP size."""
    param.full_shape = tuple(shape)
    param.part_sizes = list(parts) if parts else None


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies θ^(-2i/D) with llama3 / linear scaling (fp32)."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv / rope.factor
    if rope.rope_type != "llama3":
        return inv
    L, lo, hi, factor = (rope.original_max_position_embeddings, rope.low_freq_factor,
                         rope.high_freq_factor, rope.factor)
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > L / lo, inv / factor, inv)
    smooth = (L / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < L / hi) * ~(wavelen > L / lo)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate q and k by position (half-split layout). One arithmetic on every path: cos/sin in
    fp32, products and sum in fp64 (exact, FMA or not), so a key has the same bits whether
    computed in a prompt or as a generated token."""

    def __init__(self, head_dim: int, rope: RopeConfig):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, rope), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D/2] fp32."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].double(), x[..., half:].double()
    c, s = cos.double()[:, None, :], sin.double()[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).float().to(x.dtype)
