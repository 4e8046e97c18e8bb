"""The KV memory manager: arena, chunk pool, open groups, packed space, page table.

``KVCacheManager`` is the entry point (docs/design.md, "Memory manager"); ``Admission`` gives
the scheduler its admission numbers. ``MemoryExhausted``: an allocation that does not fit (the
scheduler asks ``capacity_new_pages()`` first and preempts, so the engine never meets it).
"""

from .admission import Admission, RunningBatch, RunningRequest
from .errors import BudgetTooSmall, MemoryExhausted
from .manager import KVCacheManager
from .stats import LayerStats, MemoryStats

__all__ = ["Admission", "BudgetTooSmall", "KVCacheManager", "LayerStats", "MemoryExhausted", "MemoryStats",
           "RunningBatch", "RunningRequest"]
