"""The communication layer of tensor parallelism: ``tp_group`` for the model's collectives (NCCL on
CUDA), ``ctrl`` (gloo) for rank 0's messages and the ranks' reports.
"""

from __future__ import annotations

import pickle
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

HEAD_BYTES = 4096            # a message up to this size is one broadcast; longer ones take two
REPORT = 4  # capacity (reserve kept), capacity (reserve counted), stored ratio, spare


class Comm:
    """This process's end of the tensor-parallel group."""

    def __init__(self, rank: int, world: int, device: torch.device, timeout_s: float, store=None,
                 init_method: str | None = None):
        self.rank, self.world, self.device = rank, world, device
        self.timeout = timedelta(seconds=timeout_s)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process: one tensor-parallel "
                               "engine per process (shut the other one down first)")
        kw = dict(store=store) if store is not None else dict(init_method=init_method or "env://")
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=self.timeout, **kw)
        self.tp_group = dist.group.WORLD
        self.ctrl = dist.new_group(backend="gloo", timeout=self.timeout)
        self._head = torch.zeros(HEAD_BYTES, dtype=torch.uint8)
        self._report = torch.zeros(world * REPORT, dtype=torch.float64)
        self._pending = None
        self.last_report = None

    def send(self, msg) -> None:
        """Rank 0: broadcast ``msg`` (after finishing the last message's report)."""
        self.finish_report()
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        n = len(data)
        head = self._head
        head[:8] = torch.tensor([n], dtype=torch.int64).view(torch.uint8)
        first = min(n, HEAD_BYTES - 8)
        head[8:8 + first] = torch.frombuffer(bytearray(data[:first]), dtype=torch.uint8)
        dist.broadcast(head, 0, group=self.ctrl)
        if n > first:
            dist.broadcast(torch.frombuffer(bytearray(data[first:]), dtype=torch.uint8), 0, group=self.ctrl)

    def recv(self):
        """A worker: the next message from rank 0."""
        head = self._head
        dist.broadcast(head, 0, group=self.ctrl)
        n = int(head[:8].view(torch.int64)[0])
        first = min(n, HEAD_BYTES - 8)
        data = head[8:8 + first].numpy().tobytes()
        if n > first:
            rest = torch.empty(n - first, dtype=torch.uint8)
            dist.broadcast(rest, 0, group=self.ctrl)
            data += rest.numpy().tobytes()
        return pickle.loads(data)

    def report(self, values=(0.0,) * REPORT) -> None:
        """Every rank after each message: its report into the all-gather."""
        mine = torch.tensor(list(values) + [0.0] * (REPORT - len(values)), dtype=torch.float64)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        if self.rank == 0:
            self._pending = gather(self._report, mine, group=self.ctrl, async_op=True)
        else:
            gather(self._report, mine, group=self.ctrl)

    def finish_report(self) -> np.ndarray | None:
        """Rank 0: the latest reports [world, REPORT] (None before the first)."""
        if self._pending is not None:
            work, self._pending = self._pending, None
            work.wait(self.timeout)
            self.last_report = self._report.view(self.world, REPORT).numpy().copy()
        return self.last_report

    def min_over_ranks(self, x: float) -> float:
        t = torch.tensor([float(x)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.ctrl)
        return float(t[0])

    def close(self) -> None:
        self._pending = None
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
