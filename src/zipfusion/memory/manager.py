"""KVCacheManager: the arena, compression as pages fill, compaction, capacity (docs/design.md).

Open pages live in open groups, one chunk per layer cut into slots (open_pages.py); sealed pages in
each layer's packed chunks, movable by compaction (packed.py), in open form where encoding would not
make them smaller. Capacity is the new open pages that fit in every layer at once, ``reserve``
chunks per layer kept for the seal; placement never lowers it below what was promised."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import numpy as np
import torch

from ..format import PageLayout
from ..format.layout import loc_is_open, loc_offset, open_loc
from . import codec, compaction
from .chunks import ChunkPool, default_chunk_bytes, groups_available
from .copy import copy_ranges, move_ranges
from .errors import BudgetTooSmall, MemoryExhausted
from .open_pages import OpenGroups
from .packed import PackedSpace
from .page_table import OPEN, STATE_NAMES, STORED, PageTable
from .stats import MemoryStats, memory_stats


Reclaim = Callable[[np.ndarray], object] | None     # offered the pages compaction would move; may free some


class Analysis(NamedTuple):
    """Open pages and their encoded sizes, on their way to placement."""
    ids: np.ndarray
    state: object
    sizes: object


class KVCacheManager:
    def __init__(self, num_layers: int, layout: PageLayout, budget_bytes: int,
                 device: str | torch.device = "cpu", chunk_bytes: int | None = None, *,
                 shared_pool: bool = True, kv_compression: bool = True, reserve_chunks: int = 2,
                 max_pages: int | None = None, compaction_batch_bytes: int = 64 << 20,
                 mirror_table: bool | None = None):
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        if not isinstance(layout, PageLayout):
            raise TypeError(f"layout must be a zipfusion.format.PageLayout, got {type(layout).__name__}")
        if chunk_bytes is None:
            chunk_bytes = default_chunk_bytes(budget_bytes, num_layers, layout, reserve_chunks)
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
        self.chunk_bytes = C = int(chunk_bytes)
        self.kv_compression = kv_compression
        self.reserve = int(reserve_chunks) if kv_compression else 0
        self.compaction_batch_bytes = compaction_batch_bytes
        L = num_layers
        self.num_chunks = num_chunks = int(budget_bytes) // C
        if num_chunks // L < 1 + self.reserve:
            raise BudgetTooSmall(
                f"budget_bytes={budget_bytes} is too small: one open page in each of {L} layers plus "
                f"{self.reserve} compression reserve chunk(s) per layer needs {L * (1 + self.reserve)} "
                f"chunks of {C} bytes = {L * (1 + self.reserve) * C} bytes; raise the budget or lower chunk_bytes")
        self.pool = ChunkPool(num_chunks, L, shared_pool, self.device)
        self.open = OpenGroups(L, C, open_bytes)
        self.slots_per_chunk = self.open.slots_per_chunk
        self.packed = PackedSpace(L, num_chunks, C, max_page_bytes=open_bytes)
        self.arena = torch.empty(num_chunks * C, dtype=torch.uint8, device=self.device)
        if max_pages is None:         # every chunk full of the smallest pages, plus slack
            max_pages = num_chunks * C // (L * min(layout.min_page_bytes, open_bytes)) + 1
        self.max_pages = int(max_pages)
        self.table = PageTable(L, self.max_pages, self.device, mirror_table)
        self.page_stream = np.zeros(self.max_pages, dtype=np.int64)   # fill stream of a page's seal
        self.page_loc = self.table.page_loc
        self._comp_blocks = np.zeros(L, dtype=np.int64)
        self._stored_bytes = 0
        self._counts = {OPEN: 0, STORED: 0}
        self.pages_compressed = self.pages_moved = self.bytes_moved = self.compactions = 0
        self.pages_reclaimed = 0

    def _groups_available(self, include_compaction: bool = True, keep_reserve: bool = True,
                          gained: np.ndarray | int = 0, reclaim: np.ndarray | None = None) -> int:
        """New open groups the pool(s) can give now (compaction included)."""
        L = self.num_layers
        if reclaim is None:
            reclaim = self.packed.reclaimable_bound() if include_compaction else np.zeros(L, np.int64)
        free = reclaim + gained
        reserve = self.reserve if keep_reserve else 0
        if self.pool.shared:
            return groups_available([self.pool.available(0) + int(free.sum())], L, reserve)
        return groups_available([self.pool.available(l) + int(free[l]) for l in range(L)], L, reserve)

    def capacity_new_pages(self, include_compaction: bool = True, keep_reserve: bool = True) -> int:
        """New open pages that fit in every layer at once (pool and compaction included)."""
        return self.open.num_free_slots + self.slots_per_chunk * self._groups_available(include_compaction,
                                                                                          keep_reserve)

    def alloc_pages(self, n: int, keep_reserve: bool = True, reclaim: Reclaim = None) -> list[int]:
        """``n`` new open pages (one in every layer)."""
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
            raise ValueError(f"alloc_pages(n) needs a non-negative int, got {n!r}")
        n = int(n)
        if n == 0:
            return []
        cap = min(self.capacity_new_pages(keep_reserve=keep_reserve), self.table.num_free_ids)
        if n > cap:
            raise MemoryExhausted(
                f"cannot allocate {n} open page(s) in each of {self.num_layers} layers: room for "
                f"{cap}; preempt a request (free its pages) and retry", needed=n, available=cap)
        g = self.open.groups_needed(n)
        if g:
            compaction.make_room_for_groups(self, g, self.reserve if keep_reserve else 0, reclaim)
            for _ in range(g):
                chunks = np.array([self.pool.take(self.pool.pool_of(l)) for l in range(self.num_layers)],
                                  dtype=np.int64)
                self.open.add_group(chunks)
        groups, slots = self.open.alloc(n)
        t = self.table
        ids = t.take_ids(n)
        t.state[ids] = OPEN
        t.group[ids], t.slot[ids] = groups, slots
        t.loc[:, ids] = open_loc(self.open.offsets(groups, slots))
        t.sync(ids)
        self._counts[OPEN] += n
        return ids.tolist()

    def free_pages(self, ids: Iterable[int]) -> None:
        """Free pages (open or compressed) in every layer."""
        t = self.table
        ids = t.check(ids, None, "free_pages")
        if ids.size == 0:
            return
        is_open = t.state[ids] == OPEN
        op, st = ids[is_open], ids[~is_open]
        if op.size:
            self._release_groups(self.open.free(t.group[op], t.slot[op]))
        if st.size:
            locs = loc_offset(t.loc[:, st])
            sizes = t.size[:, st]
            self._comp_blocks -= self.layout.compressed_blocks(sizes).sum(1)
            self._stored_bytes -= int(sizes.sum())
            self.pool.release([(c, self.pool.pool_of(layer)) for layer, c in self.packed.free(locs, sizes)])
        self._counts[OPEN] -= op.size
        self._counts[STORED] -= st.size
        self.page_stream[ids] = 0
        t.release_ids(ids)

    def _release_groups(self, groups: list[np.ndarray]) -> None:
        """Chunks of emptied open groups back to the pool."""
        self.pool.release([(c, self.pool.pool_of(layer)) for chunks in groups
                           for layer, c in enumerate(chunks.tolist())])

    def analyze_pages(self, ids: Iterable[int]) -> Analysis:
        """The first half of :meth:`compress_pages`."""
        ids = self._compressible(ids, "analyze_pages")
        if ids.size == 0:
            return Analysis(ids, None, np.zeros((self.num_layers, 0), np.int64))
        state, sizes = codec.analyze(self.arena, loc_offset(self.table.loc[:, ids]).reshape(-1), self.layout)
        return Analysis(ids, state, sizes)

    def encoded_pages(self, ids: Iterable[int], buf: torch.Tensor, start: np.ndarray, nbytes: np.ndarray) -> Analysis:
        """Open pages whose encoding exists already (the host tier's swap-in), for :meth:`place_pages`."""
        ids = self._compressible(ids, "encoded_pages")
        nbytes = np.asarray(nbytes, dtype=np.int64).reshape(self.num_layers, ids.size)
        return Analysis(ids, codec.stored(buf, start, nbytes), nbytes)

    def _compressible(self, ids: Iterable[int], op: str) -> np.ndarray:
        ids = self.table.check(ids, OPEN, op)
        if not self.kv_compression:
            raise ValueError(f"{op}: this manager was built with kv_compression=False")
        return ids

    def compress_pages(self, ids: Iterable[int], min_capacity: int = 0, reclaim: Reclaim = None) -> list[int]:
        """Full open pages -> compressed pages in every layer, now."""
        return self.place_pages(self.analyze_pages(ids), min_capacity, reclaim)

    def set_streams(self, ids: Iterable[int], streams: Iterable[int]) -> None:
        """The fill stream each page is sealed into (packed.py)."""
        self.page_stream[np.asarray(list(ids), dtype=np.int64)] = np.asarray(list(streams), dtype=np.int64)

    def place_pages(self, job: Analysis, min_capacity: int = 0, reclaim: Reclaim = None,
                    keep: Iterable[int] | None = None) -> list[int]:
        """The second half of :meth:`compress_pages`."""
        t = self.table
        ids = np.asarray(job.ids, dtype=np.int64)
        alive = np.ones(ids.size, bool) if keep is None else np.isin(ids, np.asarray(list(keep), dtype=np.int64))
        t.check(ids[alive], OPEN, "place_pages")            # none freed since the analysis
        n = ids.size
        if not alive.any():
            return []
        sizes = (job.sizes if isinstance(job.sizes, np.ndarray) else job.sizes.get()).reshape(self.num_layers, n)
        stored = np.minimum(sizes, self.layout.open_page_bytes)   # not smaller: stored in open form
        streams = self.page_stream[ids]
        groups = [(stream, np.nonzero((streams == stream) & alive)[0])    # in the order given
                  for stream in dict.fromkeys(streams[alive].tolist())]
        left = []
        if not self._place_streams(ids, groups, sizes, stored, job.state, min_capacity):
            for stream, order in groups:
                self.packed.use_stream(stream)
                left += self._place_in_order(ids, order, sizes, stored, job.state, min_capacity, reclaim)
        t.sync(ids[alive])
        return left

    def _place_streams(self, ids: np.ndarray, groups: list, sizes: np.ndarray, stored: np.ndarray, state,
                       min_capacity: int) -> bool:
        """Every stream's pages of a seal placed in one go, the common case."""
        L, streams = self.num_layers, [stream for stream, _ in groups]
        stacked = np.zeros((len(groups) * L, max(order.size for _, order in groups)), dtype=np.int64)
        for i, (_, order) in enumerate(groups):
            stacked[i * L:(i + 1) * L, :order.size] = stored[:, order]
        split = self.packed.placement(stacked, streams)
        need = split.need.reshape(-1, L).sum(0)
        part = np.concatenate([order for _, order in groups])
        if not self._pool_holds(need[:, None])[0] or not self._affordable(ids[part], stored[:, part], need,
                                                                            min_capacity):
            return False
        out = self.packed.place(stacked, lambda layer: self.pool.take(self.pool.pool_of(layer)), split, streams)
        dst = [out[i * L:(i + 1) * L, :order.size] for i, (_, order) in enumerate(groups)]
        self._write(ids, part, sizes[:, part], np.concatenate(dst, axis=1), state)
        return True

    def _place_in_order(self, ids: np.ndarray, order: np.ndarray, sizes: np.ndarray, stored: np.ndarray, state,
                        min_capacity: int, reclaim: Reclaim) -> list[int]:
        """Place and encode the pages ``ids[order]`` wave by wave (``compress_pages``)."""
        t, S, n = self.table, self.slots_per_chunk, order.size
        by_slot = False
        left, i = [], 0
        while i < n:
            k, split = self._wave(stored[:, order[i:]])
            part = order[i:i + k]
            ok = self._compress_batch(ids, part, sizes[:, part], state, split, min_capacity, reclaim)
            if not ok and k > S:           # the wave would cut into promised room: one batch
                k, part = S, order[i:i + S]
                ok = self._compress_batch(ids, part, sizes[:, part], state, None, min_capacity, reclaim)
            if not ok and not by_slot:     # the rest in open-slot order: each batch empties a group
                rest = order[i:]
                order[i:] = rest[np.lexsort((t.slot[ids[rest]], t.group[ids[rest]]))]
                by_slot = True
                continue
            if not ok:
                left = ids[order[i:]].tolist()
                break
            i += k
        return left

    def _wave(self, stored: np.ndarray):
        """The next wave of pages ``stored`` [L, m] (open-slot order)."""
        S, m = self.slots_per_chunk, stored.shape[1]
        plan = self.packed.placement(stored)
        ends = np.minimum(np.arange(S, m + S, S), m) - 1
        fits = self._pool_holds(plan.ordinal[:, ends])
        b = int(fits.sum())
        if b == 0:
            return min(S, m), None
        k = min(b * S, m)
        return k, plan.prefix(k)

    def _pool_holds(self, need: np.ndarray, more: int = 0) -> np.ndarray:
        """Whether the pool's free chunks (``more`` per layer added) hold ``need`` [L, B] fresh chunks."""
        if self.pool.shared:
            return need.sum(0) <= self.pool.available(0) + more * self.num_layers
        avail = np.array([self.pool.available(self.pool.pool_of(l)) for l in range(self.num_layers)])
        return (need <= avail[:, None] + more).all(0)

    def _compress_batch(self, ids: np.ndarray, part: np.ndarray, sizes: np.ndarray, state,
                        split=None, min_capacity: int = 0, reclaim: Reclaim = None) -> bool:
        """Place, encode (one launch) and account the pages ``ids[part]`` (encoded ``sizes`` [L, k])."""
        open_bytes = self.layout.open_page_bytes
        batch = ids[part]
        as_open = sizes >= open_bytes                   # not smaller: store in open form
        stored = np.where(as_open, open_bytes, sizes)
        if split is None:
            split = compaction.make_room_for_packing(self, stored, reclaim)
            if split is None:
                flat = np.arange(self.num_layers)[:, None] * ids.size + part[None, :]
                return self._compress_staged(batch, flat, stored, as_open, state, min_capacity)
        if not self._affordable(batch, stored, self.packed.chunks_needed(stored, split), min_capacity):
            return False
        dst = self.packed.place(stored, lambda layer: self.pool.take(self.pool.pool_of(layer)), split)
        self._write(ids, part, sizes, dst, state)
        return True

    def _write(self, ids: np.ndarray, part: np.ndarray, sizes: np.ndarray, dst: np.ndarray, state) -> None:
        """The pages ``ids[part]`` (encoded ``sizes`` [L, k]), placed at ``dst``."""
        t, open_bytes = self.table, self.layout.open_page_bytes
        batch = ids[part]
        as_open = sizes >= open_bytes
        stored = np.where(as_open, open_bytes, sizes)
        flat = (np.arange(self.num_layers)[:, None] * ids.size + part[None, :])
        enc = ~as_open
        codec.encode(self.arena, state, flat[enc], dst[enc], self.layout)
        if as_open.any():
            src = loc_offset(t.loc[:, batch])
            move_ranges(self.arena, src[as_open], dst[as_open], np.full(int(as_open.sum()), open_bytes, np.int64))
        self._now_stored(batch, stored, as_open, dst)
        self._release_groups(self.open.free(t.group[batch], t.slot[batch]))

    def _compress_staged(self, batch: np.ndarray, flat: np.ndarray, stored: np.ndarray, as_open: np.ndarray,
                         state, min_capacity: int) -> bool:
        """A batch no chunk can take now, though its pages fill whole open groups (memory full of open pages)."""
        t, L = self.table, self.num_layers
        split = self.packed.placement(stored)
        need = self.packed.chunks_needed(stored, split)
        released = self._groups_emptied(batch)
        fits = bool(self._pool_holds(need[:, None], more=released)[0])
        if not released or not fits or not self._affordable(batch, stored, need, min_capacity):
            return False
        open_bytes, k = self.layout.open_page_bytes, batch.size
        src = loc_offset(t.loc[:, batch])
        at_open = np.arange(L * k, dtype=np.int64).reshape(L, k) * open_bytes
        at_enc = L * k * open_bytes + (np.cumsum(stored) - stored.ravel()).reshape(L, k)
        stage = torch.empty(L * k * open_bytes + int(stored.sum()), dtype=torch.uint8, device=self.arena.device)
        copy_ranges(self.arena, stage, src.ravel(), at_open.ravel(), np.full(L * k, open_bytes, np.int64))
        enc = ~as_open
        codec.encode(stage, codec.staged(state, flat[enc], at_open[enc], stage.device), flat[enc],
                     at_enc[enc], self.layout)
        self._release_groups(self.open.free(t.group[batch], t.slot[batch]))
        dst = self.packed.place(stored, lambda layer: self.pool.take(self.pool.pool_of(layer)), split)
        copy_ranges(stage, self.arena, np.where(as_open, at_open, at_enc).ravel(), dst.ravel(), stored.ravel())
        self._now_stored(batch, stored, as_open, dst)
        return True

    def _now_stored(self, batch: np.ndarray, stored: np.ndarray, as_open: np.ndarray, dst: np.ndarray) -> None:
        """The page table and counters after ``batch`` was written at ``dst``."""
        t = self.table
        t.loc[:, batch] = np.where(as_open, open_loc(dst), dst)
        t.size[:, batch] = stored
        t.state[batch] = STORED
        self._comp_blocks += self.layout.compressed_blocks(stored).sum(1)
        self._stored_bytes += int(stored.sum())
        self._counts[OPEN] -= batch.size
        self._counts[STORED] += batch.size
        self.pages_compressed += batch.size

    def _groups_emptied(self, batch: np.ndarray) -> int:
        """Open groups whose every live page is in ``batch`` (freeing it returns their chunks)."""
        groups, counts = np.unique(self.table.group[batch], return_counts=True)
        live = np.array([self.slots_per_chunk - len(self.open.free_slots[g]) for g in groups.tolist()])
        return int((counts == live).sum())

    def _affordable(self, batch: np.ndarray, stored: np.ndarray, need: np.ndarray, min_capacity: int) -> bool:
        """Whether placing ``batch`` (stored sizes [L, k], taking ``need`` [L] fresh chunks) and freeing its
        open slots leaves ``capacity_new_pages()`` at least ``min(now, min_capacity)``."""
        S = self.slots_per_chunk
        released = self._groups_emptied(batch)
        free_slots = self.open.num_free_slots + batch.size - S * released
        groups = self._groups_available(gained=released - need,
                                        reclaim=self.packed.reclaimable_bound(need, stored.sum(1)))
        return free_slots + S * groups >= min(self.capacity_new_pages(), min_capacity)

    def compact(self, layers: Iterable[int] | None = None, reclaim: Reclaim = None) -> int:
        """Repack every layer's compressed pages so that chunks with holes return to the pool."""
        layers = range(self.num_layers) if layers is None else list(layers)
        for layer in layers:
            self._check_layer(layer)
        return sum(compaction.compact_layer(self, int(layer), None, reclaim) for layer in layers)

    def open_page(self, layer: int, page_id: int) -> torch.Tensor:
        """View [2, 16, H, D] of an open page in the arena (write new tokens through it)."""
        self._check_layer(layer)
        pid = int(self.table.check([page_id], OPEN, "open_page")[0])
        loc = loc_offset(int(self.table.loc[layer, pid]))
        n = self.layout.open_page_bytes
        return self.arena[loc:loc + n].view(self.layout.element_dtype).view(2, 16, self.layout.num_kv_heads,
                                                                            self.layout.head_dim)

    def read_pages(self, layer: int, ids: Iterable[int]) -> torch.Tensor:
        """Contents [n, 2, 16, H, D] of pages, open or compressed (decoded)."""
        self._check_layer(layer)
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        once = list(dict.fromkeys(ids))
        if len(once) < len(ids):
            at = {p: i for i, p in enumerate(once)}
            return self.read_pages(layer, once)[torch.tensor([at[p] for p in ids], device=self.device)]
        t = self.table
        ids = t.check(ids, None, "read_pages")
        H, D = self.layout.num_kv_heads, self.layout.head_dim
        out = torch.empty(ids.size, 2, 16, H, D, dtype=self.layout.element_dtype, device=self.device)
        loc = t.loc[layer, ids]
        is_open = loc_is_open(loc)
        if is_open.any():
            sel = np.nonzero(is_open)[0]
            out[torch.from_numpy(sel).to(self.device)] = codec.gather_open_pages(
                self.arena, torch.from_numpy(loc_offset(loc[sel])), self.layout)
        if (~is_open).any():
            sel = np.nonzero(~is_open)[0]
            out[torch.from_numpy(sel).to(self.device)] = codec.decode(
                self.arena, loc[sel], t.size[layer, ids[sel]], self.layout)
        return out

    def page_bytes(self, ids) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Offsets, byte counts and open-form flags [L, n] of the pages ``ids`` in the arena."""
        t = self.table
        ids = t.check(ids, None, "page_bytes")
        loc = t.loc[:, ids]
        stored = (t.state[ids] == STORED)[None, :]
        nbytes = np.where(stored, t.size[:, ids], self.layout.open_page_bytes)
        return loc_offset(loc), nbytes, loc_is_open(loc) | ~stored

    def open_offsets(self, ids, what: str = "open_offsets") -> np.ndarray:
        """Arena offsets [L, n] of the open pages ``ids`` (ValueError naming ``what`` if one is not)."""
        return loc_offset(self.table.loc[:, self.table.check(ids, OPEN, what)])

    def _check_layer(self, layer) -> None:
        if not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer!r} does not exist (0..{self.num_layers - 1})")

    def page_state(self, page_id: int) -> str:
        """"free", "open" or "stored" (sealed: compressed, or in open form where that is not larger)."""
        return STATE_NAMES[int(self.table.state[int(page_id)])]

    def stored_ratio(self) -> float:
        """Stored bytes of compressed pages / their open size, 1.0 when none is stored yet."""
        n = self._counts[STORED]
        return self._stored_bytes / (n * self.num_layers * self.layout.open_page_bytes) if n else 1.0

    def stats(self) -> MemoryStats:
        """The numbers the engine reports (memory/stats.py)."""
        return memory_stats(self)
