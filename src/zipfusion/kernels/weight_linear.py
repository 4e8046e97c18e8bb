"""Linear layers over compressed weights (format/weights.py): a stand-in built on the torch
reference, restore then ``F.linear``, until the fused kernels land; the same four entry points."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..format.weights import CompressedWeight, restore_rows, restore_weight


def weight_linear(x: torch.Tensor, cw: CompressedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x Wᵀ (+ b) for ``x [M, K]`` bf16: the bits of ``F.linear`` over the restored W."""
    return F.linear(x, restore_weight(cw), bias)


def restore_into(cw: CompressedWeight, out: torch.Tensor) -> torch.Tensor:
    """W restored into ``out [N, K]`` bf16 (a reused buffer); returns ``out``."""
    out.copy_(restore_weight(cw))
    return out


def gather_rows(cw: CompressedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids [T]`` of W -> ``[T, K]`` bf16 (an embedding lookup)."""
    return restore_rows(cw, ids)


def warmup(weights: list[CompressedWeight], max_m: int) -> None:
    """Nothing to build in torch (the kernels compile every M bucket here before graph capture)."""
