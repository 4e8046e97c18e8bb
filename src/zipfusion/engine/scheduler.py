"""Continuous batching: waiting and running queues, chunked prefill, decode batches,
admission from the KV cache's capacity, preemption by recompute.

Each step is either a *prefill* step (chunks of prompts, up to ``max_num_batched_tokens``
tokens, oldest first) or, when no prompt work is pending, a *decode* step over every running
request. Pages are allocated here, before the step, so the runner only writes into them. When
a decode step needs more pages than fit, the newest running request is preempted: its pages
are freed and it goes back to the front of the waiting queue, to be prefilled again from its
prompt and the tokens it already generated (its sampler state is kept).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .kv_cache import KVCache
from .request import PAGE_TOKENS, Request, Status


class KVCacheTooSmall(RuntimeError):
    """One request alone does not fit in the KV memory."""


@dataclass
class PrefillChunk:
    request: Request
    start: int          # first token position of the chunk (== request.num_computed)
    length: int

    @property
    def completes(self) -> bool:
        """The chunk reaches the last token: its last logits sample the next token."""
        return self.start + self.length == self.request.num_tokens


@dataclass
class SchedulerOutput:
    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    def __init__(self, cache: KVCache, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 max_model_len: int = 8192, admission=None):
        """``admission``: None admits whatever fits now and preempts when memory runs out
        (vLLM's way); or an object with ``can_admit(prompt_tokens, max_new_tokens, running)``
        (``zipfusion.memory.Admission``: reserve room for every running request's remaining
        tokens, "conservative" at open size or "estimate" at the observed compression ratio)."""
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.admission = admission
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._unsealed: set[int] = set()       # full pages left open when compressed space ran out

    def add(self, req: Request) -> None:
        if len(req.prompt_ids) == 0:
            raise ValueError(f"request {req.request_id}: empty prompt")
        if len(req.prompt_ids) >= self.max_model_len:
            raise ValueError(f"request {req.request_id}: prompt of {len(req.prompt_ids)} tokens does not fit "
                             f"max_model_len={self.max_model_len}; shorten the prompt or raise max_model_len")
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        while True:
            self._schedule_prefill(out)
            if not out.prefill:
                self._schedule_decode(out)
            if not out.empty or len(self.running) < 2:
                break
            # only half-prefilled requests are running and none can grow: free the newest
            out.preempted.append(self._preempt(self.running[-1]))
        if out.empty and self.running:
            r = self.running[0]
            raise KVCacheTooSmall(
                f"request {r.request_id} ({r.num_tokens} tokens) does not fit in the KV memory; "
                "give more kv_memory_gb or shorten the prompt")
        if out.empty and self.waiting and not self.running:
            req = self.waiting[0]
            raise KVCacheTooSmall(
                f"request {req.request_id} ({req.num_tokens} tokens) does not fit in the KV memory "
                f"({self.cache.capacity_new_pages()} free pages of {PAGE_TOKENS} tokens); "
                "give more kv_memory_gb or shorten the prompt")
        return out

    def _decode_reserve(self) -> int:
        """Pages the running decode requests need for their next token."""
        return sum(1 for r in self.running if not r.in_prefill and r.pages_needed(r.num_computed + 1))

    def _schedule_prefill(self, out: SchedulerOutput) -> None:
        budget = self.max_num_batched_tokens
        free = self.cache.capacity_new_pages() - self._decode_reserve()
        candidates = [r for r in self.running if r.in_prefill] + list(self.waiting)
        for req in candidates:
            if budget <= 0:
                break
            admitted = req.status == Status.RUNNING
            if not admitted and len(self.running) >= self.max_num_seqs:
                break
            if not admitted and self.admission is not None and self.running and not self._can_admit(req):
                break
            todo = req.num_tokens - req.num_computed
            n = min(todo, budget)
            # fit the chunk into the pages we may still take
            room = (len(req.pages) + max(free, 0)) * PAGE_TOKENS - req.num_computed
            n = min(n, room)
            if n <= 0:
                break                                   # FIFO: later requests wait too
            new_pages = req.pages_needed(req.num_computed + n)
            if new_pages:
                req.pages += self.cache.alloc(new_pages)
                free -= new_pages
            if not admitted:
                self.waiting.popleft() if self.waiting and self.waiting[0] is req else self.waiting.remove(req)
                req.status = Status.RUNNING
                self.running.append(req)
            out.prefill.append(PrefillChunk(req, req.num_computed, n))
            budget -= n

    def _max_tokens(self, r: Request) -> int:
        """Tokens the request may reach: prompt + max_tokens, capped by max_model_len."""
        mt = r.params.max_tokens
        return min(self.max_model_len, r.num_tokens + (mt - len(r.output_ids) if mt else self.max_model_len))

    def _can_admit(self, req: Request) -> bool:
        from ..memory import RunningRequest
        running = [RunningRequest(len(r.pages), self._max_tokens(r)) for r in self.running]
        return self.admission.can_admit(req.num_tokens, self._max_tokens(req) - req.num_tokens, running)

    def _schedule_decode(self, out: SchedulerOutput) -> None:
        while True:
            batch = [r for r in self.running if not r.in_prefill]
            need = sum(1 for r in batch if r.pages_needed(r.num_computed + 1))
            if need <= self.cache.capacity_new_pages() or not batch:
                break
            if len(self.running) == 1:
                r = self.running[0]
                raise KVCacheTooSmall(
                    f"request {r.request_id} needs more than the whole KV memory ({r.num_tokens} tokens); "
                    "give more kv_memory_gb or lower max_tokens")
            out.preempted.append(self._preempt(self.running[-1]))
        for r in batch:
            if r.pages_needed(r.num_computed + 1):
                r.pages += self.cache.alloc(1)
        out.decode = batch

    def _preempt(self, req: Request) -> Request:
        """Free the request's pages; it restarts from scratch (recompute) when readmitted."""
        self.running.remove(req)
        self._free_pages(req)
        req.num_computed, req.num_sealed_pages = 0, 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        return req

    # -- after a step -----------------------------------------------------------------------
    def seal_full_pages(self, reqs) -> int:
        """Hand every page that just filled up to the cache for compression (one call);
        returns how many pages were handed over."""
        ids = [i for i in self._unsealed]
        for r in reqs:
            full = r.num_computed // PAGE_TOKENS
            if full > r.num_sealed_pages:
                ids += r.pages[r.num_sealed_pages:full]
                r.num_sealed_pages = full
        self._unsealed = set(self.cache.seal(ids))
        return len(ids)

    def finish(self, req: Request, reason: str) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        self._free_pages(req)

    def _free_pages(self, req: Request) -> None:
        self._unsealed.difference_update(req.pages)
        self.cache.free(req.pages)
        req.pages = []
