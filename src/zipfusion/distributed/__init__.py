"""Tensor parallelism on torch.distributed (docs/distributed.md): the communication layer
(:mod:`.comm`), rank 0's driver (:mod:`.driver`: starts the workers, sends them messages, stops
them), the worker processes (:mod:`.worker`) and the cache operations that keep every rank's
page ids in step (:mod:`.lockstep`). What runs in them -- the model runner on every rank and
the step plans -- is the engine's (engine/tp_runner.py), which hands its worker loop to
:func:`.driver.start`."""

from .driver import TPWorkerError, check_model

__all__ = ["TPWorkerError", "check_model"]
