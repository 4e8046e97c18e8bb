"""What the memory manager reports (the engine exports these as metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


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
