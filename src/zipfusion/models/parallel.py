"""The one place that owns the tensor-parallel process group.

Single GPU today: world size 1, no group. A later issue calls :func:`init_tensor_parallel`
with a ``torch.distributed`` group; the linear layers read :func:`tp` for their shard sizes and
all-reduce through it, nothing else in the model touches ``torch.distributed``.
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


def init_tensor_parallel(group=None) -> TensorParallel:
    """Use ``group`` (a torch.distributed process group; None = the default group) for TP."""
    global _TP
    import torch.distributed as dist
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; call init_process_group first")
    _TP = TensorParallel(size=dist.get_world_size(group), rank=dist.get_rank(group), group=group)
    return _TP
