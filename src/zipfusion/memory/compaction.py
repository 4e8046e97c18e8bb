"""Compaction: repacking a layer's emptiest packed chunks so that chunks with holes return to the
pool, just enough to free what is asked for. Pages a repack would move are first offered to the
caller's ``reclaim`` policy, which may drop them instead; bytes move bit-exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..format.layout import loc_offset, moved_loc
from .copy import move_ranges
from .page_table import STORED

if TYPE_CHECKING:
    from .manager import KVCacheManager, Reclaim


def make_room_for_groups(m: KVCacheManager, g: int, reserve: int, reclaim: Reclaim) -> None:
    """Compact until the pools hold ``g`` groups beyond ``reserve`` chunks per layer (shared pool:
    in rounds, each layer giving at most twice its share)."""
    L = m.num_layers
    if m.pool.shared:
        missing = (g + reserve) * L - m.pool.available(0)
        share = max(1, -(-2 * missing // L))
        for last in (False, True):  # rounds of shares, then whatever is left
            while missing > 0:
                before = missing
                for layer in np.argsort(-m.packed.reclaimable_bound(), kind="stable").tolist():
                    if missing <= 0:
                        break
                    missing -= compact_layer(m, layer, missing if last else min(missing, share), reclaim)
                if missing == before or last:
                    break
    else:
        for layer in range(L):
            missing = g + reserve - m.pool.available(layer)
            if missing > 0:
                compact_layer(m, layer, missing, reclaim)
    if m._groups_available(False, reserve == m.reserve) < g:
        raise AssertionError("compaction freed fewer chunks than its bound promised")


def make_room_for_packing(m: KVCacheManager, stored: np.ndarray, reclaim: Reclaim):
    """The placement split for ``packed.place`` once every layer can take its fresh chunks,
    compacting if it must; None if even compaction cannot make the room."""
    split = m.packed.placement(stored)
    need = m.packed.chunks_needed(stored, split)
    if m.pool.shared:
        for layer in np.argsort(-m.packed.reclaimable_bound(), kind="stable").tolist():
            missing = int(need.sum()) - m.pool.available(0)
            if missing <= 0:
                break
            if compact_layer(m, layer, missing, reclaim):
                split = m.packed.placement(stored)
                need = m.packed.chunks_needed(stored, split)
        return split if m.pool.available(0) >= need.sum() else None
    for layer in np.nonzero(need)[0].tolist():
        missing = int(need[layer]) - m.pool.available(layer)
        if missing > 0 and compact_layer(m, layer, missing, reclaim):
            split = m.packed.placement(stored)
            need = m.packed.chunks_needed(stored, split)
        if m.pool.available(layer) < need[layer]:
            return None
    return split


def compact_layer(m: KVCacheManager, layer: int, want: int | None, reclaim: Reclaim) -> int:
    """Repack the layer's emptiest packed chunks, enough to free ``want`` (None: all); returns
    the chunks freed."""
    if m.packed.held[layer] < 2:
        return 0
    plan = repack_plan(m, layer, want)
    gone = 0
    if plan is not None and reclaim is not None:
        held = int(m.packed.held[layer])
        ids, locs, _, (order, new_locs, *_) = plan
        before = m._counts[STORED]
        reclaim(ids[order[new_locs[order] != locs[order]]])
        if m._counts[STORED] < before:
            m.pages_reclaimed += before - m._counts[STORED]
            gone = held - int(m.packed.held[layer])
            if want is not None and gone >= want:
                return gone
            plan = (repack_plan(m, layer, None if want is None else want - gone)
                    if m.packed.held[layer] >= 2 else None)
    return gone + (0 if plan is None else repack(m, layer, plan))


def repack_plan(m: KVCacheManager, layer: int, want: int | None):
    """(stored page ids, offsets, sizes, plan), or None when repacking would free nothing."""
    t = m.table
    ids = np.nonzero(t.state == STORED)[0]
    locs = loc_offset(t.loc[layer, ids])
    sizes = t.size[layer, ids]
    plan = m.packed.plan_repack(layer, locs, sizes, want)
    return None if plan is None else (ids, locs, sizes, plan)


def repack(m: KVCacheManager, layer: int, plan) -> int:
    """Carry out a repack plan: move the pages, free the emptied chunks."""
    t = m.table
    ids, locs, sizes, (order, new_locs, kept, freed, fill_chunk, fill_ptr) = plan
    moved = order[new_locs[order] != locs[order]]
    move_ranges(m.arena, locs[moved], new_locs[moved], sizes[moved], m.compaction_batch_bytes)
    m.packed.apply_repack(layer, order, new_locs, sizes, kept, freed, fill_chunk, fill_ptr)
    t.loc[layer, ids] = moved_loc(t.loc[layer, ids], new_locs)
    m.pool.release([(c, m.pool.pool_of(layer)) for c in freed])
    m.pages_moved += int(moved.size)
    m.bytes_moved += int(sizes[moved].sum())
    m.compactions += 1
    if moved.size:
        t.sync_layer(layer)
    return len(freed)
