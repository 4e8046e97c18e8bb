"""The KV memory manager (docs/design.md, "Memory manager"): arena, chunk pool, open groups,
packed space and page table; ``KVCacheManager`` is the entry point."""

from .admission import Admission, RunningBatch, RunningRequest
from .errors import BudgetTooSmall, MemoryExhausted
from .manager import KVCacheManager
from .stats import LayerStats, MemoryStats

__all__ = ["Admission", "BudgetTooSmall", "KVCacheManager", "LayerStats", "MemoryExhausted", "MemoryStats",
           "RunningBatch", "RunningRequest"]
