"""The host tier: pages the prefix cache evicts kept in (pinned) host memory as stored, in a ring
that drops its oldest pages when full. A later match brings a page back into a new page, placed
compressed where there is room (no re-encode) or decoded into it. Copies run on the tier's own
stream through two bounded staging buffers and need no host sync."""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from ..config import Tuning
from . import codec
from .copy import batches, copy_ranges


@dataclass
class Record:
    """One page on the host."""
    start: int
    size: int
    nbytes: np.ndarray            # [L] bytes of each layer
    open_form: np.ndarray         # [L] whether a layer's bytes are its open form
    owner: object = None
    live: bool = True
    copied: object = None         # CUDA: the event after its copy out (the tier's stream)


@dataclass
class HostTierStats:
    pages_out: int = 0
    pages_in: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    dropped: int = 0
    host_s_out: float = 0.0
    host_s_in: float = 0.0
    device_s_out: float = 0.0     # compute-stream work from CUDA events (the CPU: host seconds)
    device_s_in: float = 0.0




class HostTier:
    def __init__(self, manager, budget_bytes: int, tuning: Tuning = Tuning()):
        self.manager, self.budget, self.tuning = manager, int(budget_bytes) // 16 * 16, tuning
        self.pin = manager.device.type == "cuda"
        self.stream = torch.cuda.Stream(manager.device) if self.pin else None
        self._dropped: list = []                # owners of records dropped for room, not taken yet
        self.buf: torch.Tensor | None = None
        self._pinning: threading.Thread | None = None
        self.ring: deque[Record] = deque()
        self.head = 0
        self.used = 0
        self.stats = HostTierStats()
        self._timings: list[tuple[str, object, object]] = []
        self._stage: list[torch.Tensor | None] = [None, None]
        self._stage_free: list = [None, None]
        self._turn = 0

    def start(self, wait: bool = False) -> None:
        """Begin pinning the buffer in the background (CUDA: after graph capture); ``wait``: until done."""
        if self.pin and self.budget and self._pinning is None and self.buf is None:
            self._pinning = threading.Thread(target=self._allocate, name="zipfusion-host-tier", daemon=True)
            self._pinning.start()
        if wait and self._pinning is not None:
            self._pinning.join()

    def _allocate(self) -> None:
        self.buf = torch.empty(self.budget, dtype=torch.uint8, pin_memory=self.pin)

    @property
    def ready(self) -> bool:
        """Whether the buffer exists (on CUDA: pinned by the background thread)."""
        return self.buf is not None

    def _tail(self) -> int:
        return self.ring[0].start if self.ring else self.head

    def _alloc(self, n: int) -> int | None:
        """Start of ``n`` contiguous bytes at the head, dropping the oldest records for room."""
        if n > self.budget:
            return None
        while True:
            tail = self._tail()
            if not self.ring:
                self.head = 0
                return 0
            if self.head > tail or (self.head == tail and not self.ring):
                if self.budget - self.head >= n:
                    return self.head
                if tail >= n:
                    return 0
            elif tail - self.head >= n:
                return self.head
            self._pop_tail()

    def _pop_tail(self) -> None:
        rec = self.ring.popleft()
        if rec.live:
            rec.live = False
            self.used -= rec.size
            self.stats.dropped += 1
            self._dropped.append(rec.owner)
        while self.ring and not self.ring[0].live:
            self.ring.popleft()

    def put(self, ids, owners) -> list[Record | None]:
        """Copy pages to the host as they lie, a record per page (None: larger than the tier); then free them."""
        with self._timed("out"):
            return self._put(np.asarray(ids, dtype=np.int64), owners)

    def take_dropped(self) -> list:
        """The owners of the records dropped for room since the last call, oldest first."""
        out, self._dropped = self._dropped, []
        return out

    def _put(self, ids: np.ndarray, owners) -> list[Record | None]:
        if self.buf is None and not self.pin:
            self._allocate()
        if self.buf is None:
            return [None] * ids.size
        off, nbytes, open_form = self.manager.page_bytes(ids)
        per_page, open_t = np.ascontiguousarray(nbytes.T), np.ascontiguousarray(open_form.T)
        out = []
        for i, size in enumerate(per_page.sum(1).tolist()):
            start = self._alloc(size)
            if start is None:
                out.append(None)
                continue
            rec = Record(start, size, per_page[i], open_t[i], owners[i])
            self.ring.append(rec)
            self.head, self.used = start + size, self.used + size
            out.append(rec)
        keep = [i for i, r in enumerate(out) if r is not None and r.live]
        if keep:
            self._copy_out(off[:, keep], nbytes[:, keep], [out[i] for i in keep])
            self.stats.pages_out += len(keep)
            self.stats.bytes_out += int(nbytes[:, keep].sum())
        return [r if r is not None and r.live else None for r in out]

    def _copy_out(self, off: np.ndarray, nbytes: np.ndarray, records: list[Record]) -> None:
        """The pages' bytes (arena offsets ``off`` [L, n]) into their records, in bounded staged batches."""
        sizes = nbytes.T.reshape(-1)
        src = off.T.reshape(-1)
        ring = np.repeat([r.start for r in records], nbytes.shape[0]) + np.concatenate(
            [np.concatenate([[0], np.cumsum(r.nbytes)[:-1]]) for r in records])
        done = None
        for i, j in batches(sizes, self.tuning.stage_out_bytes):
            done = self._stage_batch(src[i:j], ring[i:j], sizes[i:j])
        for r in records:
            r.copied = done

    def _stage_batch(self, src: np.ndarray, ring: np.ndarray, sizes: np.ndarray):
        """One batch of ranges through the next staging buffer; the event after its copy (None on the CPU)."""
        k, self._turn = self._turn, 1 - self._turn
        compute, side = torch.cuda.current_stream(self.manager.device) if self.pin else None, self.stream
        if self._stage_free[k] is not None:     # its last copy out has left it: nothing reuses it before
            compute.wait_event(self._stage_free[k])
        total = int(sizes.sum())
        if self._stage[k] is None or self._stage[k].numel() < total:
            self._stage[k] = torch.empty(max(total, min(self.tuning.stage_out_bytes, 2 * total)), dtype=torch.uint8,
                                         device=self.manager.device)
        staged = self._stage[k]
        at = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        copy_ranges(self.manager.arena, staged, src, at, sizes)
        if side is not None:                    # after the gather and any swap-in reading the ring
            side.wait_stream(compute)
        with torch.cuda.stream(side) if side is not None else nullcontext():
            pos = 0
            for a, n in _runs(list(zip(ring.tolist(), sizes.tolist()))):
                self.buf[a:a + n].copy_(staged[pos:pos + n], non_blocking=self.pin)
                pos += n
        if side is None:
            return None
        done = torch.cuda.Event()
        done.record(side)
        self._stage_free[k] = done
        return done

    def take(self, records: list[Record], ids, stream: int = 0, min_capacity: int = 0, reclaim=None) -> list[int]:
        """Restore ``records`` into the open pages ``ids`` (just allocated), bit for bit."""
        m, ids = self.manager, np.asarray(ids, dtype=np.int64)
        if not ids.size:
            return []
        dst = m.open_offsets(ids, "HostTier.take")
        left = []
        with self._timed("in"):
            for i, j in batches(np.array([r.size for r in records]), self.tuning.stage_in_bytes):
                batch, to = records[i:j], ids[i:j]
                staged = self._stage_in(batch)
                self.drop(batch)       # a copy out into their space is queued after the staging copy
                nbytes = np.stack([r.nbytes for r in batch], axis=1)
                open_form = np.stack([r.open_form for r in batch], axis=1)
                start = np.concatenate([[0], np.cumsum(nbytes.T.reshape(-1))[:-1]]).reshape(to.size, -1).T
                left += self._restore(to, dst[:, i:j], staged, start, nbytes, open_form, stream, min_capacity,
                                      reclaim)
                self.stats.bytes_in += int(nbytes.sum())
        self.stats.pages_in += ids.size
        return left

    def _stage_in(self, records: list[Record]) -> torch.Tensor:
        """The records' bytes on the device, one after another (after their copies out)."""
        m = self.manager
        if self.stream is not None:
            compute = torch.cuda.current_stream(m.device)
            for done in {id(r.copied): r.copied for r in records if r.copied is not None}.values():
                compute.wait_event(done)
        staged = torch.empty(sum(r.size for r in records), dtype=torch.uint8, device=m.device)
        at = 0
        for a, n in _runs([(r.start, r.size) for r in records]):
            staged[at:at + n].copy_(self.buf[a:a + n], non_blocking=self.pin)
            at += n
        return staged

    def _restore(self, ids: np.ndarray, dst: np.ndarray, staged: torch.Tensor, start: np.ndarray,
                 nbytes: np.ndarray, open_form: np.ndarray, stream: int, min_capacity: int, reclaim=None) -> list[int]:
        """Staged bytes (``start``/``nbytes``/``open_form`` [L, n]) into the open pages ``ids``."""
        m = self.manager
        page = m.layout.open_page_bytes
        copy_ranges(staged, m.arena, start[open_form], dst[open_form], np.full(int(open_form.sum()), page))
        sealable = ~open_form.all(0) if m.kv_compression else np.zeros(ids.size, dtype=bool)
        left = ids[~sealable].tolist()
        if sealable.any():
            m.set_streams(ids[sealable], np.full(int(sealable.sum()), stream))
            job = m.encoded_pages(ids[sealable], staged, start[:, sealable], nbytes[:, sealable])
            still = set(m.place_pages(job, min_capacity, reclaim))
            left += sorted(still)
            sealable &= ~np.isin(ids, list(still))
        if staged.device.type == "meta":
            return left
        # pages left open: their compressed layers decoded into their slots (trusted: our own encoding)
        comp = ~open_form & ~sealable[None, :]
        src, size, to = start[comp], nbytes[comp], dst[comp]
        step = max(1, self.tuning.decode_batch_bytes // page)
        for i in range(0, src.size, step):
            pages = codec.decode(staged, src[i:i + step], size[i:i + step], m.layout, trusted=True)
            k = pages.shape[0]
            copy_ranges(pages.view(torch.uint8).reshape(-1), m.arena, np.arange(k) * page, to[i:i + step],
                        np.full(k, page))
        return left

    @contextmanager
    def _timed(self, direction: str):
        """Host and device seconds of the block into ``stats`` (CUDA: events read later, no sync)."""
        t0 = time.perf_counter()
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) \
            if self.stream is not None else None
        if events:
            events[0].record(torch.cuda.current_stream(self.manager.device))
        try:
            yield
        finally:
            host = time.perf_counter() - t0
            self._add(f"host_s_{direction}", host)
            if not events:
                self._add(f"device_s_{direction}", host)
            else:
                events[1].record(torch.cuda.current_stream(self.manager.device))
                self._timings.append((direction, *events))
                if len(self._timings) > 64:
                    self.collect_timings()

    def _add(self, key: str, seconds: float) -> None:
        setattr(self.stats, key, getattr(self.stats, key) + seconds)

    def collect_timings(self, wait: bool = False) -> None:
        """Add the device seconds of the transfers whose events have completed (``wait``: all)."""
        pending = []
        for direction, start, end in self._timings:
            if wait:
                end.synchronize()
            if end.query():
                self._add(f"device_s_{direction}", start.elapsed_time(end) / 1e3)
            else:
                pending.append((direction, start, end))
        self._timings = pending

    def drop(self, records: list[Record]) -> None:
        """Let go of records (taken back, or forgotten by their owner)."""
        for r in records:
            if r.live:
                r.live = False
                self.used -= r.size
        while self.ring and not self.ring[0].live:
            self.ring.popleft()
        if not self.ring:
            self.head = 0


def _runs(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(start, size) ranges in order, each run of adjacent ones merged into one."""
    out: list[list[int]] = []
    for a, n in ranges:
        if out and out[-1][0] + out[-1][1] == a:
            out[-1][1] += n
        else:
            out.append([a, n])
    return [(a, n) for a, n in out]
