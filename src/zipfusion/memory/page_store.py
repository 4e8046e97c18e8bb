"""PageStore: one owner for a page's life, from allocation to free.

A page is allocated open (``alloc``), written by the forwards, becomes *full*, is offered to the
prefix cache and queued for the seal, is sealed (compressed and placed in its layer's packed
space), may be moved by compaction or evicted to the host tier, and is freed (``free``, or the
prefix cache letting go of it). Every one of those steps goes through this object, so the seal
queue always knows which pages still exist.

The engine calls it once a step, :meth:`after_forward`, once the step's forward and sampling
are launched: the analysis launched in the *previous* step is placed and encoded (queued on the
device right behind that step's sampling, it has run by now, so reading its sizes does not wait
for this step's forward), the pages the step filled are collected, and when a seal is due the
encoded sizes of the pages waiting are analysed on the device (launched behind this step's
sampling, not waited for).

So compression costs the decode path no device-to-host sync and no host time between two
forwards: all of it runs while the forward runs on the device, and capacity lags the seal by
one step (pages count as open until placed), never promising room that is not there.
:meth:`seal_now` is the scheduler's last resort before a preemption: everything waiting sealed at
once (this one may wait for the device).

The scheduler asks it for capacity (``capacity``, ``make_room``: evicting cached pages nobody
holds until n new pages fit), allocation and release. Policies from above are given at
construction: ``fill_stream_of`` (which fill stream each owner's pages join: memory/packed.py)
and ``promised`` (the new pages admission promised to running requests, which a seal must not
take). Compaction's moves are offered to the prefix cache first: cached pages nobody holds are
evicted (to the host tier, if any) rather than moved.

The seal's flow and policy are all here; the mechanics are the memory manager's (``cache.manager``,
memory/manager.py): ``set_streams``, ``analyze_pages`` (sizes launched) and ``place_pages``
(placed and encoded, for the pages still alive). Under tensor parallelism ``cache.manager`` is
rank 0's manager behind the log the workers replay (distributed/lockstep.py), the same seam.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..format.layout import PAGE_TOKENS
from .prefix_cache import ROOT, PrefixCache

UNOWNED = 1 << 62       # seal order of a page no request collected (swapped in): after the others
# When a seal is due: one call's fixed cost (analysis, placement) should serve many pages, yet
# pages should not stay open while admission waits for room (docs/tuning.md, "Seal timing").
SEAL_MAX_WAIT = 8       # steps after the last seal, while admission waits for room
SEAL_BUSY_ROWS = 16     # a step of at least this many requests waits SEAL_BUSY_WAIT steps instead
SEAL_BUSY_WAIT = 16     # (each request still fills at most one page in between)
SEAL_IDLE_WAIT = 64     # steps when nothing waits for room ...
SEAL_IDLE_BATCHES = 2   # ... or this many compress batches (busy steps: twice the batch and the wait)
SEAL_FIRST_PAGES = 4    # a request's prompt pages and its first this many keep the short wait
SEAL_BACKOFF = 4        # a seal that left pages open waits up to 2**SEAL_BACKOFF times longer


def cacheable_pages(req) -> int:
    """Full pages before the request's last token (which always gives logits): the most a
    prefix hit may cover."""
    return (req.num_tokens - 1) // PAGE_TOKENS


class PageStore:
    def __init__(self, cache, *, prefix_caching: bool = True, host_tier=None,
                 fill_stream_of: Callable[[list[int]], list[int]] | None = None,
                 promised: Callable[[], int] | None = None, window: int | None = None):
        """``cache``: the engine's KV cache (memory/kv_cache.py; under tensor parallelism rank 0's
        lock-step view). ``fill_stream_of(owners)``: each owner's fill stream (default 0);
        ``promised()``: new pages the seal must leave room for (default 0)."""
        self.cache = cache
        self.kv_compression = bool(getattr(cache, "kv_compression", False))
        self._manager = cache.manager if self.kv_compression else None    # the seal's mechanics
        self.prefix = PrefixCache(self._freed, lambda keep: cache.capacity_new_pages(keep_reserve=keep),
                                  enabled=prefix_caching, host=host_tier)
        self._fill_stream_of = fill_stream_of or (lambda owners: [0] * len(owners))
        self._promised = promised or (lambda: 0)
        # a compress batch: a group of open slots (the manager places a group's worth at a time)
        self.seal_min_pages = self._manager.slots_per_chunk if self.kv_compression else 1
        # full pages not sealed yet (or left open: no room), each with its place in the seal
        # order: (owner, page index), so that a request's pages are placed together, share
        # packed chunks and free them together
        self._queue: dict[int, tuple[int, int]] = {}
        self._job = None                       # the manager's analysis: launched, placed at the next step
        self._job_ids: list[int] = []          # its pages, in seal order
        self._in_flight: set[int] = set()      # its pages not freed since
        self._wait = 0                         # steps since the last seal's analysis
        self._rows = 0                         # requests in the last step
        self._stuck = 0                        # seals in a row that left pages open (no room)
        self._stuck_at = 0                     # the capacity after the last of them
        self._room_wanted = False              # admission refused a request for room since the last seal
        self._first_waiting = False            # a prompt's page or a request's first, since the last seal
        # every layer sees only its last ``window`` keys: pages wholly before are given back, and
        # the request's page list keeps its positions with the zeroed null page in their place
        self.window = window
        self.null_page = self._zeroed(self.alloc(1)[0]) if window is not None else None
        self.pages_dropped = 0

    # -- capacity, allocation, release: what the scheduler asks --------------------------------
    def capacity(self, keep_reserve: bool = True) -> int:
        """New pages that fit now (``keep_reserve=False``: the compression reserve counted too)."""
        return int(self.cache.capacity_new_pages(keep_reserve=keep_reserve))

    def make_room(self, n: int, keep_reserve: bool = True) -> int:
        """Evict cached pages nobody holds (least recently used first) until ``n`` new pages fit
        or none is left; the capacity then."""
        return self.prefix.make_room(n, keep_reserve)[0]

    def alloc(self, n: int, keep_reserve: bool = True) -> list[int]:
        return self.cache.alloc(n, keep_reserve=keep_reserve, reclaim=self._reclaim) if n > 0 else []

    def release(self, pages: Sequence[int]) -> None:
        """A request lets go of its pages: cached ones stay (evictable), the others are freed."""
        self.prefix.release(pages)

    # -- a request's pages: written here only ---------------------------------------------------
    def grow(self, req, upto_tokens: int, keep_reserve: bool = True) -> int:
        """New pages for the request's first ``upto_tokens`` tokens; how many."""
        n = req.pages_needed(upto_tokens)
        req.pages += self.alloc(n, keep_reserve)
        return n

    def grow_each(self, reqs: Sequence, keep_reserve: bool = False) -> None:
        """One new page for each request, in one allocation (a decode step's)."""
        for r, page in zip(reqs, self.alloc(len(reqs), keep_reserve)):
            r.pages.append(page)

    def release_request(self, req) -> None:
        """A request lets go of every page it holds (finished, preempted or not admitted):
        cached ones stay (evictable), the others are freed."""
        self.release(req.pages[req.dropped_pages:])
        req.pages, req.dropped_pages, req.num_sealed_pages, req.prefix_node = [], 0, 0, ROOT

    # -- prefix hits ----------------------------------------------------------------------------
    def match(self, req) -> list:
        """The cached chain of pages a waiting request's tokens start with."""
        return self.prefix.match(req.tokens, cacheable_pages(req)) if not req.pages else []

    def hold(self, chain: list) -> int:
        """Hold the chain's pages on the device; how many."""
        return len(self.prefix.acquire([n for n in chain if n.page is not None]))

    def unhold(self, chain: list) -> None:
        """Let go of what :meth:`hold` held (a refused admission)."""
        self.prefix.release([n.page for n in chain if n.page is not None])

    def take_prefix(self, req, chain: list) -> None:
        """The request starts with the held ``chain``'s pages."""
        if chain:
            req.pages = [n.page for n in chain]
            req.num_sealed_pages, req.prefix_node = len(chain), chain[-1].node_id

    def note_lookup(self, queried: int, hit: int) -> None:
        self.prefix.note_lookup(queried, hit)

    @property
    def num_evictable(self) -> int:
        return self.prefix.num_evictable_pages

    def bring_back(self, chain: list, wait: bool, stream: int) -> list | None:
        """Bring the chain's host-tier pages back into new pages (fill stream ``stream``). With no
        room for them: None when ``wait``, else the chain up to its first such page. Pages the
        tier dropped while room was made end the chain there too (the rest is recomputed)."""
        away = [n for n in chain if n.page is None]
        if not away:
            return chain
        could = self.capacity() + self.num_evictable >= len(away)
        room = self.make_room(len(away)) if could else 0     # no eviction that cannot help
        keep = len(chain)
        if room < len(away):
            if wait:
                return None
            keep = chain.index(away[0])
        chain, away = self._cut_at_lost(chain, keep)
        if away:
            pages = self.alloc(len(away))
            # the allocation's compaction may have evicted pages to the tier, which dropped older ones
            chain, still = self._cut_at_lost(chain, len(chain))
            self.release(pages[len(still):])
            if still:
                self.swap_in(still, pages[:len(still)], stream)
        return chain

    def _cut_at_lost(self, chain: list, keep: int) -> tuple[list, list]:
        """The chain up to ``keep`` and its first page the host tier dropped (the rest let go of),
        and its pages still on the host tier."""
        lost = [n for n in chain if n.page is None and n.host is None]
        if lost:
            keep = min(keep, chain.index(lost[0]))
        if keep < len(chain):
            self.release([n.page for n in chain[keep:] if n.page is not None])
            chain = chain[:keep]
        return chain, [n for n in chain if n.page is None]

    def drop_behind(self, reqs: Sequence) -> int:
        """Give back each request's pages wholly before the window of its next query token (no
        layer reads them again; a cached one is released, not freed); how many."""
        if self.window is None:
            return 0
        n = 0
        for r in reqs:
            dead = min((r.num_computed + 1 - self.window) // PAGE_TOKENS, r.num_sealed_pages)
            if dead > r.dropped_pages:
                gone = r.pages[r.dropped_pages:dead]
                r.pages[r.dropped_pages:dead] = [self.null_page] * len(gone)
                r.dropped_pages = dead
                self.release(gone)
                n += len(gone)
        self.pages_dropped += n
        return n

    def _zeroed(self, page: int) -> int:
        """The page with zeros in every layer: what attention reads, masked, in a dropped page's
        place (a dense cache starts zeroed)."""
        manager = getattr(self.cache, "manager", None)
        for layer in range(manager.num_layers if manager is not None else 0):
            manager.open_page(layer, page).zero_()
        return page

    def evict_all(self) -> int:
        """Evict every cached page nobody holds; how many were freed."""
        return len(self.prefix.clear())

    def _freed(self, ids: list[int]) -> None:
        """Free pages in the cache (the prefix cache's one way to free): they leave the seal queue."""
        self.cache.free(ids)
        for p in ids:
            self._queue.pop(p, None)
            self._in_flight.discard(p)

    def _reclaim(self, pages) -> None:
        """Compaction would move these pages: cached ones nobody holds are evicted instead."""
        self.prefix.evict_pages(pages)

    def swap_in(self, nodes: list, pages: list[int], stream: int) -> None:
        """Bring cached pages back from the host tier into the new pages ``pages``; compressed ones
        are placed compressed where there is room, the others wait open for the next seal."""
        left = self.prefix.swap_in(nodes, pages, stream, self._promised(), self._reclaim)
        if self.kv_compression:
            self._queue.update((p, (UNOWNED, p)) for p in left)

    # -- the seal: once a step, behind the forward ----------------------------------------------
    def after_forward(self, filled: Sequence = ()) -> int:
        """The step's forward and sampling are launched: place and encode the seal analysed in the
        previous step; collect the pages the requests ``filled`` have filled (offered to the prefix
        cache, queued for a seal); when a seal is due (while admission waits for room: a compress
        batch waiting, or SEAL_MAX_WAIT steps since the last, SEAL_BUSY_WAIT in a step of
        SEAL_BUSY_ROWS requests or more; when nothing waits for room and no prompt's page or
        request's first (SEAL_FIRST_PAGES) waits, SEAL_IDLE_WAIT steps, or in a busy step twice the batch and the
        wait; longer after seals that found no room), launch the size analysis of every page
        waiting. Returns how many pages were handed to the placement."""
        sealed = self._finish() if self._job is not None else 0
        self._rows = len(filled)
        self._collect(filled)
        if self._due():
            self._start()
        return sealed

    def want_room(self) -> None:
        """Admission refused a request for want of room: the pages waiting are sealed at the short
        waits (SEAL_MAX_WAIT, SEAL_BUSY_WAIT) instead of SEAL_IDLE_WAIT, so that they make room soon."""
        self._room_wanted = True

    def seal_now(self) -> bool:
        """Seal every waiting page now (the scheduler's last resort before preempting a running
        request: compressed pages make room); whether the capacity grew."""
        before = self.cache.capacity_new_pages(keep_reserve=False)
        if self._job is not None:
            self._finish()
        if self._queue:
            self._start()
            self._finish()
        return self.cache.capacity_new_pages(keep_reserve=False) > before

    def _due(self) -> bool:
        if not self._queue:
            return False
        stuck = self._stuck > 0 and self.cache.capacity_new_pages(keep_reserve=False) <= self._stuck_at
        busy = self._rows >= SEAL_BUSY_ROWS
        base = SEAL_BUSY_WAIT if busy else SEAL_MAX_WAIT
        if stuck:
            return self._wait >= base << min(self._stuck - 1, SEAL_BACKOFF)
        if self._room_wanted:
            return len(self._queue) >= self.seal_min_pages or self._wait >= base
        if busy:
            return (len(self._queue) >= SEAL_IDLE_BATCHES * self.seal_min_pages
                    or self._wait >= SEAL_IDLE_BATCHES * base)
        return (len(self._queue) >= self.seal_min_pages
                or self._wait >= (base if self._first_waiting else SEAL_IDLE_WAIT))

    def _start(self) -> None:
        ids = sorted(self._queue, key=self._queue.__getitem__)
        self._manager.set_streams(ids, self._fill_stream_of([self._queue[p][0] for p in ids]))
        self._job, self._job_ids = self._manager.analyze_pages(ids), ids
        self._in_flight = set(ids)
        self._wait = 0
        self._room_wanted = self._first_waiting = False

    def _finish(self) -> int:
        job, alive = self._job, [p for p in self._job_ids if p in self._in_flight]
        self._job, self._job_ids, self._in_flight = None, [], set()
        left = self._manager.place_pages(job, min_capacity=self._promised(), reclaim=self._reclaim,
                                         keep=alive) if alive else []
        for p in set(alive).difference(left):
            self._queue.pop(p, None)
        self._stuck = self._stuck + 1 if left else 0
        self._stuck_at = self.cache.capacity_new_pages(keep_reserve=False) if left else 0
        return len(alive)

    def _collect(self, reqs: Sequence) -> None:
        """The pages that filled up: offered to the prefix cache (such a page never changes
        again; the open last page is never shared) and queued for the seal (a cache that does
        not compress has nothing to seal)."""
        for r in reqs:
            full = r.num_computed // PAGE_TOKENS
            if full <= r.num_sealed_pages:           # most steps: no page filled (a page is 16 tokens)
                continue
            if r.num_sealed_pages < max(SEAL_FIRST_PAGES, len(r.prompt_ids) // PAGE_TOKENS):
                self._first_waiting = True      # a prompt's page, or one of a request's first
            for i in range(r.num_sealed_pages, full):
                r.prefix_node = self.prefix.insert(r.prefix_node, r.token_block(i), r.pages[i])
                if self.kv_compression:
                    self._queue[r.pages[i]] = (r.request_id, i)
            r.num_sealed_pages = full
        self._wait += 1

    def to_seal(self) -> list[int]:
        """The pages waiting for a seal (in flight included), in seal order."""
        return sorted(self._queue, key=self._queue.__getitem__)
