"""Per-layer packed space: where full pages go once compressed.

Each layer owns a set of *packed* chunks. New compressed pages are bump-allocated at the
layer's fill pointer (``fill_chunk``, ``fill_ptr``); a page that does not fit in the fill
chunk's tail starts a new chunk (next fit). Freed pages leave holes: a chunk whose last page is
freed goes back to the pool at once, holes inside live chunks come back through compaction.

Every stored page is at most ``open_page_bytes`` long (a page whose encoding would not be
smaller is stored in open form, see manager.py), so a packed chunk holds at least
``chunk_bytes // open_page_bytes`` pages and next fit needs at most
``ceil(live_bytes / (chunk_bytes - open_page_bytes))`` chunks: that bound is what capacity
counts as reclaimable before compaction actually runs.

Compaction of a layer (``plan_repack``): order the layer's packed chunks densest first, its
pages by (chunk rank, offset), and lay them out again by next fit over the same chunk list.
No page moves to a later position in that order, so copying pages in order (through a bounded
temporary buffer, batch by batch) never overwrites a page not yet copied.
"""

from __future__ import annotations

import numpy as np


class PackedSpace:
    def __init__(self, num_layers: int, num_chunks: int, chunk_bytes: int, max_page_bytes: int):
        self.num_layers = num_layers
        self.chunk_bytes = chunk_bytes
        self.max_page_bytes = max_page_bytes            # largest stored page (= open page)
        self.live_bytes = np.zeros(num_chunks, dtype=np.int64)
        self.live_pages = np.zeros(num_chunks, dtype=np.int64)
        self.chunks: list[set[int]] = [set() for _ in range(num_layers)]
        self.layer_live = np.zeros(num_layers, dtype=np.int64)
        self.fill_chunk = np.full(num_layers, -1, dtype=np.int64)
        self.fill_ptr = np.zeros(num_layers, dtype=np.int64)

    # ---------------------------------------------------------------- placement
    def chunks_needed(self, sizes: np.ndarray) -> np.ndarray:
        """New chunks each layer needs to place ``sizes`` [L, n] (no state change)."""
        L, n = sizes.shape
        need = np.zeros(L, dtype=np.int64)
        if n == 0:
            return need
        C = self.chunk_bytes
        start = np.where(self.fill_chunk >= 0, self.fill_ptr, C)
        fits = start + sizes.sum(1) <= C
        for layer in np.nonzero(~fits)[0].tolist():
            ptr, k = int(start[layer]), 0
            for s in sizes[layer].tolist():
                if ptr + s > C:
                    ptr, k = 0, k + 1
                ptr += s
            need[layer] = k
        return need

    def place(self, sizes: np.ndarray, take_chunk) -> np.ndarray:
        """Bump-allocate pages of ``sizes`` [L, n]; returns byte offsets [L, n].

        ``take_chunk(layer)`` gives a fresh chunk (the caller checked ``chunks_needed``).
        Fast path: all of a layer's pages fit in its fill chunk's tail -> one cumsum.
        """
        L, n = sizes.shape
        C = self.chunk_bytes
        out = np.empty((L, n), dtype=np.int64)
        if n == 0:
            return out
        start = np.where(self.fill_chunk >= 0, self.fill_ptr, C)
        ends = start[:, None] + np.cumsum(sizes, axis=1)
        fits = ends[:, -1] <= C
        if fits.any():
            base = self.fill_chunk * C
            out[fits] = (base[:, None] + ends - sizes)[fits]
            chunks = np.broadcast_to(self.fill_chunk[:, None], (L, n))[fits]
            np.add.at(self.live_bytes, chunks, sizes[fits])
            np.add.at(self.live_pages, chunks, 1)
            self.fill_ptr[fits] = ends[fits, -1]
            self.layer_live[fits] += sizes[fits].sum(1)
        for layer in np.nonzero(~fits)[0].tolist():
            for i, s in enumerate(sizes[layer].tolist()):
                if self.fill_chunk[layer] < 0 or self.fill_ptr[layer] + s > C:
                    c = take_chunk(layer)
                    self.chunks[layer].add(c)
                    self.fill_chunk[layer], self.fill_ptr[layer] = c, 0
                c = int(self.fill_chunk[layer])
                out[layer, i] = c * C + int(self.fill_ptr[layer])
                self.fill_ptr[layer] += s
                self.live_bytes[c] += s
                self.live_pages[c] += 1
                self.layer_live[layer] += s
        return out

    def free(self, offsets: np.ndarray, sizes: np.ndarray) -> list[tuple[int, int]]:
        """Free pages at ``offsets``/``sizes`` [L, n]; returns emptied (layer, chunk) pairs."""
        if offsets.size == 0:
            return []
        chunks = offsets // self.chunk_bytes
        np.subtract.at(self.live_bytes, chunks, sizes)
        np.subtract.at(self.live_pages, chunks, 1)
        self.layer_live -= sizes.sum(1)
        emptied = []
        layers = np.broadcast_to(np.arange(self.num_layers)[:, None], chunks.shape)
        for layer, c in set(zip(layers.ravel().tolist(), chunks.ravel().tolist())):
            if self.live_pages[c] == 0:
                self.chunks[layer].discard(c)
                if self.fill_chunk[layer] == c:
                    self.fill_chunk[layer], self.fill_ptr[layer] = -1, 0
                emptied.append((layer, c))
        return emptied

    # ---------------------------------------------------------------- compaction
    def reclaimable_bound(self) -> np.ndarray:
        """Chunks per layer that compaction is sure to free (next-fit bound), [L]."""
        per_chunk = self.chunk_bytes - self.max_page_bytes
        held = np.array([len(s) for s in self.chunks], dtype=np.int64)
        if per_chunk <= 0:           # one page per chunk: nothing to gain from packing
            return np.zeros(self.num_layers, dtype=np.int64)
        needed = -(-self.layer_live // per_chunk)
        return np.maximum(held - needed, 0)

    def plan_repack(self, layer: int, locs: np.ndarray, sizes: np.ndarray):
        """Next-fit layout of the layer's pages (byte offsets ``locs``, ``sizes``).

        Returns (order, new_locs, kept_chunks, freed_chunks, fill_chunk, fill_ptr): ``order``
        is the copy order (indices into ``locs``), ``new_locs[i]`` the new offset of page i.
        """
        C = self.chunk_bytes
        chunk_of = locs // C
        ranked = sorted(self.chunks[layer], key=lambda c: (-int(self.live_bytes[c]), c))
        rank = {c: r for r, c in enumerate(ranked)}
        page_rank = np.array([rank[c] for c in chunk_of.tolist()], dtype=np.int64)
        order = np.lexsort((locs, page_rank))
        s = sizes[order]
        new = np.empty(len(order), dtype=np.int64)
        # next fit, one destination chunk per iteration: pages i..j-1 fill chunk `r`
        csum = np.concatenate([[0], np.cumsum(s)])
        i, r = 0, 0
        while i < len(order):
            j = int(np.searchsorted(csum, csum[i] + C, side="right")) - 1
            j = max(j, i + 1)
            new[i:j] = ranked[r] * C + (csum[i:j] - csum[i])
            i, r = j, r + 1
        used = r
        new_locs = np.empty_like(new)
        new_locs[order] = new
        kept = ranked[:used]
        freed = ranked[used:]
        if used:
            last = order[-1]
            fill_chunk, fill_ptr = ranked[used - 1], int(new_locs[last] - ranked[used - 1] * C + sizes[last])
        else:
            fill_chunk, fill_ptr = -1, 0
        return order, new_locs, kept, freed, fill_chunk, fill_ptr

    def apply_repack(self, layer: int, new_locs: np.ndarray, sizes: np.ndarray, kept, freed,
                     fill_chunk: int, fill_ptr: int) -> None:
        for c in list(kept) + list(freed):
            self.live_bytes[c] = 0
            self.live_pages[c] = 0
        chunks = new_locs // self.chunk_bytes
        np.add.at(self.live_bytes, chunks, sizes)
        np.add.at(self.live_pages, chunks, 1)
        self.chunks[layer] = set(kept)
        self.fill_chunk[layer], self.fill_ptr[layer] = fill_chunk, fill_ptr
