"""Tensor parallelism on torch.distributed (docs/distributed.md): communication, rank 0's driver,
the workers and the lockstep of page ids."""

from .driver import TPWorkerError, check_model

__all__ = ["TPWorkerError", "check_model"]
