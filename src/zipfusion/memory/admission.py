"""Admission: what the scheduler may still promise, so that a running batch is rarely cut
(docs/tuning.md, "Admission"). A request is admitted when the capacity covers what the running
requests will still take, itself whole, and a step's prefill pages left open until sealed; future
pages count at r' = r·(1 + margin) of an open page, outputs at out_frac of max_tokens (both adapt).
Modes: estimate, lookahead (certain lengths at their busiest step), conservative, optimistic."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from ..config import ADMISSION_POLICIES as MODES
from ..format import PAGE_TOKENS

ESTIMATED = ("estimate", "lookahead")
CLIP_TOKENS = 4096        # outputs longer than this are reserved for this many tokens (SGLang's clip)
BASE_MARGIN = 0.02
MAX_MARGIN = 0.5
MARGIN_DECAY = 0.995
OUT_FRAC_FLOOR = 0.25
OUT_FRAC_ALPHA = 0.05
FINISH_SLACK_STEPS = 8    # a certain request's pages are counted this many steps past its last token


def pages_for_tokens(num_tokens: int) -> int:
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return -(-num_tokens // PAGE_TOKENS)


def window_pages(window: int | None) -> int | None:
    """Most pages a request holds when every layer sees only its last ``window`` keys (None: no window)."""
    return None if window is None else -(-(window - 1) // PAGE_TOKENS) + 1


@dataclass(frozen=True)
class RunningRequest:
    pages_held: int
    num_tokens: int
    max_total_tokens: int
    certain: bool = False
    prompt_tokens: int | None = None


class RunningBatch:
    """The running requests as rows of (pages held, tokens, max total tokens, certain, prompt tokens)."""

    def __init__(self, rows):
        self.rows = np.asarray(rows, dtype=np.int64).reshape(-1, 5)

    @classmethod
    def of(cls, running: Iterable[RunningRequest]) -> "RunningBatch":
        return cls([(q.pages_held, q.num_tokens, q.max_total_tokens, q.certain,
                     q.num_tokens if q.prompt_tokens is None else q.prompt_tokens) for q in running])


class Admission:

    def __init__(self, cache, mode: str = "estimate", step_tokens: int = 0, window: int | None = None):
        if mode not in MODES:
            raise ValueError(f"admission mode must be one of {MODES}, got {mode!r}")
        self.cache, self.mode, self.step_pages = cache, mode, pages_for_tokens(step_tokens)
        self.cap = window_pages(window)
        self.margin = BASE_MARGIN
        self.out_frac = 1.0

    def _span(self, tokens):
        pages = -(-tokens // PAGE_TOKENS)
        return pages if self.cap is None else np.minimum(pages, self.cap)

    def ratio(self) -> float:
        """r': the share of an open page a future page is counted as."""
        if self.mode not in ESTIMATED:
            return 1.0
        return min(1.0, self.cache.stored_ratio() * (1.0 + self.margin))

    def expected_tokens(self, num_tokens: int, max_total_tokens: int, certain: bool = False) -> int:
        """Tokens a request is expected to reach."""
        left = max(0, max_total_tokens - num_tokens)
        if self.mode not in ESTIMATED or certain:
            return num_tokens + left
        return num_tokens + math.ceil(min(left, CLIP_TOKENS) * self.out_frac)

    def reserved_pages(self, running: Iterable[RunningRequest] | RunningBatch, extra=None, r: float | None = None,
                       outputs_only: bool = False) -> int:
        """Open-page units promised to running requests (and ``extra``, a row being admitted)."""
        if not isinstance(running, RunningBatch):
            running = RunningBatch.of(running)
        rows = running.rows if extra is None else np.vstack([running.rows, np.asarray(extra, np.int64)[None]])
        r = self.ratio() if r is None else r
        held, tokens, total, certain, prompt = rows.T
        left = np.maximum(0, total - tokens)
        if self.mode in ESTIMATED:
            left = np.where(certain != 0, left, np.ceil(np.minimum(left, CLIP_TOKENS) * self.out_frac).astype(np.int64))
        have = np.maximum(held, self._span(tokens)) if outputs_only else held
        future = np.maximum(0, self._span(tokens + left) - have)
        sure = certain != 0
        if self.mode != "lookahead" or not sure.any() or outputs_only:
            return math.ceil(r * int(future.sum()))
        return math.ceil(r * int(future[~sure].sum())
                         + self._busiest(held[sure], tokens[sure], left[sure], prompt[sure], r))

    def _busiest(self, held, tokens, left, prompt, r: float) -> float:
        """The most open-page units requests of certain length take at any future step."""
        end = left + FINISH_SLACK_STEPS
        times = np.unique(np.concatenate([[0], end]))
        grown = self._span(np.minimum(tokens[:, None] + times[None, :], (tokens + left)[:, None]))
        alive = end[:, None] >= times[None, :]
        shared = prompt // PAGE_TOKENS if self.cap is None else np.minimum(prompt // PAGE_TOKENS, self.cap)
        keep = np.maximum(0, shared - held)[:, None]
        need = np.where(alive, np.maximum(0, grown - held[:, None]), keep).sum(axis=0)
        own = np.maximum(0, held - 1 - shared)
        freed = np.where(alive, 0, own[:, None]).sum(axis=0)
        observed = min(1.0, self.cache.stored_ratio())
        return float((r * need - observed * freed).max())

    def promised_pages(self, running: Iterable[RunningRequest] | RunningBatch) -> int:
        return 0 if self.mode == "optimistic" else self.reserved_pages(running)

    def can_admit(self, prompt_tokens: int, max_new_tokens: int, running: Iterable[RunningRequest] | RunningBatch = (),
                  held_pages: int = 0, certain: bool = False) -> bool:
        """Whether a new request fits beside what ``running`` requests still need."""
        return self.shortfall(prompt_tokens, max_new_tokens, running, held_pages, certain) <= 0

    def shortfall(self, prompt_tokens: int, max_new_tokens: int, running: Iterable[RunningRequest] | RunningBatch = (),
                  held_pages: int = 0, certain: bool = False) -> int:
        """New pages missing for the request to be admitted (<= 0: it fits)."""
        if prompt_tokens < 1 or max_new_tokens < 0:
            raise ValueError(f"need prompt_tokens >= 1 and max_new_tokens >= 0, got "
                             f"{prompt_tokens}, {max_new_tokens}")
        if self.mode == "optimistic":
            return 0
        if not isinstance(running, RunningBatch):
            running = RunningBatch.of(running)
        r = self.ratio()
        whole = self.expected_tokens(prompt_tokens, prompt_tokens + max_new_tokens, certain)
        transient = self.transient_pages(prompt_tokens, held_pages, running, r)
        if self.mode == "lookahead" and (certain or running.rows[:, 3].any()):
            row = (held_pages + 1, prompt_tokens, prompt_tokens + max_new_tokens, int(certain), prompt_tokens)
            return self.reserved_pages(running, extra=row, r=r) + 1 + transient - self.cache.capacity_new_pages()
        new = math.ceil(r * max(0, int(self._span(whole)) - held_pages - 1)) + 1
        return new + transient + self.reserved_pages(running, r=r) - self._room(running, prompt_tokens, whole, r)

    def _room(self, running: RunningBatch, prompt_tokens: int, whole: int, r: float) -> int:
        """The capacity, plus (estimate mode) as much of the compression reserve as output pages promised."""
        room = self.cache.capacity_new_pages()
        if self.mode != "estimate":
            return room
        spare = self.cache.capacity_new_pages(keep_reserve=False) - room
        if spare <= 0:
            return room
        outputs = self.reserved_pages(running, r=r, outputs_only=True)
        outputs += math.ceil(r * int(self._span(whole) - self._span(prompt_tokens)))
        return room + min(spare, outputs)

    def transient_pages(self, prompt_tokens: int, held_pages: int, running: RunningBatch,
                        r: float | None = None) -> int:
        """What future pages cost beyond their share ``r'`` while they sit open, full, waiting for their seal."""
        held, tokens = running.rows[:, 0], running.rows[:, 1]
        prompts = int(np.maximum(0, -(-tokens // PAGE_TOKENS) - held).sum())
        prompts += max(0, pages_for_tokens(prompt_tokens) - held_pages)
        return math.ceil((1.0 - (self.ratio() if r is None else r)) * min(self.step_pages, prompts))

    def on_step(self) -> None:
        self.margin = BASE_MARGIN + (self.margin - BASE_MARGIN) * MARGIN_DECAY

    def on_preempt(self) -> None:
        self.margin = min(MAX_MARGIN, 2 * self.margin + 0.05)
        self.out_frac = min(1.0, self.out_frac + 0.1)

    def on_finish(self, generated: int, max_new_tokens: int) -> None:
        allowed = min(max_new_tokens, CLIP_TOKENS)
        if allowed > 0:
            seen = min(1.0, generated / allowed)
            self.out_frac = max(OUT_FRAC_FLOOR, (1 - OUT_FRAC_ALPHA) * self.out_frac + OUT_FRAC_ALPHA * seen)
