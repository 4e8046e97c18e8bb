"""Open pages, allocated in lock step across layers: a page is open in every layer or in none,
so open pages live in *groups* (one chunk in every layer, cut into slots), and one slot serves
all layers. An empty group's chunks go back to the pool.
"""

from __future__ import annotations

import numpy as np


class OpenGroups:
    def __init__(self, num_layers: int, chunk_bytes: int, open_page_bytes: int):
        self.num_layers = num_layers
        self.chunk_bytes = chunk_bytes
        self.open_page_bytes = open_page_bytes
        self.slots_per_chunk = chunk_bytes // open_page_bytes
        self.chunks: list[np.ndarray | None] = []  # group -> [L] chunk ids (None: unused id)
        self.free_slots: list[list[int]] = []
        self._unused_ids: list[int] = []
        self.num_free_slots = 0
        self.num_groups = 0

    def groups_needed(self, n: int) -> int:
        """New groups that ``alloc(n)`` would create."""
        missing = n - self.num_free_slots
        return 0 if missing <= 0 else -(-missing // self.slots_per_chunk)

    def add_group(self, chunks: np.ndarray) -> None:
        S = self.slots_per_chunk
        if self._unused_ids:
            g = self._unused_ids.pop()
            self.chunks[g] = chunks
            self.free_slots[g] = list(range(S - 1, -1, -1))
        else:
            self.chunks.append(chunks)
            self.free_slots.append(list(range(S - 1, -1, -1)))
        self.num_free_slots += S
        self.num_groups += 1

    def alloc(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``n`` slots: (groups [n], slots [n]), fullest groups first so emptier ones drain."""
        order = sorted((len(f), g) for g, f in enumerate(self.free_slots) if f)
        groups, slots = [], []
        for _, g in order:
            stack = self.free_slots[g]
            while stack and len(groups) < n:
                groups.append(g)
                slots.append(stack.pop())
            if len(groups) == n:
                break
        self.num_free_slots -= n
        return np.asarray(groups, dtype=np.int64), np.asarray(slots, dtype=np.int64)

    def free(self, groups: np.ndarray, slots: np.ndarray) -> list[np.ndarray]:
        """Free slots; returns the chunk arrays of groups that became empty (to release)."""
        S = self.slots_per_chunk
        touched = set()
        for g, s in zip(groups.tolist(), slots.tolist()):
            self.free_slots[g].append(s)
            touched.add(g)
        self.num_free_slots += len(groups)
        released = []
        for g in touched:
            if len(self.free_slots[g]) == S:
                released.append(self.chunks[g])
                self.chunks[g] = None
                self.free_slots[g] = []
                self._unused_ids.append(g)
                self.num_free_slots -= S
                self.num_groups -= 1
        return released

    def offsets(self, groups: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Byte offsets [L, n] of the slots in every layer."""
        if len(groups) == 0:
            return np.zeros((self.num_layers, 0), dtype=np.int64)
        table = np.stack([self.chunks[g] for g in groups.tolist()], axis=1)
        return table * self.chunk_bytes + slots[None, :] * self.open_page_bytes
