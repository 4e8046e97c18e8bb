"""Continuous batching: waiting and running queues, mixed decode + chunked-prefill steps, admission
from the KV cache's capacity, preemption by recompute, and the requests' state after each step.

Each step decodes every running request whose prompt is done, then gives the rest of its token
budget to prefill chunks: running prompts first, then waiting requests in order, each admitted when
:class:`~zipfusion.memory.Admission` agrees. When decode needs more pages than fit, the newest
request is preempted and recomputed later. Pages are the page store's (memory/page_store.py): the
scheduler asks it to allocate, hold a cached prefix, and release.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from ..attention.backend import ChunkView
from ..config import Tuning
from ..memory import Admission, RunningBatch
from ..memory.kv_cache import KVCache
from ..memory.page_store import PageStore, cacheable_pages
from ..memory.prefix_cache import ROOT
from .request import PAGE_TOKENS, Request, Status


log = logging.getLogger("zipfusion")

SHARED_AHEAD_PAGES = 2  # a request whose next pages another is computing now waits a step for them


class KVCacheTooSmall(RuntimeError):
    """One request alone does not fit in the KV memory."""


@dataclass
class PrefillChunk:
    request: Request
    start: int
    length: int

    @property
    def completes(self) -> bool:
        """The chunk reaches the last token."""
        return self.start + self.length == self.request.num_tokens

    def view(self) -> ChunkView:
        return ChunkView(self.start, self.length, self.request.pages)


@dataclass
class SchedulerOutput:
    decode: list[Request] = field(default_factory=list)
    prefill: list[PrefillChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    ended: list[int] = field(default_factory=list)   # ids ended since the last forward: the runner drops their state

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(c.length for c in self.prefill)


class Scheduler:
    def __init__(self, cache: KVCache, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 max_model_len: int = 8192, admission: str = "estimate", prefix_caching: bool = True,
                 host_tier=None, tuning: Tuning = Tuning(), window: int | None = None,
                 eos_token_ids=(), tokenizer=None, grammars=None):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.tuning = tuning
        # the stop rule: end-of-sequence ids, the tokenizer (stop strings), the grammars (guided output)
        self.eos_token_ids, self.tokenizer, self.grammars = set(eos_token_ids), tokenizer, grammars
        self.admission = Admission(cache, admission, step_tokens=max_num_batched_tokens, window=window)
        self.pages = PageStore(cache, prefix_caching=prefix_caching, host_tier=host_tier, window=window)
        self.prefix = self.pages.prefix
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._steps = 0
        self._ended: list[int] = []

    def take_ended(self) -> list[int]:
        """Ids of the requests finished, aborted or preempted since the last call."""
        ended, self._ended = self._ended, []
        return ended

    def add(self, req: Request) -> None:
        """Queue a request (LLMEngine.add_request has checked it: a prompt of 1 .. max_model_len - 1 tokens)."""
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.pages.drop_behind(self.running)
        while True:
            self._schedule_decode(out)
            self._schedule_prefill(out, self.max_num_batched_tokens - len(out.decode))
            if not out.empty:
                break
            if self.seal_now():                           # pages waiting to be sealed may make room
                continue
            if len(self.running) < 2:
                break
            out.preempted.append(self._preempt(self.running[-1]))
        if out.empty and self.has_work():
            req = self.running[0] if self.running else self.waiting[0]
            raise KVCacheTooSmall(
                f"request {req.request_id} ({req.num_tokens} tokens) does not fit in the KV memory "
                f"({self.pages.capacity()} free pages of {PAGE_TOKENS} tokens); "
                "give more kv_memory_gb or shorten the prompt")
        self.admission.on_step()
        self._steps += 1
        return out

    def _schedule_decode(self, out: SchedulerOutput) -> None:
        """Every running request whose prompt is done decodes one token."""
        while True:
            batch = [r for r in self.running if not r.in_prefill]
            need = sum(1 for r in batch if r.pages_needed(r.num_computed + 1))
            if not batch or need <= self.pages.make_room(need):
                break
            if self.seal_now():
                continue
            if need <= self.pages.make_room(need, keep_reserve=False):
                break
            if len(self.running) == 1:
                r = self.running[0]
                raise KVCacheTooSmall(
                    f"request {r.request_id} needs more than the whole KV memory ({r.num_tokens} tokens); "
                    "give more kv_memory_gb or lower max_tokens")
            out.preempted.append(self._preempt(self.running[-1]))
        self.pages.grow_each([r for r in batch if r.pages_needed(r.num_computed + 1)])
        out.decode = batch

    def _schedule_prefill(self, out: SchedulerOutput, budget: int) -> None:
        """Prefill chunks for the rest of the budget."""
        free = self.pages.capacity()
        candidates = [r for r in self.running if r.in_prefill]
        computing = {self._pages_ahead(r, r.prefix_node, r.num_sealed_pages) for r in candidates}
        if not out.preempted:                     # as vLLM: no admission in a step that preempted
            candidates += self.waiting
        for req in candidates:
            if budget <= 0:
                break
            admitted = req.status == Status.RUNNING
            if not admitted:
                if len(self.running) >= self.max_num_seqs:
                    break
                chain = self.pages.match(req)
                ahead = self._pages_ahead(req, chain[-1].node_id if chain else ROOT, len(chain))
                if ahead is not None and ahead in computing:
                    continue                      # computed by another request now: cached next step
                if not self._admit(req, chain):
                    break
                free = self.pages.capacity()
                computing.add(self._pages_ahead(req, req.prefix_node, req.num_sealed_pages))
            want = min(req.num_tokens - req.num_computed, budget)
            if req.pages_needed(req.num_computed + want) > free:
                free = self.pages.make_room(req.pages_needed(req.num_computed + want))
            n = min(want, (len(req.pages) + free) * PAGE_TOKENS - req.num_computed)
            if n <= 0:
                if not admitted:
                    self._unadmit(req)
                self.pages.want_room()
                break
            free -= self.pages.grow(req, req.num_computed + n)
            if not admitted:                      # it starts: its lookup counts (not an admission undone)
                self.waiting.remove(req)
                req.status = Status.RUNNING
                self.running.append(req)
                self.pages.note_lookup(req.num_tokens, req.num_computed)
                if req.num_cached_tokens is None:
                    req.num_cached_tokens = req.num_computed
            out.prefill.append(PrefillChunk(req, req.num_computed, n))
            budget -= n

    def _pages_ahead(self, req: Request, parent: int, first: int) -> tuple | None:
        """The key of the SHARED_AHEAD_PAGES pages a request computes next, behind chain node ``parent``."""
        end = first + SHARED_AHEAD_PAGES
        if not self.prefix.enabled or end > cacheable_pages(req):
            return None
        return parent, tuple(t for i in range(first, end) for t in req.token_block(i))

    def _admit(self, req: Request, chain: list) -> bool:
        """Hold the request's cached prefix, then ask admission; on a refusal the prefix is let go."""
        held = self.pages.hold(chain)
        if self.running:
            args = (req.num_tokens, self._max_total_tokens(req) - req.num_tokens, self._running_needs(),
                    held, req.params.fixed_length)
            short = self.admission.shortfall(*args)
            if 0 < short <= self.pages.num_evictable:       # an evicted page gives at most one
                self.pages.make_room(self.pages.capacity() + short)
                short = self.admission.shortfall(*args)
            if short > 0:
                self.pages.unhold(chain)
                self.pages.want_room()
                return False
        got = self.pages.bring_back(chain, wait=bool(self.running))
        if got is None:                            # its pages on the host do not fit yet: wait
            self.pages.unhold(chain)
            self.pages.want_room()
            return False
        held, still, pages = got
        if still:
            self.pages.swap_in(still, pages, self._fill_stream_now(), self._promised())
        self.pages.take_prefix(req, held)
        req.num_computed = req.num_sealed_pages * PAGE_TOKENS
        self.pages.drop_behind([req])
        return True

    def _unadmit(self, req: Request) -> None:
        """Undo ``_admit`` (or a preempted run)."""
        self.pages.release_request(req)
        req.num_computed = 0

    def _max_total_tokens(self, r: Request) -> int:
        """Tokens the request may reach."""
        return min(self.max_model_len, r.max_total_tokens or self.max_model_len)

    def _running_needs(self) -> RunningBatch:
        return RunningBatch([(self.pages.own_pages(r), r.num_tokens, self._max_total_tokens(r),
                              r.params.fixed_length, len(r.prompt_ids)) for r in self.running])

    def _promised(self) -> int:
        """New pages a placement must leave free for the running requests."""
        return self.admission.promised_pages(self._running_needs())

    def after_forward(self, filled: list[Request]) -> int:
        """Behind the forward: the page store places last step's seal and collects the pages ``filled``,
        then launches the next seal when due; returns the pages handed to placement."""
        placed = self.pages.after_forward(filled, self._promised() if self.pages.placing else 0)
        if self.pages.seal_due():
            self.pages.start_seal(self._fill_streams(self.pages.seal_owners()))
        return placed

    def seal_now(self) -> bool:
        """Seal every waiting page now (the last resort before a preemption); whether capacity grew."""
        before = self.pages.capacity(keep_reserve=False)
        if self.pages.placing:
            self.pages.place(self._promised())
        if self.pages.to_seal():
            self.pages.start_seal(self._fill_streams(self.pages.seal_owners()))
            self.pages.place(self._promised())
        return self.pages.capacity(keep_reserve=False) > before

    def _preempt(self, req: Request) -> Request:
        """Free the request's pages; it restarts by recompute when readmitted."""
        self.running.remove(req)
        req.computed_before = max(req.computed_before, req.num_computed)
        self._unadmit(req)
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._ended.append(req.request_id)
        self.admission.on_preempt()
        self.waiting.appendleft(req)
        return req

    def _fill_streams(self, owners) -> list[int]:
        """Each owner's fill stream: the window of steps its request is expected to finish in."""
        t = self.tuning
        wanted = set(owners)
        finish = {r.request_id: (self._steps + self.admission.expected_tokens(
                      r.num_tokens, self._max_total_tokens(r), r.params.fixed_length) - r.num_tokens)
                  // t.fill_window % t.fill_streams if not r.num_cached_tokens else t.fill_streams
                  for r in self.running if r.request_id in wanted}
        return [finish.get(o, self._fill_stream_now()) for o in owners]

    def _fill_stream_now(self) -> int:
        return self._steps // self.tuning.fill_window % self.tuning.fill_streams

    def computed(self, out: SchedulerOutput) -> int:
        """The step's tokens are computed: counters move on; returns the tokens computed again."""
        recomputed = 0
        for ch in out.prefill:
            r = ch.request
            recomputed += max(0, min(r.num_computed + ch.length, r.computed_before) - r.num_computed)
            r.num_computed += ch.length
        for r in out.decode:
            r.num_computed += 1
        return recomputed

    def postprocess(self, reqs: list[Request], tokens: list[int], logprobs: dict) -> list[Request]:
        """Append each request's sampled token (and logprobs), finish those the stop rule ends; returns them."""
        now = time.perf_counter()
        for i, entry in logprobs.items():
            reqs[i].logprobs.append(entry)
        done = []
        for r, t in zip(reqs, tokens):
            r.output_ids.append(int(t))
            r.token_times.append(now)
            reason = self._stop_reason(r)
            if reason:
                done.append((r, reason))
        for r, reason in done:
            self.finish(r, reason)
        return [r for r, _ in done]

    def _stop_reason(self, r: Request) -> str | None:
        """Why the request ends with its newest token."""
        p, t, n = r.params, r.output_ids[-1], len(r.output_ids)
        if r.matcher is not None:
            if not self.grammars.accept(r.matcher, t):
                log.warning("request %d: the grammar refused token %d (%s); request stopped", r.request_id, t,
                            r.matcher.get_error())
                return "abort"
            if r.matcher.is_stopped():
                return "stop"
        if n >= p.min_tokens:
            if not p.ignore_eos and t in self.eos_token_ids:
                return "stop"
            if t in p.stop_token_ids:
                r.stop_reason = t
                return "stop"
            if p.stop and self.tokenizer is not None:
                text = self.tokenizer.decode(r.output_ids)
                hits = [(text.find(s), s) for s in p.stop if s in text]
                if hits:
                    cut, s = min(hits)
                    r.text, r.stop_reason = text[:cut], s
                    return "stop"
        return "length" if self.at_length_limit(r) else None

    def at_length_limit(self, r: Request, more: int = 0) -> bool:
        """Whether the request has reached max_tokens or max_model_len (``more`` tokens from now)."""
        mt = r.params.max_tokens
        return (mt is not None and len(r.output_ids) + more >= mt) or r.num_tokens + more >= self.max_model_len

    def schedule_ahead(self, sampled: list[Request]) -> SchedulerOutput | None:
        """The next step's schedule, made before the tokens of the step now on the device are in."""
        for r in sampled:
            if self.at_length_limit(r, more=1):
                self.retire(r)
        if not self.has_work():
            return None
        try:
            return self.schedule()
        except KVCacheTooSmall:
            return None

    def retire(self, req: Request) -> None:
        """The request finishes with the step on the device (async scheduling): its pages go now."""
        if req in self.running:
            self.running.remove(req)
            self.pages.release_request(req)

    def finish(self, req: Request, reason: str) -> None:
        """The request is done (or aborted)."""
        if req.status == Status.FINISHED:
            return
        if req.status == Status.RUNNING and reason != "abort" and not req.params.fixed_length:
            self.admission.on_finish(len(req.output_ids), self._max_total_tokens(req) - len(req.prompt_ids))
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        self._ended.append(req.request_id)
        self.pages.release_request(req)

    def reset_prefix_cache(self) -> int:
        return self.pages.evict_all()
