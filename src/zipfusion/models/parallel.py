"""The one place that owns the tensor-parallel process group: a model is built inside
``with use(TensorParallel(...)):`` and each layer keeps its setting (world size 1: no group).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass
class TensorParallel:
    size: int = 1
    rank: int = 0
    group: object = None

    def all_reduce(self, x: torch.Tensor, ordered: bool = False) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place. ``ordered`` (deterministic mode): gather and add in
        rank order in fp32, since a ring all-reduce's order depends on the batch size."""
        if self.size == 1:
            return x
        if not ordered or self.size == 2:
            torch.distributed.all_reduce(x, group=self.group)
            return x
        parts = self._gather(x)
        acc = parts[0].float()
        for i in range(1, self.size):
            acc = acc + parts[i].float()
        x.copy_(acc.to(x.dtype))
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size·n]: the ranks' parts side by side, rank order."""
        if self.size == 1:
            return x
        out = self._gather(x)
        return out.movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """[size, *x.shape]: every rank's x, in rank order."""
        x = x.contiguous()
        out = torch.empty((self.size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        dist = torch.distributed
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x, group=self.group)
        return out.view(self.size, *x.shape)


_TP = TensorParallel()


def tp() -> TensorParallel:
    """The tensor-parallel setting that layers being built now take."""
    return _TP


@contextlib.contextmanager
def use(t: TensorParallel):
    """Build a model for ``t`` (layers built inside take it; restored after)."""
    global _TP
    old, _TP = _TP, t
    try:
        yield t
    finally:
        _TP = old
