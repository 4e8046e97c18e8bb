"""A tensor-parallel worker process (rank > 0): joins rank 0's group and runs the engine's worker
loop until told to exit. An error ends the process, so rank 0's next collective fails at once.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

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


def worker_main(cfg, rank: int, world: int, device_type: str, port: int, threads: int, parent_pid: int,
                serve) -> None:
    """Entry point of a spawned worker process; ``serve(cfg, comm)``: the worker loop."""
    try:
        torch.set_num_threads(max(1, threads))
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
        device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = timedelta(seconds=cfg.tp_timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
        store.set(f"zf_up{rank}", "1")
        serve(cfg, Comm(rank, world, device, cfg.tp_timeout_s, store=store))
    except BaseException:
        sys.stderr.write(f"[zipfusion tensor-parallel worker rank {rank}, pid {os.getpid()}]\n{traceback.format_exc()}")
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)
