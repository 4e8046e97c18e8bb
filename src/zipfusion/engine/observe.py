"""What the engine tells about its steps: results and numbers for observers, the phase clock, the
GPU memory watch and the reuse counters."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from .llm_engine import LLMEngine

log = logging.getLogger("zipfusion")


class PhaseClock:
    """Host seconds of a step's phases."""

    PHASES = ("schedule", "forward", "seal", "ahead", "finish")

    def __init__(self):
        self.start = self._last = time.perf_counter()
        self._s = dict.fromkeys(self.PHASES, 0.0)

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self._s[phase] += now - self._last
        self._last = now

    def times(self) -> dict:
        return {"start": self.start, "seconds": self._last - self.start,
                **{f"{p}_s": self._s[p] for p in self.PHASES}}


class MemoryWatch:
    """CUDA: warn when reserved GPU memory passes its high-water mark by ``STEP_MIB``, naming the step."""

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
    """What one :meth:`LLMEngine.step` did."""
    finished: list
    sampled: list
    logits: object
    decode_rows: int
    prefill_tokens: int
    running: int
    preempted: int


class StepStats(NamedTuple):
    """A step's numbers beyond its result, for the engine's observers (benchmarks)."""
    sealed_pages: int                # pages handed to the seal's placement
    recomputed_tokens: int
    context_tokens: int
    start: float
    seconds: float
    schedule_s: float
    forward_s: float
    seal_s: float                    # the page store's call behind the forward
    ahead_s: float
    finish_s: float


def reuse_stats(scheduler, recomputed_tokens: int) -> dict:
    """What K/V was reused, moved or thrown away, now."""
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
