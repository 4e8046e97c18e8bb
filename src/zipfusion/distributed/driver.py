"""Rank 0 of a tensor-parallel engine: starts (or, under ``torchrun``, joins) the workers and
keeps them in step (docs/distributed.md). A failure across processes ends the engine with
:class:`TPWorkerError` naming the rank; the workers left are stopped.
"""

from __future__ import annotations

import gc
import logging
import os
import time
import weakref
from contextlib import contextmanager

import torch

from ..config import environment
from ..models.parallel import TensorParallel
from .comm import Comm
from .lockstep import LockstepCache

log = logging.getLogger("zipfusion")


class TPWorkerError(RuntimeError):
    """A tensor-parallel worker died or stopped answering; the engine cannot continue."""


def check_model(mc, n: int) -> None:
    """One-line ValueError for a model that ``n`` ranks cannot split."""
    H = mc.num_key_value_heads
    if H % n:
        ok = [d for d in range(1, H + 1) if H % d == 0]
        raise ValueError(f"tensor_parallel_size={n} does not divide the model's {H} KV heads; pass one of {ok}")
    if mc.intermediate_size % n:
        raise ValueError(f"tensor_parallel_size={n} does not divide the model's intermediate size "
                         f"{mc.intermediate_size}")


def start(cfg, device: torch.device, mc, serve) -> "TPDriver":
    """Rank 0: the driver. Under torchrun on a rank > 0: serve as a worker, then SystemExit(0)."""
    n = cfg.tensor_parallel_size
    check_model(mc, n)
    _collect_dropped_engines()
    run = environment().torchrun
    if run is not None and run[1] > 1:
        rank, world, local = run
        if world != n:
            raise ValueError(f"torchrun started {world} processes but tensor_parallel_size={n}; they must agree")
        if device.type == "cuda":
            torch.cuda.set_device(local)
        if rank != 0:
            dev = torch.device("cuda", local) if device.type == "cuda" else device
            serve(cfg, Comm(rank, world, dev, cfg.tp_timeout_s, init_method="env://"))
            raise SystemExit(0)
        return TPDriver(cfg, Comm(0, world, device, cfg.tp_timeout_s, init_method="env://"), [])
    if device.type == "cuda":
        if torch.cuda.device_count() < n:
            raise ValueError(f"tensor_parallel_size={n} needs {n} GPUs, {torch.cuda.device_count()} visible")
        if device.index not in (None, 0):
            raise ValueError(f"with tensor_parallel_size > 1 pass device='cuda' (rank r runs on cuda:r), not {device}")
    return _spawn(cfg, device, n, serve)


def _collect_dropped_engines() -> None:
    """Collect engines dropped without ``close()`` (their finalizers stop their workers) before a
    new engine needs torch.distributed."""
    import torch.distributed as dist
    if dist.is_initialized():
        gc.collect()


def _spawn(cfg, device: torch.device, n: int, serve) -> "TPDriver":
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from datetime import timedelta

    ctx = mp.get_context(cfg.tp_start_method)
    if cfg.tp_start_method == "forkserver":
        ctx.set_forkserver_preload(["torch", "zipfusion.distributed.worker", serve.__module__])
    store = dist.TCPStore("127.0.0.1", 0, n, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=cfg.tp_timeout_s))
    procs = []
    from .worker import worker_main
    try:
        for rank in range(1, n):
            p = ctx.Process(target=worker_main, name=f"zipfusion-tp{rank}", daemon=True,
                            args=(cfg, rank, n, device.type, store.port, torch.get_num_threads(), os.getpid(),
                                  serve))
            p.start()
            procs.append(p)
        deadline = time.monotonic() + cfg.tp_timeout_s
        keys = [f"zf_up{r}" for r in range(1, n)]
        while not store.check(keys):
            for r, p in enumerate(procs, 1):
                if not p.is_alive():
                    raise TPWorkerError(f"tensor-parallel worker rank {r} (pid {p.pid}) died while starting "
                                        f"(exit code {p.exitcode}); its traceback is above")
            if time.monotonic() > deadline:
                raise TPWorkerError(f"tensor-parallel workers did not start within {cfg.tp_timeout_s:g} s")
            time.sleep(0.02)
        comm = Comm(0, n, device, cfg.tp_timeout_s, store=store)
    except BaseException:
        _stop(procs, graceful=False)
        raise
    return TPDriver(cfg, comm, procs, store)


def _stop(procs, graceful: bool = True, wait: float = 10.0) -> None:
    for p in procs:
        if graceful:
            p.join(wait)
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)


def _shutdown(state: dict) -> None:
    """Stop the workers and leave the process group (idempotent; also at exit)."""
    comm, procs = state.pop("comm", None), state.pop("procs", [])
    if comm is None:
        return
    graceful = not state.get("broken")
    if graceful:
        try:
            comm.send({"kind": "exit", "ops": []})
        except Exception:
            graceful = False
    comm.close()
    _stop(procs, graceful)
    state.pop("store", None)


class TPDriver:
    """Rank 0's handle on the group: what the engine asks of it."""

    def __init__(self, cfg, comm: Comm, procs: list, store=None):
        self.size, self.comm, self.procs = cfg.tensor_parallel_size, comm, procs
        self.parallel = TensorParallel(self.size, 0, comm.tp_group)
        self.broken: TPWorkerError | None = None
        self.cache: LockstepCache | None = None
        self._state = {"comm": comm, "procs": procs, "store": store}
        self._finalizer = weakref.finalize(self, _shutdown, self._state)
        log.info("tensor parallel: %d ranks (%s), %s", self.size, "torchrun" if not procs else
                 f"worker pids {[p.pid for p in procs]}", "nccl" if comm.device.type == "cuda" else "gloo")

    def fail(self, exc: BaseException) -> TPWorkerError:
        if self.broken is not None:
            return self.broken
        dead = []
        for r, p in enumerate(self.procs, 1):
            p.join(1.0 if not dead else 0.1)  # its sockets closed as it exited: let it finish
            if not p.is_alive():
                dead.append(f"rank {r} (pid {p.pid}) died with exit code {p.exitcode}")
        if dead:
            msg = f"tensor-parallel worker {', '.join(dead)}; the engine cannot continue: start a new one"
        else:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            msg = (f"tensor-parallel communication failed ({type(exc).__name__}: {first[:200]}); "
                   "the engine cannot continue: start a new one")
        self.broken = TPWorkerError(msg)
        self._state["broken"] = True
        self._finalizer()
        return self.broken

    @contextmanager
    def guard(self):
        if self.broken is not None:
            raise self.broken
        try:
            yield
        except TPWorkerError:
            raise
        except Exception as exc:
            raise self.fail(exc) from exc

    def agree_budget(self, gb: float) -> float:
        """Every rank's KV budget: the smallest any rank can give (so page ids range alike)."""
        with self.guard():
            return self.comm.min_over_ranks(gb)

    def lockstep(self, cache) -> LockstepCache:
        self.cache = LockstepCache(cache, self)
        return self.cache

    def shutdown(self) -> None:
        self._finalizer()

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    def send(self, kind: str | None, **payload) -> None:
        """Broadcast the cache log with a message; every rank reports after it."""
        ops = self.cache.take_log() if self.cache is not None else []
        with self.guard():
            self.comm.send({"kind": kind, "ops": ops, **payload})

    def send_ops(self) -> None:
        self.send(None)
        with self.guard():
            self.comm.report()

    def comm_finish_report(self):
        if self.broken is not None:
            raise self.broken
        with self.guard():
            return self.comm.finish_report()
