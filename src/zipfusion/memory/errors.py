"""Errors the memory manager raises.

``MemoryExhausted``: the pages asked for did not fit and nothing changed. The engine's scheduler
never meets it: it asks ``capacity_new_pages()`` first and preempts before allocating.
Bad arguments (unknown page ids, double frees, wrong shapes) raise ``ValueError``/``TypeError``.
"""

from __future__ import annotations


class BudgetTooSmall(ValueError):
    """The KV budget does not hold the smallest arena for this layout (one open page in every
    layer plus the compression reserve)."""


class MemoryExhausted(RuntimeError):
    """Not enough KV memory for the requested pages; the manager's state is unchanged.

    ``needed`` and ``available`` are in new open pages (per layer).
    """

    def __init__(self, message: str, *, needed: int, available: int):
        super().__init__(message)
        self.needed = needed
        self.available = available
