"""Rank 0's view of every rank's KV cache (docs/distributed.md): rank 0 logs its cache operations
and the workers replay them, so page ids agree; capacity is the tightest rank's.
"""

from __future__ import annotations

import numpy as np

ALLOC, FREE, SEAL, STREAMS = "a", "f", "s", "t"


class PageIdsDiverged(RuntimeError):
    """A worker's cache gave other page ids than rank 0's (a bug)."""


class LockstepCache:
    def __init__(self, cache, driver):
        self._cache, self._driver = cache, driver
        self.log: list[tuple] = []
        self._unsent_allocs = 0
        self._unsent_frees = False
        self._reports: np.ndarray | None = None
        if getattr(cache, "kv_compression", False):
            self.manager = LockstepManager(self.log, driver, cache.manager)

    def __getattr__(self, name):                         # kv_compression, deterministic, stats, ...
        return getattr(self._cache, name)

    def alloc(self, n, keep_reserve: bool = True, reclaim=None):
        ids = self._cache.alloc(n, keep_reserve=keep_reserve, reclaim=reclaim)
        if ids:
            self.log.append((ALLOC, len(ids), bool(keep_reserve), list(ids)))
            self._unsent_allocs += len(ids)
        return ids

    def free(self, ids):
        ids = list(ids)
        if ids:
            self._cache.free(ids)
            self.log.append((FREE, ids))
            self._unsent_frees = True

    def take_log(self) -> list[tuple]:
        log = self.log[:]
        self.log.clear()
        self._unsent_allocs, self._unsent_frees = 0, False
        return log

    def set_reports(self, reports: np.ndarray | None) -> None:
        if reports is not None:
            self._reports = reports[1:]

    def _workers(self, column: int) -> float:
        self.set_reports(self._driver.comm_finish_report())
        if self._reports is None:
            return float("inf")
        return float(self._reports[:, column].min()) - self._unsent_allocs

    def capacity_new_pages(self, keep_reserve: bool = True):
        local = self._cache.capacity_new_pages(keep_reserve=keep_reserve)
        col = 0 if keep_reserve else 1
        workers = self._workers(col)
        if workers < local and self._unsent_frees:
            self._driver.send_ops()
            workers = self._workers(col)
        return int(max(0, min(local, workers)))

    def stored_ratio(self):
        local = self._cache.stored_ratio()
        self.set_reports(self._driver.comm_finish_report())
        if self._reports is None:
            return local
        return max(local, float(self._reports[:, 2].max()))


class LockstepManager:
    """Rank 0's memory manager as the page store sees it: each operation runs here and is logged
    for the workers."""

    def __init__(self, log: list[tuple], driver, manager):
        self._log, self._driver, self._manager = log, driver, manager

    def __getattr__(self, name):                         # slots_per_chunk, page_state, ...
        return getattr(self._manager, name)

    def set_streams(self, ids, streams) -> None:
        ids = list(ids)
        if ids:
            self._manager.set_streams(ids, streams)
            self._log.append((STREAMS, ids, list(streams)))

    def analyze_pages(self, ids) -> list[int]:
        """Nothing launched: pages are analysed at their placement, on every rank alike."""
        return list(ids)

    def place_pages(self, job: list[int], min_capacity: int = 0, reclaim=None, keep=None) -> list[int]:
        """Compress the live pages of ``job`` on every rank: logged and sent first."""
        keep = set(job if keep is None else keep)
        ids = [p for p in job if p in keep]
        if not ids:
            return []
        self._log.append((SEAL, ids, min_capacity))
        self._driver.send_ops()
        return self._manager.compress_pages(ids, min_capacity=min_capacity, reclaim=reclaim)


def apply_ops(cache, log: list[tuple], left_open: set[int]) -> None:
    """A worker: replay rank 0's cache operations; ``left_open``: pages retried at the next seal."""
    for op in log:
        if op[0] == ALLOC:
            _, n, keep, want = op
            got = cache.alloc(n, keep_reserve=keep)
            if list(got) != list(want):
                raise PageIdsDiverged(f"page ids diverged: rank 0 allocated {want[:8]}, this rank {list(got)[:8]}")
        elif op[0] == FREE:
            cache.free(op[1])
            left_open.difference_update(op[1])
        elif op[0] == SEAL:
            m = cache.manager  # rank 0 may retry pages this rank already sealed
            ids = sorted(i for i in set(op[1]) | left_open if m.page_state(i) == "open")
            left_open.clear()
            left_open.update(m.compress_pages(ids, min_capacity=op[2]) if ids else [])
        elif op[0] == STREAMS:
            cache.manager.set_streams(op[1], op[2])
        else:
            raise ValueError(f"unknown cache operation {op[0]!r}")


def report_of(cache) -> tuple[float, float, float]:
    """What a worker tells rank 0 after each message."""
    return (float(cache.capacity_new_pages(keep_reserve=True)), float(cache.capacity_new_pages(keep_reserve=False)),
            float(cache.stored_ratio()) if hasattr(cache, "stored_ratio") else 1.0)
