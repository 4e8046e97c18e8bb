"""KVCacheManager: the arena, the page table, compression as pages fill, compaction, capacity.

Memory map (docs/design.md, "The arena and page locations"):

* one 1-D uint8 arena of ``num_chunks * chunk_bytes`` bytes, cut into chunks (chunks.py);
* open pages live in *open groups*: one chunk per layer, ``S = chunk_bytes // open_page_bytes``
  slots each, allocated in lock step across layers (open_pages.py);
* full pages, once compressed, live in each layer's *packed* chunks, bump-allocated, variable
  size, movable by compaction (packed.py). A page whose encoding would not be smaller than its
  open form (every block raw) is copied there in open form and ``page_loc`` keeps bit 0 set:
  the kernels read it as an open page, and no stored page is ever larger than an open one;
* ``page_loc[layer, page]``: ``offset | 1`` open form, ``offset`` compressed, ``-1`` none.

Capacity: ``capacity_new_pages()`` is the number of new open pages that fit in every layer at
once: free slots of the open groups plus ``S`` per group of ``L`` chunks the pool can give
(shared pool: any chunk serves any layer; static: each layer's own chunks, the "no pool"
baseline), counting chunks that compaction is sure to free, and keeping ``reserve`` chunks per
layer for compression (compressed space is allocated before the open slots are freed).

``alloc_pages`` raises :class:`MemoryExhausted` (state unchanged) when that capacity is
short: the scheduler's signal to preempt its newest request.

Device: "cuda" (Triton codec when importable), "cpu" (torch reference codec), or "meta":
accounting only, no bytes (benchmarks); then ``compress_pages`` needs the encoded ``sizes``
and ``page_loc`` lives on the CPU. On CPU ``page_loc`` shares memory with the host copy; on
CUDA the touched columns are copied after each call (the kernels read the device table).

Reads in flight: freed chunks reach another layer only after a CUDA event recorded at the
free has completed (chunks.py). Compaction and compression copy on the current stream, so
kernels enqueued earlier on that stream read the old bytes before they move; a caller using
several streams must order them against the current one.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from ..format import PageLayout
from ..format.layout import COMPRESSED_BLOCK_BYTES, RAW_BLOCK_BYTES
from . import codec
from .chunks import ChunkPool, groups_available
from .copy import move_ranges
from .errors import MemoryExhausted
from .open_pages import OpenGroups
from .packed import PackedSpace
from .stats import LayerStats, MemoryStats

FREE, OPEN, STORED = 0, 1, 2
DEFAULT_CHUNK_BYTES = 2 << 20


class KVCacheManager:
    def __init__(self, num_layers: int, layout: PageLayout, budget_bytes: int,
                 device: str | torch.device = "cpu", chunk_bytes: int = DEFAULT_CHUNK_BYTES, *,
                 shared_pool: bool = True, compression: bool = True, reserve_chunks: int = 2,
                 max_pages: int | None = None, compaction_batch_bytes: int = 64 << 20):
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        if not isinstance(layout, PageLayout):
            raise TypeError(f"layout must be a zipfusion.format.PageLayout, got {type(layout).__name__}")
        for name, v in (("budget_bytes", budget_bytes), ("chunk_bytes", chunk_bytes),
                        ("reserve_chunks", reserve_chunks)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be a non-negative int, got {v!r}")
        open_bytes = layout.open_page_bytes
        if chunk_bytes % 16 or chunk_bytes < open_bytes:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be a multiple of 16 and hold at least one "
                             f"open page ({open_bytes} bytes for H={layout.num_kv_heads}, "
                             f"D={layout.head_dim}); e.g. chunk_bytes={32 * open_bytes}")
        self.num_layers, self.layout = num_layers, layout
        self.device = torch.device(device)
        self.chunk_bytes = int(chunk_bytes)
        self.compression = compression
        self.reserve = int(reserve_chunks) if compression else 0
        self.compaction_batch_bytes = compaction_batch_bytes
        L, C = num_layers, self.chunk_bytes
        num_chunks = int(budget_bytes) // C
        need_per_layer = 1 + self.reserve
        have_per_layer = num_chunks // L
        if have_per_layer < need_per_layer:
            raise ValueError(
                f"budget_bytes={budget_bytes} is too small: one open page in each of {L} layers plus "
                f"{self.reserve} compression reserve chunk(s) per layer needs {L * need_per_layer} chunks "
                f"of {C} bytes = {L * need_per_layer * C} bytes; raise the budget or lower chunk_bytes")
        self.num_chunks = num_chunks
        self.pool = ChunkPool(num_chunks, L, shared_pool, self.device)
        self.open = OpenGroups(L, C, open_bytes)
        self.slots_per_chunk = self.open.slots_per_chunk
        self.packed = PackedSpace(L, num_chunks, C, max_page_bytes=open_bytes)
        self.arena = torch.empty(num_chunks * C, dtype=torch.uint8, device=self.device)
        if max_pages is None:         # every chunk full of the smallest pages, plus slack
            max_pages = num_chunks * C // (L * min(layout.min_page_bytes, open_bytes)) + 1
        self.max_pages = int(max_pages)
        self._loc = np.full((L, self.max_pages), -1, dtype=np.int64)     # host copy of page_loc
        self._size = np.zeros((L, self.max_pages), dtype=np.int64)       # stored bytes (STORED)
        self._state = np.zeros(self.max_pages, dtype=np.int8)
        self._group = np.zeros(self.max_pages, dtype=np.int64)
        self._slot = np.zeros(self.max_pages, dtype=np.int64)
        self._free_ids = list(range(self.max_pages - 1, -1, -1))
        if self.device.type in ("cpu", "meta"):
            self.page_loc = torch.from_numpy(self._loc)    # shares memory with the host copy
        else:
            self.page_loc = torch.from_numpy(self._loc).to(self.device)
        self._comp_blocks = np.zeros(L, dtype=np.int64)    # compressible blocks of stored pages
        self.pages_compressed = 0
        self.pages_moved = 0
        self.bytes_moved = 0
        self.compactions = 0

    # ================================================================== capacity
    def _groups_available(self, include_compaction: bool = True) -> int:
        """New open groups the pool(s) can give now, reserve kept (compaction included)."""
        L = self.num_layers
        reclaim = self.packed.reclaimable_bound() if include_compaction else np.zeros(L, np.int64)
        if self.pool.shared:
            return groups_available([self.pool.available(0) + int(reclaim.sum())], L, self.reserve)
        return groups_available([self.pool.available(l) + int(reclaim[l]) for l in range(L)], L,
                                self.reserve)

    def capacity_new_pages(self, include_compaction: bool = True) -> int:
        """New open pages that fit in every layer at once (pool and compaction included)."""
        return self.open.num_free_slots + self.slots_per_chunk * self._groups_available(include_compaction)

    # ================================================================== allocation
    def alloc_pages(self, n: int) -> list[int]:
        """``n`` new open pages (one in every layer); their page ids.

        Raises MemoryExhausted, with nothing changed, when they do not fit.
        """
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
            raise ValueError(f"alloc_pages(n) needs a non-negative int, got {n!r}")
        n = int(n)
        if n == 0:
            return []
        cap = self.capacity_new_pages()
        if n > cap or n > len(self._free_ids):
            raise MemoryExhausted(
                f"cannot allocate {n} open page(s) in each of {self.num_layers} layers: room for "
                f"{min(cap, len(self._free_ids))}; preempt a request (free its pages) and retry",
                needed=n, available=min(cap, len(self._free_ids)))
        g = self.open.groups_needed(n)
        if g:
            self._make_room_for_groups(g)
            for _ in range(g):
                chunks = np.array([self.pool.take(self.pool.pool_of(l)) for l in range(self.num_layers)],
                                  dtype=np.int64)
                self.open.add_group(chunks)
        groups, slots = self.open.alloc(n)
        ids = np.array([self._free_ids.pop() for _ in range(n)], dtype=np.int64)
        self._state[ids] = OPEN
        self._group[ids], self._slot[ids] = groups, slots
        self._loc[:, ids] = self.open.offsets(groups, slots) | 1
        self._sync(ids)
        return ids.tolist()

    def _make_room_for_groups(self, g: int) -> None:
        """Compact until the pool(s) hold ``g`` groups beyond the reserve."""
        L = self.num_layers
        if self._groups_available(include_compaction=False) >= g:
            return
        if self.pool.shared:
            order = np.argsort(-self.packed.reclaimable_bound(), kind="stable").tolist()
            for layer in order:
                self._compact_layer(layer)
                if self._groups_available(include_compaction=False) >= g:
                    return
        else:
            for layer in range(L):
                if self.pool.available(layer) - self.reserve < g:
                    self._compact_layer(layer)
        if self._groups_available(include_compaction=False) < g:   # capacity bound was checked
            raise AssertionError("compaction freed fewer chunks than its bound promised")

    # ================================================================== validation
    def _check_ids(self, ids, want_state: int | None, what: str) -> np.ndarray:
        if isinstance(ids, torch.Tensor):
            ids = ids.detach().cpu().tolist()
        if isinstance(ids, (int, np.integer)):
            ids = [ids]
        try:
            arr = np.asarray(list(ids), dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            raise TypeError(f"{what}: page ids must be a list of ints, got {ids!r}") from None
        if arr.ndim != 1:
            raise ValueError(f"{what}: page ids must be a flat list of ints")
        if arr.size == 0:
            return arr
        bad = arr[(arr < 0) | (arr >= self.max_pages)]
        if bad.size:
            raise ValueError(f"{what}: page id {int(bad[0])} does not exist (valid ids: 0..{self.max_pages - 1})")
        if np.unique(arr).size != arr.size:
            raise ValueError(f"{what}: page ids repeat in {arr.tolist()}; pass each page once")
        state = self._state[arr]
        dead = arr[state == FREE]
        if dead.size:
            raise ValueError(f"{what}: page {int(dead[0])} is not allocated (never allocated or already "
                             "freed: a double free?)")
        if want_state is not None:
            wrong = arr[state != want_state]
            if wrong.size:
                raise ValueError(f"{what}: page {int(wrong[0])} is already compressed; only open pages "
                                 "can be compressed")
        return arr

    # ================================================================== free
    def free_pages(self, ids: Iterable[int]) -> None:
        """Free pages (open or compressed) in every layer. Unknown ids / double frees: ValueError."""
        ids = self._check_ids(ids, None, "free_pages")
        if ids.size == 0:
            return
        is_open = self._state[ids] == OPEN
        op, st = ids[is_open], ids[~is_open]
        if op.size:
            for chunks in self.open.free(self._group[op], self._slot[op]):
                self._release_group(chunks)
        if st.size:
            locs = self._loc[:, st] & ~1
            sizes = self._size[:, st]
            self._comp_blocks -= self._compressible_blocks(sizes).sum(1)
            for layer, c in self.packed.free(locs, sizes):
                self.pool.release(c, self.pool.pool_of(layer))
            self._size[:, st] = 0
        self._state[ids] = FREE
        self._loc[:, ids] = -1
        self._free_ids.extend(ids.tolist())
        self._sync(ids)

    def _release_group(self, chunks: np.ndarray) -> None:
        for layer, c in enumerate(chunks.tolist()):
            self.pool.release(c, self.pool.pool_of(layer))

    # ================================================================== compression
    def _compressible_blocks(self, sizes: np.ndarray) -> np.ndarray:
        """Compressible blocks of a stored page from its encoded size (open form: counted raw)."""
        saved = self.layout.max_page_bytes - sizes
        return np.where(sizes >= self.layout.open_page_bytes, 0,
                        saved // (RAW_BLOCK_BYTES - COMPRESSED_BLOCK_BYTES))

    def compress_pages(self, ids: Iterable[int], sizes: np.ndarray | None = None) -> None:
        """Full open pages -> compressed pages in every layer.

        Per batch of at most S pages (one group's worth): encoded sizes first, then compressed
        space in each layer (a fresh chunk per layer at most), then encode, then free the open
        slots. ``sizes`` ([L, len(ids)] encoded bytes) is only for ``device="meta"``.

        A page whose encoding is not smaller than its open form is copied in open form
        (``page_loc`` stays odd). Compression uses the reserve chunks; should even they run out,
        MemoryExhausted is raised: batches already done stay compressed, the rest stay open
        (a valid state; preempt and retry).
        """
        ids = self._check_ids(ids, OPEN, "compress_pages")
        if not self.compression:
            raise ValueError("compress_pages: this manager was built with compression=False")
        meta = self.device.type == "meta"
        if meta != (sizes is not None):
            raise ValueError("compress_pages: sizes= must be given exactly when the manager is an "
                             "accounting-only manager (device='meta')")
        if sizes is not None:
            sizes = np.asarray(sizes, dtype=np.int64)
            if sizes.shape != (self.num_layers, ids.size):
                raise ValueError(f"compress_pages: sizes must have shape [num_layers, len(ids)] = "
                                 f"{[self.num_layers, ids.size]}, got {list(sizes.shape)}")
            if ((sizes < self.layout.min_page_bytes) | (sizes > self.layout.max_page_bytes) | (sizes % 16 != 0)).any():
                raise ValueError("compress_pages: sizes must be page sizes of the format "
                                 f"({self.layout.min_page_bytes}..{self.layout.max_page_bytes}, multiples of 16)")
        if ids.size == 0:
            return
        order = np.lexsort((self._slot[ids], self._group[ids]))
        S = self.slots_per_chunk
        for i in range(0, ids.size, S):
            part = order[i:i + S]
            self._compress_batch(ids[part], None if sizes is None else sizes[:, part])

    def _compress_batch(self, ids: np.ndarray, sizes: np.ndarray | None) -> None:
        L, k = self.num_layers, ids.size
        open_bytes = self.layout.open_page_bytes
        src = self._loc[:, ids] & ~1                                      # [L, k]
        state = None
        if sizes is None:
            state, flat = codec.analyze(self.arena, src.reshape(-1), self.layout)
            sizes = flat.reshape(L, k)
        as_open = sizes >= open_bytes                   # not smaller: store in open form
        stored = np.where(as_open, open_bytes, sizes)
        split = self._make_room_for_packing(stored)
        dst = self.packed.place(stored, lambda layer: self.pool.take(self.pool.pool_of(layer)), split)
        if state is not None:
            flat_open = as_open.reshape(-1)
            keep = np.nonzero(~flat_open)[0]
            codec.encode(self.arena, state, keep, dst.reshape(-1)[keep], self.layout)
            copy = np.nonzero(flat_open)[0]
            move_ranges(self.arena, src.reshape(-1)[copy], dst.reshape(-1)[copy],
                        np.full(copy.size, open_bytes, dtype=np.int64))
        self._loc[:, ids] = np.where(as_open, dst | 1, dst)
        self._size[:, ids] = stored
        self._state[ids] = STORED
        self._comp_blocks += self._compressible_blocks(sizes).sum(1)
        self.pages_compressed += k
        for chunks in self.open.free(self._group[ids], self._slot[ids]):
            self._release_group(chunks)
        self._sync(ids)

    def _make_room_for_packing(self, stored: np.ndarray):
        """Ensure every layer can take the fresh chunks that placing ``stored`` [L, k] needs
        (the reserve may be used); returns the placement split for ``packed.place``.
        Compaction moves fill pointers, so the need is recomputed after it."""
        split = self.packed._split(stored)
        need = self.packed.chunks_needed(stored, split)
        if not need.any():
            return split
        if self.pool.shared:
            if self.pool.available(0) >= need.sum():
                return split
            for layer in np.argsort(-self.packed.reclaimable_bound(), kind="stable").tolist():
                if self._compact_layer(layer):
                    split = self.packed._split(stored)
                    need = self.packed.chunks_needed(stored, split)
                if self.pool.available(0) >= need.sum():
                    return split
            short = int(need.sum()), self.pool.available(0)
        else:
            short = None
            for layer in np.nonzero(need)[0].tolist():
                if self.pool.available(layer) < need[layer] and self._compact_layer(layer):
                    split = self.packed._split(stored)
                    need = self.packed.chunks_needed(stored, split)
                if self.pool.available(layer) < need[layer]:
                    short = int(need[layer]), self.pool.available(layer)
            if short is None:
                return split
        raise MemoryExhausted(
            f"no room to compress: {short[0]} chunk(s) needed, {short[1]} free even after compaction; "
            "preempt a request and retry", needed=short[0], available=short[1])

    # ================================================================== compaction
    def compact(self, layers: Iterable[int] | None = None) -> int:
        """Repack compressed pages so that chunks with holes return to the pool.

        Moves page bytes bit-exactly and updates ``page_loc``; returns the chunks freed. Only
        chunks with at least a page's worth of free bytes are repacked, and only in layers
        where that frees a chunk. Default: every layer.
        """
        layers = range(self.num_layers) if layers is None else list(layers)
        for layer in layers:
            self._check_layer(layer)
        return sum(self._compact_layer(int(layer)) for layer in layers)

    def _compact_layer(self, layer: int) -> int:
        if self.packed.held[layer] < 2:
            return 0
        ids = np.nonzero(self._state == STORED)[0]
        locs = self._loc[layer, ids] & ~1
        sizes = self._size[layer, ids]
        plan = self.packed.plan_repack(layer, locs, sizes)
        if plan is None:                  # nothing to gain: leave the pages where they are
            return 0
        order, new_locs, kept, freed, fill_chunk, fill_ptr = plan
        moved = order[new_locs[order] != locs[order]]
        move_ranges(self.arena, locs[moved], new_locs[moved], sizes[moved], self.compaction_batch_bytes)
        self.packed.apply_repack(layer, order, new_locs, sizes, kept, freed, fill_chunk, fill_ptr)
        self._loc[layer, ids] = new_locs | (self._loc[layer, ids] & 1)
        for c in freed:
            self.pool.release(c, self.pool.pool_of(layer))
        self.pages_moved += int(moved.size)
        self.bytes_moved += int(sizes[moved].sum())
        self.compactions += 1
        if moved.size and self.device.type not in ("cpu", "meta"):
            self.page_loc[layer].copy_(torch.from_numpy(self._loc[layer]).pin_memory(), non_blocking=True)
        return len(freed)

    # ================================================================== page data
    def open_page(self, layer: int, page_id: int) -> torch.Tensor:
        """View [2, 16, H, D] bf16 of an open page in the arena (write new tokens through it)."""
        self._check_layer(layer)
        pid = int(self._check_ids([page_id], OPEN, "open_page")[0])
        loc = int(self._loc[layer, pid]) & ~1
        n = self.layout.open_page_bytes
        return self.arena[loc:loc + n].view(torch.bfloat16).view(2, 16, self.layout.num_kv_heads,
                                                                  self.layout.head_dim)

    def read_pages(self, layer: int, ids: Iterable[int]) -> torch.Tensor:
        """Contents [n, 2, 16, H, D] bf16 of pages, open or compressed (decoded)."""
        self._check_layer(layer)
        ids = self._check_ids(ids, None, "read_pages")
        H, D = self.layout.num_kv_heads, self.layout.head_dim
        out = torch.empty(ids.size, 2, 16, H, D, dtype=torch.bfloat16, device=self.device)
        loc = self._loc[layer, ids]
        is_open = (loc & 1) == 1
        if is_open.any():
            sel = np.nonzero(is_open)[0]
            out[torch.from_numpy(sel)] = codec.gather_open_pages(
                self.arena, torch.from_numpy(loc[sel] & ~1), self.layout)
        if (~is_open).any():
            sel = np.nonzero(~is_open)[0]
            out[torch.from_numpy(sel)] = codec.decode(
                self.arena, torch.from_numpy(loc[sel]), torch.from_numpy(self._size[layer, ids[sel]]),
                self.layout)
        return out

    def _check_layer(self, layer) -> None:
        if not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer!r} does not exist (0..{self.num_layers - 1})")

    # ================================================================== misc
    def _sync(self, ids: np.ndarray) -> None:
        """Mirror host page_loc columns to the device table (CPU/meta share memory)."""
        if self.device.type in ("cpu", "meta") or ids.size == 0:
            return
        # pinned staging + non_blocking: no host stall behind queued kernels (the caching host
        # allocator keeps each staging buffer alive until its copy has run)
        cols = torch.from_numpy(ids).pin_memory().to(self.device, non_blocking=True)
        vals = torch.from_numpy(np.ascontiguousarray(self._loc[:, ids])).pin_memory()
        self.page_loc[:, cols] = vals.to(self.device, non_blocking=True)

    def page_state(self, page_id: int) -> str:
        """"free", "open" or "compressed" (stored in open form counts as compressed)."""
        return ("free", "open", "compressed")[int(self._state[int(page_id)])]

    def observed_ratio(self) -> float:
        """Stored bytes of compressed pages / their open size, 1.0 when none is stored yet."""
        n = int((self._state == STORED).sum())
        if n == 0:
            return 1.0
        return float(self._size.sum()) / (n * self.num_layers * self.layout.open_page_bytes)

    def stats(self) -> MemoryStats:
        L, C = self.num_layers, self.chunk_bytes
        n_open = int((self._state == OPEN).sum())
        n_stored = int((self._state == STORED).sum())
        layers = []
        for l in range(L):
            comp = int(self.packed.layer_live[l])
            held = len(self.packed.chunks[l]) * C
            free = held - comp
            blocks = n_stored * self.layout.num_blocks
            layers.append(LayerStats(
                open_bytes=n_open * self.layout.open_page_bytes, compressed_bytes=comp,
                packed_chunk_bytes=held, free_in_chunks=free,
                fragmentation=free / held if held else 0.0,
                compressible_fraction=float(self._comp_blocks[l]) / blocks if blocks else float("nan"),
                chunks=len(self.packed.chunks[l]) + self.open.num_groups))
        return MemoryStats(
            arena_bytes=self.num_chunks * C, chunk_bytes=C, num_chunks=self.num_chunks,
            pool_chunks=sum(self.pool.available(p) for p in range(self.pool.num_pools)),
            pending_chunks=self.pool.pending(), open_pages=n_open, stored_pages=n_stored,
            capacity_new_pages=self.capacity_new_pages(), pages_compressed=self.pages_compressed,
            pages_moved=self.pages_moved, bytes_moved=self.bytes_moved, compactions=self.compactions,
            stored_ratio=self.observed_ratio(), layers=layers)
