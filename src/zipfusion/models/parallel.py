"""The one place that owns the tensor-parallel process group.

Single GPU today: world size 1, no group. The linear layers read :func:`tp` for their shard
sizes and all-reduce through it, so tensor parallelism, when it comes, sets ``_TP`` here and
nothing else in the model touches ``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TensorParallel:
    size: int = 1
    rank: int = 0
    group: object = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        torch.distributed.all_reduce(x, group=self.group)
        return x


_TP = TensorParallel()


def tp() -> TensorParallel:
    return _TP
