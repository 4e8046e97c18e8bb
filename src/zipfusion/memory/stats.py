"""What the memory manager reports (the engine exports these as metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from .page_table import OPEN, STORED

if TYPE_CHECKING:
    from .manager import KVCacheManager


@dataclass
class LayerStats:
    open_bytes: int              # bytes of open pages of this layer (slots in use)
    compressed_bytes: int        # bytes of stored full pages (compressed, or open form if not smaller)
    packed_chunk_bytes: int      # bytes of the chunks holding them
    free_in_chunks: int          # packed_chunk_bytes - compressed_bytes (holes + fill tail)
    fragmentation: float         # free_in_chunks / packed_chunk_bytes (0 when no chunk)
    compressible_fraction: float  # compressible blocks / blocks, over the pages stored now
    chunks: int                  # chunks owned: open-group chunks + packed chunks


@dataclass
class MemoryStats:
    arena_bytes: int
    chunk_bytes: int
    num_chunks: int
    pool_chunks: int             # free in the pool(s), pending chunks included
    pending_chunks: int          # freed, waiting for reads in flight (CUDA events)
    open_pages: int
    stored_pages: int
    capacity_new_pages: int
    pages_compressed: int        # cumulative
    pages_moved: int             # cumulative, by compaction
    bytes_moved: int
    compactions: int
    pages_reclaimed: int         # cumulative: cached pages compaction dropped instead of moving
    stored_ratio: float          # stored bytes of full pages / their open size (1.0 if none)
    layers: list[LayerStats] = field(default_factory=list)

    @property
    def used_bytes(self) -> int:
        return sum(l.open_bytes + l.compressed_bytes for l in self.layers)

    def as_dict(self) -> dict:
        """The fields, layers as dicts (dataclasses.asdict's result without its deep copy: the
        engine takes this at every new peak of pages in use)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["layers"] = [dict(vars(layer)) for layer in self.layers]
        return d


def memory_stats(m: KVCacheManager) -> MemoryStats:
    """The manager's numbers now: the arena, the pool, page counts, cumulative work, per layer."""
    C = m.chunk_bytes
    n_open, n_stored = m._counts[OPEN], m._counts[STORED]
    blocks = n_stored * m.layout.num_blocks
    layers = []
    for layer in range(m.num_layers):
        comp = int(m.packed.layer_live[layer])
        held = int(m.packed.held[layer]) * C
        layers.append(LayerStats(
            open_bytes=n_open * m.layout.open_page_bytes, compressed_bytes=comp,
            packed_chunk_bytes=held, free_in_chunks=held - comp,
            fragmentation=(held - comp) / held if held else 0.0,
            compressible_fraction=float(m._comp_blocks[layer]) / blocks if blocks else float("nan"),
            chunks=int(m.packed.held[layer]) + m.open.num_groups))
    return MemoryStats(
        arena_bytes=m.num_chunks * C, chunk_bytes=C, num_chunks=m.num_chunks,
        pool_chunks=sum(m.pool.available(p) for p in range(m.pool.num_pools)),
        pending_chunks=m.pool.pending(), open_pages=n_open, stored_pages=n_stored,
        capacity_new_pages=m.capacity_new_pages(), pages_compressed=m.pages_compressed,
        pages_moved=m.pages_moved, bytes_moved=m.bytes_moved, compactions=m.compactions,
        pages_reclaimed=m.pages_reclaimed, stored_ratio=m.stored_ratio(), layers=layers)
