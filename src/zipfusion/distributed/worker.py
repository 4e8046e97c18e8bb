"""A tensor-parallel worker (rank > 0): builds its shard of the model and its own KV cache,
then runs what rank 0 sends until told to exit.

Each message: replay rank 0's cache operations (``lockstep.apply_ops``), drop forgotten
requests, then ``runner`` (build the ModelRunner), ``capture`` (CUDA graphs, in step with rank
0's capture: their all-reduces are recorded in the graphs) or ``step`` (one forward over the
plan's shadow requests; the logits are rank 0's business), then report this rank's capacity.
Any error prints its traceback and ends the process: its sockets close, so rank 0's next
collective fails at once and rank 0 reports the dead rank.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from types import SimpleNamespace

import torch

from .comm import Comm


def _watch_parent(parent_pid: int) -> None:
    """Spawned worker: end when the engine's process is gone (killed, not shut down)."""
    while True:
        time.sleep(1.0)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(3)
        except OSError:
            pass


def worker_main(cfg, rank: int, world: int, device_type: str, port: int, threads: int, parent_pid: int) -> None:
    """Entry point of a spawned worker process."""
    try:
        import torch.distributed as dist
        from datetime import timedelta
        from .comm import timeout_s

        torch.set_num_threads(max(1, threads))
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
        device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=timeout_s()))
        store.set(f"zf_up{rank}", "1")
        serve(cfg, Comm(rank, world, device, store=store))
    except BaseException:
        sys.stderr.write(f"[zipfusion tensor-parallel worker rank {rank}, pid {os.getpid()}]\n{traceback.format_exc()}")
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def serve(cfg, comm: Comm) -> None:
    """Build this rank's model and cache, then follow rank 0 until it says exit."""
    from ..engine.llm_engine import LLMEngine, parse_dtype
    from ..engine.attention import AttentionBackend
    from ..engine.runner import ModelRunner
    from ..models import build_model, model_config, resolve_model
    from ..models.parallel import TensorParallel, use
    from .lockstep import apply_ops, report_of
    from .plan import PlanReader

    dtype, device = parse_dtype(cfg.dtype), comm.device
    source = resolve_model(cfg.model, cfg.load_format)
    mc = model_config(source)
    with use(TensorParallel(comm.world, comm.rank, comm.tp_group)):
        model = build_model(source, dtype=dtype, device=device, seed=cfg.seed, deterministic=cfg.deterministic)
    side = SimpleNamespace(size=comm.world, agree_budget=comm.min_over_ranks)
    # the engine's own cache construction (same budget rule, agreed with every rank)
    ns = SimpleNamespace(config=cfg, model_config=mc, dtype=dtype, device=device, tp=side)
    cache = LLMEngine._build_cache(ns)
    runner, reader, left_open = None, PlanReader(), set()
    while True:
        msg = comm.recv()
        apply_ops(cache, msg["ops"], left_open)
        for rid in msg["forget"]:
            reader.forget(rid)
            if runner is not None:
                runner.forget(rid)
        kind = msg["kind"]
        if kind == "exit":
            break
        if kind == "runner":
            runner = ModelRunner(model, AttentionBackend.from_config(cfg, cache, mc, comm.world),
                                 msg["max_model_len"], msg["max_num_seqs"],
                                 use_cuda_graphs=msg["use_cuda_graphs"])
        elif kind == "capture":
            runner.capture_cuda_graphs(*msg["args"], **msg["kwargs"])
        elif kind == "step":
            runner.run(reader.output(msg["plan"]))
        elif kind is not None:
            raise ValueError(f"unknown message {kind!r}")
        comm.report(report_of(cache))
    comm.close()
