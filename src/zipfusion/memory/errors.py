"""Errors the memory manager raises (bad arguments raise ``ValueError``/``TypeError``)."""

from __future__ import annotations


class BudgetTooSmall(ValueError):
    """The KV budget does not hold the smallest arena for this layout."""


class MemoryExhausted(RuntimeError):
    """Not enough KV memory for the requested pages (``needed``, ``available``: new open pages);
    the manager's state is unchanged."""

    def __init__(self, message: str, *, needed: int, available: int):
        super().__init__(message)
        self.needed = needed
        self.available = available
