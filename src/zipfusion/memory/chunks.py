"""The chunk pool: fixed-size arena chunks any layer may take. A chunk freed on CUDA is pending until
the kernels queued before the free ran; ``take`` may hand it out after making the stream wait.
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
# stacks: pop() gives the lowest chunk index first
        self._free = [list(reversed(r)) for r in ranges]
        self.chunks_per_pool = [len(r) for r in ranges]
        self._pending: deque = deque()
        self._pending_count = [0] * self.num_pools

    def pool_of(self, layer: int) -> int:
        return 0 if self.shared else layer

    def available(self, pool: int) -> int:
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
        """A free chunk of ``pool`` (else the oldest pending one, the stream made to wait)."""
        if not self._free[pool]:
            self._collect()
        if not self._free[pool]:
            for i, (chunk, p, event) in enumerate(self._pending):
                if p == pool:
                    if event is not None:
                        event.wait()
                    del self._pending[i]
                    self._pending_count[pool] -= 1
                    return chunk
            raise AssertionError("ChunkPool.take called on an empty pool (caller must check)")
        return self._free[pool].pop()

    def release(self, chunks: list[tuple[int, int]]) -> None:
        """Give fully free chunks back, as (chunk, pool) pairs."""
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
        """An event completing once the work enqueued so far ran, or None on the CPU (tests stand
        in a late one)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event


def groups_available(free_chunks: list[int], num_layers: int, reserve: int) -> int:
    """How many open groups (a chunk in every layer) the pools can give, keeping ``reserve``
    chunks per layer (one entry of ``free_chunks`` for a shared pool, else one per layer)."""
    if len(free_chunks) == 1 and num_layers > 1 or num_layers == 1:
        return max(0, (sum(free_chunks) - reserve * num_layers) // num_layers)
    if len(free_chunks) != num_layers:
        raise ValueError(f"free_chunks needs 1 (shared pool) or {num_layers} (one per layer) "
                         f"entries, got {len(free_chunks)}")
    return max(0, min(free_chunks) - reserve)


MAX_CHUNK_BYTES = 2 << 20  # largest chunk: one Llama-8B group of 32 open pages


def default_chunk_bytes(budget_bytes: int, num_layers: int, layout, reserve_chunks: int = 2) -> int:
    """Chunks of S open pages, S a power of two near sqrt(N / (2·reserve)): the size that
    balances next fit's waste against the reserve's."""
    open_bytes = layout.open_page_bytes
    n = max(1, int(budget_bytes) // num_layers // open_bytes)
    best = math.sqrt(n / (2 * max(1, reserve_chunks)))
    S = 1
    while 2 * S * open_bytes <= MAX_CHUNK_BYTES and 2 * S <= 64 and abs(math.log2(2 * S / best)) < abs(math.log2(S / best)):
        S *= 2
    return S * open_bytes
