"""What the engine tells about its steps, beside its results: a step's result and numbers
(``StepResult``, ``StepStats``: what observers get), the host clock of its phases, the watch on
the GPU memory it reserves, and the counters of reused K/V."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from .llm_engine import LLMEngine

log = logging.getLogger("zipfusion")


class PhaseClock:
    """Host seconds of a step's phases: ``mark(phase)`` adds the time since the last mark to the
    phase's total (a phase may come back)."""

    PHASES = ("schedule", "forward", "seal", "ahead", "finish")

    def __init__(self):
        self.start = self._last = time.perf_counter()
        self._s = dict.fromkeys(self.PHASES, 0.0)

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self._s[phase] += now - self._last
        self._last = now

    def times(self) -> dict:
        """StepStats' timing fields."""
        return {"start": self.start, "seconds": self._last - self.start,
                **{f"{p}_s": self._s[p] for p in self.PHASES}}


class MemoryWatch:
    """On CUDA: a warning each time the caching allocator's reserved GPU memory passes its
    high-water mark by more than ``STEP_MIB`` (memory that a server should hold flat after its
    warm-up), naming what the step did and what the memory system did in it (host-tier swaps,
    compaction, pages compressed), so that the growth can be traced to its cause. A host call to
    the allocator's counters a step."""

    STEP_MIB = 64

    def __init__(self, engine: "LLMEngine", reserved=torch.cuda.memory_reserved,
                 peak=torch.cuda.max_memory_allocated):
        self.engine, self.steps, self.reserved, self.peak = engine, 0, reserved, peak
        self.high = reserved(engine.device)
        self.last = self._counters()

    def _counters(self) -> dict:
        e, out = self.engine, {}
        if e.host_tier is not None:
            out.update(host_out=e.host_tier.stats.pages_out, host_in=e.host_tier.stats.pages_in)
        manager = getattr(e.cache, "manager", None)
        if manager is not None:
            out.update(compactions=manager.compactions, moved_mib=manager.bytes_moved >> 20,
                       compressed=manager.pages_compressed)
        return out

    def check(self, res: "StepResult", placed: int) -> None:
        self.steps += 1
        now, counters = self.reserved(self.engine.device), self._counters()
        if now > self.high + (self.STEP_MIB << 20):
            during = ", ".join(f"{k} +{v - self.last.get(k, 0)}" for k, v in counters.items())
            log.warning("GPU memory reserved by torch grew %d -> %d MiB (allocated peak %d MiB) at step %d: %d "
                        "decode rows, %d prefill tokens, %d pages sealed; the memory system in this step: %s",
                        self.high >> 20, now >> 20, self.peak(self.engine.device) >> 20,
                        self.steps, res.decode_rows, res.prefill_tokens, placed, during)
            self.high = now
        self.last = counters


class StepResult(NamedTuple):
    """What one :meth:`LLMEngine.step` did: the requests that finished, the rows it sampled
    (``logits[i]`` is the row that gave ``sampled[i]`` its newest token: valid until the next
    step, clone to keep), and its size."""
    finished: list
    sampled: list
    logits: object                   # torch.Tensor [len(sampled), V] fp32, or None
    decode_rows: int
    prefill_tokens: int
    running: int                     # requests running after scheduling
    preempted: int


class StepStats(NamedTuple):
    """A step's numbers beyond its result, for the engine's observers (:meth:`LLMEngine.add_observer`:
    benchmarks): seconds from the host clock (:class:`PhaseClock`)."""
    sealed_pages: int                # pages handed to the seal's placement (those it left open are handed again later)
    recomputed_tokens: int           # prefill tokens whose K/V had been computed before a preemption
    context_tokens: int              # the decode rows' context lengths, summed (what decode attention reads)
    start: float                     # time.perf_counter() at the step's start
    seconds: float
    schedule_s: float
    forward_s: float                 # the forward and the sampling launched (on CUDA: queued, not waited for)
    seal_s: float                    # the page store's call behind the forward: placement and encode launch, full pages collected, analysis launch
    ahead_s: float                   # scheduling the next step while this one ran on the GPU (async_scheduling)
    finish_s: float                  # the sampled tokens back and appended, stop checks, finished requests let go


def reuse_stats(scheduler, recomputed_tokens: int) -> dict:
    """What K/V was reused, moved or thrown away, now: the prefix cache's hits over lookups (in
    prompt tokens), pages cached / evictable; its host tier's bytes, pages swapped and the
    seconds the swaps took; preemptions and the prefill tokens computed again after them."""
    p = scheduler.prefix
    out = {"prefix_cache_enabled": p.enabled, "prefix_cache_queried_tokens": p.stats.queried_tokens,
           "prefix_cache_hit_tokens": p.stats.hit_tokens, "prefix_cache_hit_rate": p.stats.hit_rate,
           "prefix_cache_pages": p.num_cached_pages, "prefix_cache_evictable_pages": p.num_evictable_pages,
           "prefix_cache_evicted_pages": p.stats.evicted_pages, "host_tier_bytes": 0,
           "host_tier_budget_bytes": 0, "host_tier_pages": p.num_host_pages,
           "preemptions": scheduler.num_preemptions, "recomputed_tokens": recomputed_tokens}
    if p.host is not None:
        h = p.host.stats
        p.host.collect_timings()
        out.update(host_tier_bytes=p.host.used, host_tier_budget_bytes=p.host.budget, swapped_out_pages=h.pages_out,
                   swapped_in_pages=h.pages_in, swapped_out_bytes=h.bytes_out, swapped_in_bytes=h.bytes_in,
                   host_tier_dropped_pages=h.dropped, swap_out_host_s=h.host_s_out, swap_in_host_s=h.host_s_in,
                   swap_out_device_s=h.device_s_out, swap_in_device_s=h.device_s_in)
    return out
