"""Admission numbers for the scheduler.

A request needs ``ceil((prompt + max_new_tokens) / 16)`` pages over its life. New pages are
always allocated open (uncompressed), so the conservative rule counts every page a request
will still allocate at open size:

    admit  iff  capacity_new_pages()  >=  sum over running requests of their remaining pages
                                          + pages of the new request + margin

``margin`` covers pages that hold memory twice for a while: each request's partly filled last
page keeps its open slot while earlier pages need compressed room, so one page per request
(running ones and the new one).

``mode="estimate"`` (like SGLang's new-token ratio) counts future pages at the compression
ratio observed so far (stored bytes / open bytes of the compressed pages, floored at
``min_ratio``) plus one open page per request; it admits more, and if the estimate was too
optimistic ``alloc_pages`` raises MemoryExhausted and the scheduler preempts its newest request.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from ..format import PAGE_TOKENS


def pages_for_tokens(num_tokens: int) -> int:
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return -(-num_tokens // PAGE_TOKENS)


@dataclass(frozen=True)
class RunningRequest:
    """What admission needs to know of a running request."""
    pages_held: int          # pages allocated now
    total_tokens: int        # prompt + max_new_tokens

    @property
    def remaining_pages(self) -> int:
        return max(0, pages_for_tokens(self.total_tokens) - self.pages_held)


class Admission:
    def __init__(self, manager, mode: str = "conservative", min_ratio: float = 0.5):
        if mode not in ("conservative", "estimate"):
            raise ValueError(f"mode must be 'conservative' or 'estimate', got {mode!r}")
        if not 0.0 < min_ratio <= 1.0:
            raise ValueError(f"min_ratio must be in (0, 1], got {min_ratio}")
        self.manager, self.mode, self.min_ratio = manager, mode, min_ratio

    def ratio(self) -> float:
        """Fraction of an open page that a future page is counted as."""
        if self.mode == "conservative" or not self.manager.compression:
            return 1.0
        return min(1.0, max(self.min_ratio, self.manager.observed_ratio()))

    def reserved_pages(self, running: Iterable[RunningRequest]) -> int:
        """Open-page units promised to running requests."""
        running = list(running)
        return self._reserved(sum(req.remaining_pages for req in running), len(running))

    def _reserved(self, remaining_pages: int, num_running: int) -> int:
        return math.ceil(remaining_pages * self.ratio()) + num_running

    def headroom(self, running: Iterable[RunningRequest]) -> int:
        """capacity_new_pages() minus what running requests still need (may be negative)."""
        return self.manager.capacity_new_pages() - self.reserved_pages(running)

    def can_admit(self, prompt_tokens: int, max_new_tokens: int,
                  running: Iterable[RunningRequest] = ()) -> bool:
        """Whether a new request fits with the room promised to ``running``."""
        running = list(running)
        return self.can_admit_counts(prompt_tokens, max_new_tokens,
                                     sum(req.remaining_pages for req in running), len(running))

    def can_admit_counts(self, prompt_tokens: int, max_new_tokens: int, remaining_pages: int,
                         num_running: int) -> bool:
        """``can_admit`` for a scheduler that keeps the running requests' totals itself:
        ``remaining_pages`` = pages they will still allocate, ``num_running`` = how many."""
        if prompt_tokens < 1 or max_new_tokens < 0:
            raise ValueError(f"need prompt_tokens >= 1 and max_new_tokens >= 0, got "
                             f"{prompt_tokens}, {max_new_tokens}")
        if remaining_pages < 0 or num_running < 0:
            raise ValueError(f"remaining_pages and num_running must be >= 0, got "
                             f"{remaining_pages}, {num_running}")
        new = pages_for_tokens(prompt_tokens + max_new_tokens)
        need = math.ceil(new * self.ratio()) + 1
        headroom = self.manager.capacity_new_pages() - self._reserved(remaining_pages, num_running)
        return headroom >= need
