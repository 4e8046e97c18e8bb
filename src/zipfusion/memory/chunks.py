"""The chunk pool: free fixed-size chunks of the arena that any layer may take.

The arena is cut into ``num_chunks`` chunks of ``chunk_bytes``. A chunk is either in a pool
(free), *pending* (freed by a layer while kernels enqueued before the free may still read it),
or owned by a layer (an open-page group chunk or a packed chunk of compressed pages).

Shared mode: one pool for all layers (a chunk freed by layer 3 can serve layer 17).
Static mode (``shared=False``, the "no pool" baseline): chunk ``c`` belongs for ever to layer
``c // (num_chunks // num_layers)``; leftover chunks are never used.

Reads in flight: on CUDA, ``release`` records an event on the current stream; the chunk
re-enters its pool once that event has completed (``event.query()``), so a kernel that was
enqueued before the free and still reads the chunk cannot see another layer's bytes. When a
pool is empty and chunks are pending, ``take`` hands out the oldest pending one and makes the
current stream wait for its event (``Stream.wait_event``): the device, not the host, waits, so a
seal or an allocation placed while a forward runs never stalls the host (every write into an
arena chunk is a kernel queued on the current stream after ``take``). On CPU (and for the
accounting-only ``meta`` device) chunks return at once.
"""

from __future__ import annotations

import math
from collections import deque

import torch


class ChunkPool:
    def __init__(self, num_chunks: int, num_layers: int, shared: bool, device: torch.device):
        self.num_chunks = num_chunks
        self.num_layers = num_layers
        self.shared = shared
        self.device = torch.device(device)
        self.num_pools = 1 if shared else num_layers
        if shared:
            ranges = [range(num_chunks)]
        else:
            per = num_chunks // num_layers
            ranges = [range(layer * per, (layer + 1) * per) for layer in range(num_layers)]
        # stacks: pop() gives the lowest chunk index first (keeps the arena's low end busy)
        self._free = [list(reversed(r)) for r in ranges]
        self.chunks_per_pool = [len(r) for r in ranges]
        self._pending: deque = deque()          # (chunk, pool, event)
        self._pending_count = [0] * self.num_pools

    def pool_of(self, layer: int) -> int:
        return 0 if self.shared else layer

    def available(self, pool: int) -> int:
        """Chunks this pool can hand out (free now or once pending reads finish)."""
        return len(self._free[pool]) + self._pending_count[pool]

    def pending(self) -> int:
        return len(self._pending)

    def _collect(self) -> None:
        """Move pending chunks whose event completed back to their pool."""
        while self._pending:
            chunk, pool, event = self._pending[0]
            if event is not None and not event.query():
                break
            self._pending.popleft()
            self._pending_count[pool] -= 1
            self._free[pool].append(chunk)

    def take(self, pool: int) -> int:
        """A free chunk of ``pool``. The caller checked ``available(pool) > 0``. With none free,
        the oldest pending chunk of the pool, the current stream made to wait for the reads
        enqueued before its release (no host wait)."""
        if not self._free[pool]:
            self._collect()
        if not self._free[pool]:
            for i, (chunk, p, event) in enumerate(self._pending):
                if p == pool:
                    if event is not None:
                        event.wait()                # the current stream waits, the host goes on
                    del self._pending[i]
                    self._pending_count[pool] -= 1
                    return chunk
            raise AssertionError("ChunkPool.take called on an empty pool (caller must check)")
        return self._free[pool].pop()

    def release(self, chunks: list[tuple[int, int]]) -> None:
        """Give fully free chunks back, as (chunk, pool) pairs; on CUDA they wait (one event)
        for the reads already enqueued."""
        if not chunks:
            return
        event = self._reads_done()
        if event is None:
            for chunk, pool in chunks:
                self._free[pool].append(chunk)
            return
        for chunk, pool in chunks:
            self._pending.append((chunk, pool, event))
            self._pending_count[pool] += 1
        self._collect()

    def _reads_done(self):
        """An event that completes once the work enqueued so far has run (CUDA: recorded on the
        current stream), or None where work runs as it is called (the CPU). Tests stand in a
        late one on the CPU (tests/test_engine.py) to take the pending path."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event


def groups_available(free_chunks: list[int], num_layers: int, reserve: int) -> int:
    """How many open groups (one chunk in every layer) the pools can give, keeping ``reserve``
    chunks per layer.

    ``free_chunks`` has one entry for a shared pool (any chunk serves any layer: a group takes
    ``num_layers`` of them) or one entry per layer (static ownership: a group takes one chunk
    of each layer, so the tightest layer decides).
    """
    if len(free_chunks) == 1 and num_layers > 1 or num_layers == 1:
        return max(0, (sum(free_chunks) - reserve * num_layers) // num_layers)
    if len(free_chunks) != num_layers:
        raise ValueError(f"free_chunks needs 1 (shared pool) or {num_layers} (one per layer) "
                         f"entries, got {len(free_chunks)}")
    return max(0, min(free_chunks) - reserve)


MAX_CHUNK_BYTES = 2 << 20          # largest chunk: 2 MiB (one Llama-8B group of 32 open pages)


def default_chunk_bytes(budget_bytes: int, num_layers: int, layout, reserve_chunks: int = 2) -> int:
    """Chunks of S open pages, S a power of two. Two costs pull S apart: next fit leaves on
    average half a compressed page unused at the end of each packed chunk (a share ~1/(2S) of
    the arena), and the compression reserve keeps ``reserve_chunks`` chunks per layer (a share
    ~reserve·S/N, N open pages per layer). Their sum is smallest near S = sqrt(N / (2·reserve)):
    small arenas get small chunks, large ones 2 MiB."""
    open_bytes = layout.open_page_bytes
    n = max(1, int(budget_bytes) // num_layers // open_bytes)
    best = math.sqrt(n / (2 * max(1, reserve_chunks)))
    S = 1
    while 2 * S * open_bytes <= MAX_CHUNK_BYTES and 2 * S <= 64 and abs(math.log2(2 * S / best)) < abs(math.log2(S / best)):
        S *= 2
    return S * open_bytes
