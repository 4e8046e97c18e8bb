"""Continuous batching: waiting and running queues, mixed decode + chunked-prefill steps,
admission from the KV cache's capacity, preemption by recompute.

Every step has a token budget (``max_num_batched_tokens``). Running requests whose prompt is
done go first, one decode token each; what is left of the budget goes to prefill chunks:
first to running requests whose prompt is not done yet, then to waiting requests in arrival
order, each admitted only when :class:`~zipfusion.memory.Admission` says its memory fits
beside what the running requests still need. So running requests keep decoding while a long
prompt is prefilled, a chunk at a time.

Pages are allocated here, before the step, so the runner only writes into them. When decode
needs more pages than fit, the newest running request is preempted: its pages are freed and it
goes back to the front of the waiting queue, to be prefilled again from its prompt and the
tokens it already generated (its sampler state is kept). With the default admission this is a
rare correction, and each one makes admission more careful for a while.

Pages are the page store's (memory/page_store.py: allocation, the seal, eviction, free); the
scheduler asks it for capacity, allocation and release, and gives it two policies: which fill
stream a request's pages join, and how many new pages admission promised to running requests.

Prefix caching (memory/prefix_cache.py): full pages are offered to the prefix cache as they
fill up; a request being admitted first takes the cached pages its tokens start with (it then
prefills from there, attending to them in place). Pages nobody holds stay cached until memory
is needed: capacity is asked of the cache after evicting what is evictable, least recently used
first, and only as much as the request at hand needs. A preempted request's full pages become
evictable too, so a resumed request usually finds them still there. A waiting request whose next
pages another request is computing right now waits a step for them (SHARED_AHEAD_PAGES), so a
group sent at once behind one system prompt computes it once.
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

SHARED_AHEAD_PAGES = 2  # a waiting request whose next uncached pages (this many) another request
                        # is computing now waits a step and finds them cached (SGLang's in-batch
                        # prefix check): a group arriving at once computes its shared prompt once


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

    def view(self) -> ChunkView:
        return ChunkView(self.start, self.length, self.request.pages)


@dataclass
class SchedulerOutput:
    decode: list[Request] = field(default_factory=list)
    prefill: list[PrefillChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

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
        # the options were checked once, by EngineConfig
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.tuning = tuning
        # the stop rule: end-of-sequence ids, the tokenizer (stop strings), the grammars (guided output)
        self.eos_token_ids, self.tokenizer, self.grammars = set(eos_token_ids), tokenizer, grammars
        self.admission = Admission(cache, admission, step_tokens=max_num_batched_tokens, window=window)
        self.pages = PageStore(cache, prefix_caching=prefix_caching, host_tier=host_tier,
                               fill_stream_of=self._fill_streams,
                               promised=lambda: self.admission.promised_pages(self._running_needs()),
                               window=window)
        self.prefix = self.pages.prefix          # matching and holding cached prefixes
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._steps = 0                        # steps scheduled: the clock of the fill streams

    def add(self, req: Request) -> None:
        """Queue a request (LLMEngine.add_request has checked it: a prompt of 1 .. max_model_len - 1
        tokens)."""
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.pages.drop_behind(self.running)
        while True:
            self._schedule_decode(out)
            self._schedule_prefill(out, self.max_num_batched_tokens - len(out.decode))
            if not out.empty:
                break
            if self.pages.seal_now():                     # pages waiting to be sealed may make room
                continue
            if len(self.running) < 2:
                break
            # only half-prefilled requests are running and none can grow: free the newest
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
        """Every running request whose prompt is done decodes one token. Their new pages take
        free room first; else the pages waiting for a seal are sealed (a compressed page frees a
        quarter of its open one, and sealing needs the reserve intact to place them); else the
        compression reserve; else the newest request is preempted."""
        while True:
            batch = [r for r in self.running if not r.in_prefill]
            need = sum(1 for r in batch if r.pages_needed(r.num_computed + 1))
            if not batch or need <= self.pages.make_room(need):
                break
            if self.pages.seal_now():
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
        """Prefill chunks for the rest of the budget: running requests mid-prompt, then waiting
        ones in order, each admitted only if admission agrees (FIFO: the first refusal stops;
        none in a step that had to preempt)."""
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
            # the chunk: what is left of the prompt, within the budget and the pages free now
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
        """What names the SHARED_AHEAD_PAGES pages a request computes next, from its page
        ``first`` on behind the cached chain node ``parent`` (None: fewer full pages are left,
        or no prefix cache): two requests with the same key would compute the same pages."""
        end = first + SHARED_AHEAD_PAGES
        if not self.prefix.enabled or end > cacheable_pages(req):
            return None
        return parent, tuple(t for i in range(first, end) for t in req.token_block(i))

    def _admit(self, req: Request, chain: list) -> bool:
        """Hold the request's cached prefix (``chain``, from ``PageStore.match``), then ask
        admission (evicting cached pages nobody holds when that is what is missing); on a refusal
        the prefix is let go again. Pages of the prefix on the host tier come back into new pages
        (or, with no room, are recomputed)."""
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
        held = self.pages.bring_back(chain, wait=bool(self.running), stream=self._fill_stream_now())
        if held is None:                           # its pages on the host do not fit yet: wait
            self.pages.unhold(chain)
            self.pages.want_room()
            return False
        self.pages.take_prefix(req, held)
        req.num_computed = req.num_sealed_pages * PAGE_TOKENS
        return True

    def _unadmit(self, req: Request) -> None:
        """Undo ``_admit`` (or a preempted run): the request waits holding nothing."""
        self.pages.release_request(req)
        req.num_computed = 0

    def _max_total_tokens(self, r: Request) -> int:
        """Tokens the request may reach: prompt + max_tokens, capped by max_model_len."""
        return min(self.max_model_len, r.max_total_tokens or self.max_model_len)

    def _running_needs(self) -> RunningBatch:
        return RunningBatch([(len(r.pages) - r.dropped_pages, len(r.prompt_ids) + len(r.output_ids), self._max_total_tokens(r),
                              r.params.fixed_length, len(r.prompt_ids)) for r in self.running])

    def _preempt(self, req: Request) -> Request:
        """Free the request's pages; it restarts from scratch (recompute) when readmitted."""
        self.running.remove(req)
        req.computed_before = max(req.computed_before, req.num_computed)
        self._unadmit(req)
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.admission.on_preempt()
        self.waiting.appendleft(req)
        return req

    # -- policies the page store asks for -------------------------------------------------------
    def _fill_streams(self, owners) -> list[int]:
        """Each owner's fill stream: the window of steps in which its request is expected to
        finish (admission's estimate of its output; exact for a fixed-length one). A request
        behind a cached prefix, whose pages are likely to outlive it (a conversation's next
        turn), takes stream ``fill_streams`` of its own; pages no running request holds (swapped
        back in, cached) the current window's (Tuning: fill_streams, fill_window)."""
        t = self.tuning
        wanted = set(owners)          # a seal's few owners, not every running request
        finish = {r.request_id: (self._steps + self.admission.expected_tokens(
                      r.num_tokens, self._max_total_tokens(r), r.params.fixed_length) - r.num_tokens)
                  // t.fill_window % t.fill_streams if not r.num_cached_tokens else t.fill_streams
                  for r in self.running if r.request_id in wanted}
        return [finish.get(o, self._fill_stream_now()) for o in owners]

    def _fill_stream_now(self) -> int:
        """The fill stream of the current window of steps."""
        return self._steps // self.tuning.fill_window % self.tuning.fill_streams

    # -- after the forward: the requests' state moves on ------------------------------------
    def computed(self, out: SchedulerOutput) -> int:
        """The step's tokens are computed: the requests' counters move on. Returns the prefill
        tokens computed again after a preemption."""
        recomputed = 0
        for ch in out.prefill:
            r = ch.request
            recomputed += max(0, min(r.num_computed + ch.length, r.computed_before) - r.num_computed)
            r.num_computed += ch.length
        for r in out.decode:
            r.num_computed += 1
        return recomputed

    def postprocess(self, reqs: list[Request], tokens: list[int], logprobs: dict) -> list[Request]:
        """Each request's sampled token (and ``logprobs[i]`` of row i, if asked) appended; those
        done (the stop rule) finished; returns them."""
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
        """Why the request ends with its newest token: "stop", "length", "abort" (a token its
        grammar refused), or None."""
        p, t, n = r.params, r.output_ids[-1], len(r.output_ids)
        if r.matcher is not None:
            if not self.grammars.accept(r.matcher, t):
                log.warning("request %d: the grammar refused token %d (%s); request stopped", r.request_id, t,
                            r.matcher.get_error())
                return "abort"
            if r.matcher.is_stopped():
                return "stop"              # the grammar is complete (its end-of-sequence token taken)
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
        """Whether the request has reached max_tokens or max_model_len (``more``: once it has
        that many more tokens)."""
        mt = r.params.max_tokens
        return (mt is not None and len(r.output_ids) + more >= mt) or r.num_tokens + more >= self.max_model_len

    def schedule_ahead(self, sampled: list[Request]) -> SchedulerOutput | None:
        """The next step's schedule, made before the tokens of the step now on the device are
        in: the requests sure to finish with them (max_tokens or max_model_len) let go of their
        pages first (:meth:`retire`); any other is taken to go on. None when nothing is left to
        schedule or the schedule must raise (the next step schedules again, once the tokens are in)."""
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
        """The request will finish with the step now on the GPU, whose token is not back yet (the
        engine's async scheduling): it leaves the running queue and lets go of its pages now, so
        that the next step may use them; :meth:`finish` gives its reason once the token is in."""
        if req in self.running:
            self.running.remove(req)
            self.pages.release_request(req)

    def finish(self, req: Request, reason: str) -> None:
        """The request is done (or aborted): out of the queues, pages freed."""
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
        self.pages.release_request(req)

    def reset_prefix_cache(self) -> int:
        """Evict every cached page nobody holds; how many were freed."""
        return self.pages.evict_all()
