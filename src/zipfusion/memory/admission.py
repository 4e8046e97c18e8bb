"""Admission: what the scheduler may still promise, so that a running batch is rarely cut.

A request needs ``P = ceil((prompt + output) / 16)`` pages over its life. New pages are
allocated open and compressed when full, so it ends up holding ``r·(P - 1) + 1`` open-page units
(its full pages at the compression ratio r, its last page open). One that holds ``h`` pages now
(``h - 1`` of them sealed) will still take ``r·(P - h)``. In open-page units, the scheduler
admits a request only when

    capacity_new_pages()  >=  ceil(r' · Σ_running (P_i - h_i))     what running requests will still take
                            +  ceil(r' · (P_new - 1)) + 1          the new request, whole
                            +  ceil((1 - r') · min(step_pages, prompt pages to come))
                                                                   a step's prefill pages sit open
                                                                   until they are sealed

In the estimate mode the capacity on the left counts as much of the compression reserve
(memory/manager.py: chunks each layer keeps free for the seal to pack into) as the output pages
promised: those are free until the running requests grow into them, so the seal borrows them
meanwhile, and decode steps may take the reserve when they come (scheduler.py), while a
prefill's pages keep it (promising around the reserve cost running requests:
docs/tuning.md, "Admission").

``P_i`` counts the rest of request i's prompt and its expected output,
``min(max_tokens left, CLIP_TOKENS) · out_frac`` tokens (in the conservative mode all of
max_tokens, unclipped; the same for a request whose output length is certain: EOS ignored and no
stop strings or tokens, ``SamplingParams.fixed_length``). In the conservative mode (r' = 1) this is exact: every page a request
will ever hold is set aside, and since sealing never lowers the capacity (manager.py,
``_affordable``) an admitted request never meets a full cache. Two numbers are estimates that
adapt, as SGLang's new-token ratio does:

* ``r' = min(1, r · (1 + margin))``, r the ratio observed so far (1 until a page is stored);
  ``margin`` starts at BASE_MARGIN, grows at every preemption and decays back step by step;
* ``out_frac``, the share of its (clipped) max_tokens a request generates, learned from
  finished requests (1 until one finishes; never below OUT_FRAC_FLOOR; raised at a preemption).

Requests of certain length end at a known step and free what they hold, so in the lookahead
mode their reservations are not summed as if all were needed at once: what the running requests
(and the one being admitted) will take is the *busiest future step* of their known trajectories --
each certain request growing a token a step until its last token (FINISH_SLACK_STEPS steps
later, for prefill chunks and jitter), then giving back the full pages it holds past its
prompt's (at the ratio observed; the prompt's may be shared through the prefix cache, its open
page is not counted); requests of uncertain length keep their whole expected need to the end,
as above. It admits more at once than the sum, but runs the compressed arena near full (the
engine keeps it config.LOOKAHEAD_RESERVE_CHUNKS chunks a layer for the seal), so it is not the
default (docs/tuning.md, "Admission").

Modes: ``"estimate"`` (the above, without lookahead), ``"lookahead"``, ``"conservative"`` (r' = 1
and out_frac = 1: a running request is never preempted), ``"optimistic"`` (vLLM's: admit whatever
fits now, preempt when memory runs out).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from ..config import ADMISSION_POLICIES as MODES
from ..format import PAGE_TOKENS

ESTIMATED = ("estimate", "lookahead")       # the modes that estimate r' and out_frac
CLIP_TOKENS = 4096        # outputs longer than this are reserved for this many tokens (SGLang's clip)
BASE_MARGIN = 0.02        # the compression ratio estimate is raised by this share at least
MAX_MARGIN = 0.5
MARGIN_DECAY = 0.995      # per step, back toward BASE_MARGIN
OUT_FRAC_FLOOR = 0.25
OUT_FRAC_ALPHA = 0.05     # weight of one finished request in the out_frac average
FINISH_SLACK_STEPS = 8    # a certain request's pages are counted this many steps past its last token


def pages_for_tokens(num_tokens: int) -> int:
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return -(-num_tokens // PAGE_TOKENS)


def window_pages(window: int | None) -> int | None:
    """Most pages a request holds at once when every layer sees only its last ``window`` keys
    (the page store gives back those wholly before): the pages ``window`` tokens can span."""
    return None if window is None else -(-(window - 1) // PAGE_TOKENS) + 1


@dataclass(frozen=True)
class RunningRequest:
    """What admission needs to know of a running request."""
    pages_held: int          # pages allocated now
    num_tokens: int          # tokens it has now (prompt + generated)
    max_total_tokens: int    # prompt + max_tokens, capped by max_model_len
    certain: bool = False    # it will reach max_total_tokens (SamplingParams.fixed_length)
    prompt_tokens: int | None = None   # its prompt (None: num_tokens); pages of it may be shared


class RunningBatch:
    """The running requests as columns (what the scheduler hands over each time it asks):
    ``rows`` [n, 5] int64 of (pages held, tokens now, max total tokens, certain 0/1, prompt
    tokens)."""

    def __init__(self, rows):
        self.rows = np.asarray(rows, dtype=np.int64).reshape(-1, 5)

    @classmethod
    def of(cls, running: Iterable[RunningRequest]) -> "RunningBatch":
        return cls([(q.pages_held, q.num_tokens, q.max_total_tokens, q.certain,
                     q.num_tokens if q.prompt_tokens is None else q.prompt_tokens) for q in running])


class Admission:
    """``cache``: anything with ``capacity_new_pages()`` and ``stored_ratio()`` (the memory
    manager, or the engine's KV cache)."""

    def __init__(self, cache, mode: str = "estimate", step_tokens: int = 0, window: int | None = None):
        if mode not in MODES:
            raise ValueError(f"admission mode must be one of {MODES}, got {mode!r}")
        self.cache, self.mode, self.step_pages = cache, mode, pages_for_tokens(step_tokens)
        self.cap = window_pages(window)      # pages a request holds at most (sliding window), or None
        self.margin = BASE_MARGIN
        self.out_frac = 1.0

    # -- the estimates ----------------------------------------------------------------------
    def _span(self, tokens):
        """Pages of ``tokens`` tokens a request holds at once (int or array): all of them, or at
        most ``cap`` under a sliding window."""
        pages = -(-tokens // PAGE_TOKENS)
        return pages if self.cap is None else np.minimum(pages, self.cap)

    def ratio(self) -> float:
        """r': the share of an open page a future page is counted as."""
        if self.mode not in ESTIMATED:
            return 1.0
        return min(1.0, self.cache.stored_ratio() * (1.0 + self.margin))

    def expected_tokens(self, num_tokens: int, max_total_tokens: int, certain: bool = False) -> int:
        """Tokens a request is expected to reach: what it has plus its expected output (all of
        it when ``certain``: nothing can end it sooner)."""
        left = max(0, max_total_tokens - num_tokens)
        if self.mode not in ESTIMATED or certain:   # conservative: every page, however long the output
            return num_tokens + left
        return num_tokens + math.ceil(min(left, CLIP_TOKENS) * self.out_frac)

    def reserved_pages(self, running: Iterable[RunningRequest] | RunningBatch, extra=None, r: float | None = None,
                       outputs_only: bool = False) -> int:
        """Open-page units promised to running requests (and ``extra``, a (held, tokens, total,
        certain, prompt) row being admitted): ``expected_tokens`` of each, as pages, less the pages it
        holds, summed; in the lookahead mode with requests of certain length, at the busiest future
        step of their trajectories instead (the module's docstring). ``outputs_only``: the pages
        past each prompt's alone (what decode steps will allocate; not in the lookahead mode).
        Vectorised over the batch."""
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
        """The most open-page units certain requests (held pages, tokens now, tokens to go, prompt
        tokens) take at any future step t. Request i is alive while t <= left_i +
        FINISH_SLACK_STEPS and needs r' x (pages of min(tokens_i + t, its total) tokens, less
        those it holds now). Once ended, the pages it allocated past its prompt's full pages are
        free again: it still counts r' x the prompt pages it had yet to allocate (they may stay,
        shared through the prefix cache) and gives back, at the observed ratio, the full pages it
        holds now past its prompt's (its open last page not counted). Between two ends the need
        only rises, so the busiest step is t = 0 or some request's last counted step."""
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
        """New pages the running requests were promised: what a seal must leave room for (none
        in the optimistic mode, which promises nothing)."""
        return 0 if self.mode == "optimistic" else self.reserved_pages(running)

    def can_admit(self, prompt_tokens: int, max_new_tokens: int, running: Iterable[RunningRequest] | RunningBatch = (),
                  held_pages: int = 0, certain: bool = False) -> bool:
        """Whether a new request fits beside what ``running`` requests still need (``held_pages``:
        its first pages, already in memory: a prefix-cache hit; ``certain``: its output will be
        all ``max_new_tokens``)."""
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
        whole = self.expected_tokens(prompt_tokens, prompt_tokens + max_new_tokens, certain)  # the prompt is certain
        transient = self.transient_pages(prompt_tokens, held_pages, running, r)
        if self.mode == "lookahead" and (certain or running.rows[:, 3].any()):   # trajectories: the busiest step
            row = (held_pages + 1, prompt_tokens, prompt_tokens + max_new_tokens, int(certain), prompt_tokens)  # +1: its last page
            return self.reserved_pages(running, extra=row, r=r) + 1 + transient - self.cache.capacity_new_pages()
        new = math.ceil(r * max(0, int(self._span(whole)) - held_pages - 1)) + 1
        return new + transient + self.reserved_pages(running, r=r) - self._room(running, prompt_tokens, whole, r)

    def _room(self, running: RunningBatch, prompt_tokens: int, whole: int, r: float) -> int:
        """``capacity_new_pages()``, plus (in the estimate mode) as much of the compression reserve
        as the output pages promised (the running requests' and the new one's, at r'): decode steps
        allocate those, and they may take the reserve (scheduler.py), while a prefill keeps it."""
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
        """What future pages cost beyond their share ``r'`` while they sit open, full, waiting for
        their seal: ``(1 - r')`` of the prompt pages a step's prefill allocates at once (the prompts
        not yet in memory, the new one's included, at most a step's budget). A decode page waiting
        for its seal is not counted: a seal due now (``PageStore.seal_now``) is the scheduler's last
        resort before a preemption. ``r``: r' if the caller has it (:meth:`ratio`)."""
        held, tokens = running.rows[:, 0], running.rows[:, 1]
        prompts = int(np.maximum(0, -(-tokens // PAGE_TOKENS) - held).sum())
        prompts += max(0, pages_for_tokens(prompt_tokens) - held_pages)
        return math.ceil((1.0 - (self.ratio() if r is None else r)) * min(self.step_pages, prompts))

    # -- adapting ---------------------------------------------------------------------------
    def on_step(self) -> None:
        self.margin = BASE_MARGIN + (self.margin - BASE_MARGIN) * MARGIN_DECAY

    def on_preempt(self) -> None:
        """A running request had to be preempted: the estimates were too low."""
        self.margin = min(MAX_MARGIN, 2 * self.margin + 0.05)
        self.out_frac = min(1.0, self.out_frac + 0.1)

    def on_finish(self, generated: int, max_new_tokens: int) -> None:
        """A request finished after ``generated`` of at most ``max_new_tokens`` tokens."""
        allowed = min(max_new_tokens, CLIP_TOKENS)
        if allowed > 0:
            seen = min(1.0, generated / allowed)
            self.out_frac = max(OUT_FRAC_FLOOR, (1 - OUT_FRAC_ALPHA) * self.out_frac + OUT_FRAC_ALPHA * seen)
