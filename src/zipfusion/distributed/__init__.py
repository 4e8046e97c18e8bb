"""Tensor parallelism on torch.distributed (docs/distributed.md): the communication layer
(:mod:`.comm`), rank 0's driver (:mod:`.driver`), the cache operations and step plans that keep
the ranks in step (:mod:`.lockstep`, :mod:`.plan`) and the worker loop (:mod:`.worker`)."""

from .driver import TPWorkerError, check_model

__all__ = ["TPWorkerError", "check_model"]
