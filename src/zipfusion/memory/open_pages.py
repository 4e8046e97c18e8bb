"""Open (uncompressed) pages, allocated in lock step across layers.

Every page id exists in every layer, and a page is open in all layers or in none (it is
allocated in every layer at once and compressed in every layer at once). So open pages are
kept in *groups*: a group is one chunk in every layer, cut into ``slots_per_chunk`` slots of
``open_page_bytes``; a page's slot ``s`` of group ``g`` is at byte

    group_chunks[g, layer] * chunk_bytes + s * open_page_bytes

in layer ``layer``. One slot pop serves all layers, and the offsets of ``n`` pages in ``L``
layers are one vectorised expression instead of ``n * L`` Python steps. When every slot of a
group is free its ``L`` chunks go back to the pool.
"""

from __future__ import annotations

import numpy as np


class OpenGroups:
    def __init__(self, num_layers: int, chunk_bytes: int, open_page_bytes: int):
        self.num_layers = num_layers
        self.chunk_bytes = chunk_bytes
        self.open_page_bytes = open_page_bytes
        self.slots_per_chunk = chunk_bytes // open_page_bytes
        self.chunks: list[np.ndarray | None] = []    # group -> [L] chunk ids (None: unused id)
        self.free_slots: list[list[int]] = []        # group -> free slot stack
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
        """``n`` slots (the caller added enough groups): (groups [n], slots [n]).

        Slots come from the fullest groups first so that emptier groups can drain and return
        their chunks.
        """
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
        table = np.stack([self.chunks[g] for g in groups.tolist()], axis=1)   # [L, n]
        return table * self.chunk_bytes + slots[None, :] * self.open_page_bytes
