"""Errors the memory manager raises.

``MemoryExhausted`` is the scheduler's signal: the request that asked for pages did not get
them, nothing changed, and the scheduler should preempt (free) the newest request and retry.
Bad arguments (unknown page ids, double frees, wrong shapes) raise ``ValueError``/``TypeError``.
"""

from __future__ import annotations


class BudgetTooSmall(ValueError):
    """The KV budget does not hold the smallest arena for this layout (one open page in every
    layer plus the compression reserve)."""


class MemoryExhausted(RuntimeError):
    """Not enough KV memory for the requested pages; the manager's state is unchanged.

    ``needed`` and ``available`` are in new open pages (per layer) for ``alloc_pages`` and in
    chunks for compression.
    """

    def __init__(self, message: str, *, needed: int, available: int):
        super().__init__(message)
        self.needed = needed
        self.available = available
