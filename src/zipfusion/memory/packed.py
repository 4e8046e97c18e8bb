"""Per-layer packed space for compressed pages: next fit at a fill pointer per layer and stream
(pages expected to leave together share chunks), and compaction (``plan_repack``) that relays
pages densest chunk first, so an in-order copy never overwrites an uncopied page.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Placement(NamedTuple):
    """Next fit of pages [L, n]: page i of layer l goes to chunk ``ordinal[l, i]`` (0: the fill
    chunk, k: the k-th fresh one) at ``offset[l, i]``."""

    ordinal: np.ndarray
    offset: np.ndarray

    @property
    def need(self) -> np.ndarray:
        if self.ordinal.shape[1] == 0:
            return np.zeros(self.ordinal.shape[0], dtype=np.int64)
        return self.ordinal[:, -1].copy()

    def prefix(self, n: int) -> "Placement":
        return Placement(self.ordinal[:, :n], self.offset[:, :n])


class PackedSpace:
    def __init__(self, num_layers: int, num_chunks: int, chunk_bytes: int, max_page_bytes: int):
        self.num_layers = num_layers
        self.chunk_bytes = chunk_bytes
        self.max_page_bytes = max_page_bytes            # largest stored page (= open page)
        self.live_bytes = np.zeros(num_chunks, dtype=np.int64)
        self.live_pages = np.zeros(num_chunks, dtype=np.int64)
        self.chunks: list[set[int]] = [set() for _ in range(num_layers)]
        self.layer_live = np.zeros(num_layers, dtype=np.int64)
        self.held = np.zeros(num_layers, dtype=np.int64)
        self.fill_chunk = np.full(num_layers, -1, dtype=np.int64)      # the current stream's
        self.fill_ptr = np.zeros(num_layers, dtype=np.int64)
        self.stream = 0
        self._parked: dict[int, tuple[np.ndarray, np.ndarray]] = {}      # other streams' fill pointers
        self._bound: np.ndarray | None = None     # cached reclaimable_bound()

    def use_stream(self, stream: int) -> None:
        """Place the next pages at ``stream``'s fill pointers."""
        if stream == self.stream:
            return
        self._parked[self.stream] = (self.fill_chunk, self.fill_ptr)
        self.fill_chunk, self.fill_ptr = self._parked.pop(stream, self._fresh())
        self.stream = stream

    def _fresh(self) -> tuple[np.ndarray, np.ndarray]:
        return np.full(self.num_layers, -1, dtype=np.int64), np.zeros(self.num_layers, dtype=np.int64)

    def _fills(self, streams) -> tuple[np.ndarray, np.ndarray]:
        if streams is None:
            return self.fill_chunk, self.fill_ptr
        fills = [(self.fill_chunk, self.fill_ptr) if s == self.stream else self._parked.get(s) or self._fresh()
                 for s in streams]
        return np.concatenate([f[0] for f in fills]), np.concatenate([f[1] for f in fills])

    def _set_fills(self, streams, chunk: np.ndarray, ptr: np.ndarray) -> None:
        L = self.num_layers
        for i, s in enumerate([self.stream] if streams is None else streams):
            c, p = chunk[i * L:(i + 1) * L].copy(), ptr[i * L:(i + 1) * L].copy()
            if s == self.stream:
                self.fill_chunk, self.fill_ptr = c, p
            else:
                self._parked[s] = (c, p)

    def _drop_fill(self, layer: int, chunks) -> None:
        """Parked streams whose fill chunk in ``layer`` is among ``chunks`` start a fresh one."""
        for fill, ptr in self._parked.values():
            if fill[layer] in chunks:
                fill[layer], ptr[layer] = -1, 0

    def placement(self, sizes: np.ndarray, streams=None) -> "Placement":
        """Next fit of pages ``sizes`` [L, n] from each layer's fill pointer (no state change),
        all layers at once with one ``searchsorted`` per destination chunk. With ``streams``:
        ``sizes`` [m·L, n], row s·L + l for layer l of ``streams[s]`` (zero sizes pad rows)."""
        L, n = sizes.shape
        C = self.chunk_bytes
        if n == 0:
            return Placement(np.zeros((L, 0), np.int64), np.zeros((L, 0), np.int64))
        cs = np.cumsum(sizes, axis=1)
        excl = cs - sizes
        span = int(cs[:, -1].max()) + 2 * C + 1
        rows = np.arange(L)
        flat = (cs + rows[:, None] * span).ravel()
        fill_chunk, fill_ptr = self._fills(streams)
        base = -np.where(fill_chunk >= 0, fill_ptr, C)
        bases = [base]
        marks = np.zeros((L, n), dtype=np.int64)
        while True:
            e = np.minimum(np.searchsorted(flat, rows * span + base + C, side="right") - rows * n, n)
            more = np.nonzero(e < n)[0]
            if more.size == 0:
                break
            marks[more, e[more]] = 1
            base = base.copy()
            base[more] = excl[more, e[more]]
            bases.append(base)
        ordinal = np.cumsum(marks, axis=1)
        offset = excl - np.stack(bases, axis=1)[rows[:, None], ordinal]
        return Placement(ordinal, offset)

    def chunks_needed(self, sizes: np.ndarray, split=None) -> np.ndarray:
        """New chunks each layer needs to place ``sizes`` [L, n] (no state change)."""
        return (self.placement(sizes) if split is None else split).need

    def place(self, sizes: np.ndarray, take_chunk, split=None, streams=None) -> np.ndarray:
        """Bump-allocate pages ``sizes`` [L, n] (or [m·L, n] with ``streams``) -> byte offsets;
        ``take_chunk(layer)`` gives a fresh chunk."""
        R, n = sizes.shape
        L, C = self.num_layers, self.chunk_bytes
        if n == 0:
            return np.empty((R, 0), dtype=np.int64)
        plan = self.placement(sizes, streams) if split is None else split
        need = plan.need
        table = np.full((R, int(need.max()) + 1), -1, dtype=np.int64)
        table[:, 0] = self._fills(streams)[0]
        for r in np.nonzero(need)[0].tolist():
            layer = r % L
            for k in range(1, int(need[r]) + 1):
                table[r, k] = c = take_chunk(layer)
                self.chunks[layer].add(c)
            self.held[layer] += need[r]
        rows = np.arange(R)
        out = table[rows[:, None], plan.ordinal] * C + plan.offset
        real = sizes > 0
        seg = (rows[:, None] * table.shape[1] + plan.ordinal)[real]
        seg_bytes = np.bincount(seg, weights=sizes[real], minlength=table.size).astype(np.int64)
        seg_pages = np.bincount(seg, minlength=table.size)
        used = seg_pages > 0
        self.live_bytes[table.ravel()[used]] += seg_bytes[used]
        self.live_pages[table.ravel()[used]] += seg_pages[used]
        last = real.sum(1) - 1
        self._set_fills(streams, table[rows, plan.ordinal[rows, last]], plan.offset[rows, last] + sizes[rows, last])
        self.layer_live += sizes.sum(1).reshape(-1, L).sum(0)
        self._bound = None
        return out

    def free(self, offsets: np.ndarray, sizes: np.ndarray) -> list[tuple[int, int]]:
        """Free pages at ``offsets``/``sizes`` [L, n]; returns emptied (layer, chunk) pairs."""
        if offsets.size == 0:
            return []
        chunks = (offsets // self.chunk_bytes).ravel()
        touched, first, inv = np.unique(chunks, return_index=True, return_inverse=True)
        self.live_bytes[touched] -= np.bincount(inv, weights=sizes.ravel()).astype(np.int64)
        self.live_pages[touched] -= np.bincount(inv)
        self.layer_live -= sizes.sum(1)
        self._bound = None
        emptied = []
        dead = np.nonzero(self.live_pages[touched] == 0)[0][::-1]    # highest first: the pool hands out the lowest first
        for layer, c in zip((first[dead] // offsets.shape[1]).tolist(), touched[dead].tolist()):
            self.chunks[layer].discard(c)
            self.held[layer] -= 1
            if self.fill_chunk[layer] == c:
                self.fill_chunk[layer], self.fill_ptr[layer] = -1, 0
            self._drop_fill(layer, (c,))
            emptied.append((layer, c))
        return emptied

    def reclaimable_bound(self, more_held=None, more_live=None) -> np.ndarray:
        """Chunks per layer compaction is sure to free (next-fit bound), [L]; ``more_held`` /
        ``more_live``: the bound after a placement."""
        now = more_held is None and more_live is None
        if now and self._bound is not None:
            return self._bound.copy()
        per_chunk = self.chunk_bytes - self.max_page_bytes
        if per_chunk <= 0:
            return np.zeros(self.num_layers, dtype=np.int64)
        needed = -(-(self.layer_live + (0 if more_live is None else more_live)) // per_chunk)
        bound = np.maximum(self.held + (0 if more_held is None else more_held) - needed, 0)
        if now:
            self._bound = bound.copy()
        return bound

    def victims(self, layer: int) -> np.ndarray:
        """The layer's chunks with at least a page's worth of free bytes (the only ones repacked)."""
        ch = np.fromiter(self.chunks[layer], dtype=np.int64, count=len(self.chunks[layer]))
        return ch[self.chunk_bytes - self.live_bytes[ch] >= self.max_page_bytes]

    def plan_repack(self, layer: int, locs: np.ndarray, sizes: np.ndarray, want: int | None = None):
        """Next-fit layout of the pages in the layer's victim chunks (``want``: free that many, emptiest
        first), or None: (copy order, new_locs, kept, freed, fill_chunk, fill_ptr)."""
        C = self.chunk_bytes
        vic = self.victims(layer)
        if len(vic) < 2:
            return None
        if want is not None:
            vic = vic[np.lexsort((vic, self.live_bytes[vic]))]                # emptiest first
            need = -(-np.cumsum(self.live_bytes[vic]) // max(1, C - self.max_page_bytes))
            enough = np.nonzero(np.arange(1, len(vic) + 1) - need >= want)[0]
            vic = vic[:max(2, int(enough[0]) + 1)] if enough.size else vic
        ranked = vic[np.lexsort((vic, -self.live_bytes[vic]))]
        rank_of = np.full(len(self.live_bytes), -1, dtype=np.int64)
        rank_of[ranked] = np.arange(len(ranked))
        page_rank = rank_of[locs // C]
        sel = np.nonzero(page_rank >= 0)[0]
        order = sel[np.lexsort((locs[sel], page_rank[sel]))]
        s = sizes[order]
        new = np.empty(len(order), dtype=np.int64)
        csum = np.concatenate([[0], np.cumsum(s)])
        i, r = 0, 0
        while i < len(order):
            j = int(np.searchsorted(csum, csum[i] + C, side="right")) - 1
            j = max(j, i + 1)
            new[i:j] = ranked[r] * C + (csum[i:j] - csum[i])
            i, r = j, r + 1
        if r == len(ranked):
            return None
        new_locs = locs.copy()
        new_locs[order] = new
        kept, freed = ranked[:r].tolist(), ranked[r:].tolist()
        fill_chunk, fill_ptr = int(self.fill_chunk[layer]), int(self.fill_ptr[layer])
        if fill_chunk < 0 or rank_of[fill_chunk] >= 0:                 # the fill chunk was repacked
            if r:
                last = order[-1]
                fill_chunk, fill_ptr = kept[-1], int(new_locs[last] - kept[-1] * C + sizes[last])
            else:
                fill_chunk, fill_ptr = -1, 0
        return order, new_locs, kept, freed, fill_chunk, fill_ptr

    def apply_repack(self, layer: int, order: np.ndarray, new_locs: np.ndarray, sizes: np.ndarray,
                     kept, freed, fill_chunk: int, fill_ptr: int) -> None:
        victims = kept + freed
        self._drop_fill(layer, set(victims))
        self.live_bytes[victims] = 0
        self.live_pages[victims] = 0
        chunks = new_locs[order] // self.chunk_bytes
        np.add.at(self.live_bytes, chunks, sizes[order])
        np.add.at(self.live_pages, chunks, 1)
        self.chunks[layer].difference_update(freed)
        self.held[layer] -= len(freed)
        self._bound = None
        self.fill_chunk[layer], self.fill_ptr[layer] = fill_chunk, fill_ptr

