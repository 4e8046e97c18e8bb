"""PageStore: one owner for a page's life (allocation, prefix cache, seal, eviction, free) and the
only writer of a request's pages. The seal runs behind each step's forward: the analysis launched
one step is placed the next, so compression never makes decode wait for the device. The mechanics
are the memory manager's (``cache.manager``); the policy (when, which pages, in which order) is here.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..format.layout import PAGE_TOKENS
from .prefix_cache import ROOT, PrefixCache

UNOWNED = 1 << 62
# When a seal is due: one call's fixed cost (analysis, placement) should serve many pages, yet
# pages should not stay open while admission waits for room (docs/tuning.md, "Seal timing").
SEAL_MAX_WAIT = 8
SEAL_BUSY_ROWS = 16
SEAL_BUSY_WAIT = 16
SEAL_IDLE_WAIT = 64
SEAL_IDLE_BATCHES = 2
SEAL_FIRST_PAGES = 4
SEAL_BACKOFF = 4


def cacheable_pages(req) -> int:
    return (req.num_tokens - 1) // PAGE_TOKENS


class PageStore:
    def __init__(self, cache, *, prefix_caching: bool = True, host_tier=None, window: int | None = None):
        self.cache = cache
        self.kv_compression = bool(getattr(cache, "kv_compression", False))
        self._manager = cache.manager if self.kv_compression else None
        self.prefix = PrefixCache(cache, enabled=prefix_caching, host=host_tier)
        self.seal_min_pages = self._manager.slots_per_chunk if self.kv_compression else 1
        # full pages waiting for the seal -> (owner, page index): a request's pages packed together
        self._queue: dict[int, tuple[int, int]] = {}
        self._job = None                       # the analysis launched, placed at the next step
        self._job_ids: list[int] = []
        self._in_flight: set[int] = set()
        self._wait = 0
        self._rows = 0
        self._stuck = 0
        self._stuck_at = 0
        self._room_wanted = False
        self._first_waiting = False
        # sliding window on every layer: dropped pages' places hold the zeroed null page
        self.window = window
        self.null_page = self._zeroed(self.alloc(1)[0]) if window is not None else None
        self.pages_dropped = 0

    def capacity(self, keep_reserve: bool = True) -> int:
        """New pages that fit now (``keep_reserve=False``: the compression reserve counted too)."""
        return int(self.cache.capacity_new_pages(keep_reserve=keep_reserve))

    def make_room(self, n: int, keep_reserve: bool = True) -> int:
        """Evict cached pages nobody holds (LRU first) until ``n`` new pages fit; the capacity then."""
        cap, evicted = self.prefix.make_room(n, keep_reserve)
        self._unqueue(evicted)
        return cap

    def alloc(self, n: int, keep_reserve: bool = True) -> list[int]:
        return self.cache.alloc(n, keep_reserve=keep_reserve, reclaim=self._reclaim) if n > 0 else []

    def release(self, pages: Sequence[int]) -> None:
        self._unqueue(self.prefix.release(pages))

    def grow(self, req, upto_tokens: int, keep_reserve: bool = True) -> int:
        n = req.pages_needed(upto_tokens)
        req.pages += self.alloc(n, keep_reserve)
        return n

    def grow_each(self, reqs: Sequence, keep_reserve: bool = False) -> None:
        for r, page in zip(reqs, self.alloc(len(reqs), keep_reserve)):
            r.pages.append(page)

    def release_request(self, req) -> None:
        """A request lets go of every page it holds (finished, preempted or not admitted)."""
        self.release(req.pages[req.dropped_pages:])
        req.pages, req.dropped_pages, req.num_sealed_pages, req.prefix_node = [], 0, 0, ROOT

    def match(self, req) -> list:
        return self.prefix.match(req.tokens, cacheable_pages(req)) if not req.pages else []

    def hold(self, chain: list) -> int:
        """Hold the chain's pages on the device; how many count as the request's own (``own_pages``)."""
        resident = [n for n in chain if n.page is not None]
        self.prefix.acquire(resident)
        return len(resident) if self.window is None else sum(n.refs == 1 for n in resident)

    def own_pages(self, req) -> int:
        """Pages held; under a window only those nobody else holds (dropping a shared one frees nothing)."""
        live = req.pages[req.dropped_pages:]
        if self.window is None or not self.prefix.num_shared:
            return len(live)
        return sum(self.prefix.holders(p) <= 1 for p in live)

    def unhold(self, chain: list) -> None:
        """Let go of what :meth:`hold` held (a refused admission)."""
        self.release([n.page for n in chain if n.page is not None])

    def take_prefix(self, req, chain: list) -> None:
        if chain:
            req.pages = [n.page for n in chain]
            req.num_sealed_pages, req.prefix_node = len(chain), chain[-1].node_id

    def note_lookup(self, queried: int, hit: int) -> None:
        self.prefix.note_lookup(queried, hit)

    @property
    def num_evictable(self) -> int:
        return self.prefix.num_evictable_pages

    def bring_back(self, chain: list, wait: bool) -> tuple[list, list, list[int]] | None:
        """Room for the chain's host-tier pages: the chain (cut where room or the tier ends), its nodes
        still on the host and the new pages for them (``swap_in``); None: no room and ``wait``."""
        away = [n for n in chain if n.page is None]
        if not away:
            return chain, [], []
        could = self.capacity() + self.num_evictable >= len(away)
        room = self.make_room(len(away)) if could else 0
        keep = len(chain)
        if room < len(away):
            if wait:
                return None
            keep = chain.index(away[0])
        chain, away = self._cut_at_lost(chain, keep)
        if not away:
            return chain, [], []
        pages = self.alloc(len(away))
        chain, still = self._cut_at_lost(chain, len(chain))
        self.release(pages[len(still):])
        return chain, still, pages[:len(still)]

    def _cut_at_lost(self, chain: list, keep: int) -> tuple[list, list]:
        """The chain cut at ``keep`` and at its first page the tier dropped; its pages still on the host."""
        lost = [n for n in chain if n.page is None and n.host is None]
        if lost:
            keep = min(keep, chain.index(lost[0]))
        if keep < len(chain):
            self.release([n.page for n in chain[keep:] if n.page is not None])
            chain = chain[:keep]
        return chain, [n for n in chain if n.page is None]

    def drop_behind(self, reqs: Sequence) -> int:
        """Give back each request's pages wholly before the window of its next query token (cached: released)."""
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
        manager = getattr(self.cache, "manager", None)
        for layer in range(manager.num_layers if manager is not None else 0):
            manager.open_page(layer, page).zero_()
        return page

    def evict_all(self) -> int:
        gone = self.prefix.clear()
        self._unqueue(gone)
        return len(gone)

    def _unqueue(self, freed: list[int]) -> None:
        """Pages the prefix cache freed leave the seal."""
        for p in freed:
            self._queue.pop(p, None)
            self._in_flight.discard(p)

    def _reclaim(self, pages) -> None:
        """Compaction would move these pages: cached ones nobody holds are evicted instead."""
        self._unqueue(self.prefix.evict_pages(pages))

    def swap_in(self, nodes: list, pages: list[int], stream: int, promised: int) -> None:
        """Bring cached pages back from the host tier into the new pages ``pages``, leaving ``promised`` new pages."""
        left = self.prefix.swap_in(nodes, pages, stream, promised, self._reclaim)
        if self.kv_compression:
            self._queue.update((p, (UNOWNED, p)) for p in left)

    @property
    def placing(self) -> bool:
        """An analysis waits to be placed (``place``)."""
        return self._job is not None

    def after_forward(self, filled: Sequence = (), promised: int = 0) -> int:
        """Behind a step's forward: place the seal analysed last step, collect the pages ``filled``;
        returns the pages handed to placement. ``seal_due`` then says whether to ``start_seal``."""
        sealed = self.place(promised)
        self._rows = len(filled)
        self._collect(filled)
        return sealed

    def want_room(self) -> None:
        """Admission refused a request for want of room."""
        self._room_wanted = True

    def seal_due(self) -> bool:
        """Whether to launch a seal now (``start_seal``)."""
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

    def seal_owners(self) -> list[int]:
        """The request owning each page to seal, in ``to_seal`` order."""
        return [self._queue[p][0] for p in self.to_seal()]

    def start_seal(self, streams: Sequence[int] | None = None) -> None:
        """Launch the analysis of every page to seal (fill stream of each, in ``to_seal`` order)."""
        ids = self.to_seal()
        self._manager.set_streams(ids, list(streams) if streams is not None else [0] * len(ids))
        self._job, self._job_ids = self._manager.analyze_pages(ids), ids
        self._in_flight = set(ids)
        self._wait = 0
        self._room_wanted = self._first_waiting = False

    def place(self, promised: int = 0) -> int:
        """Place the analysis launched (leaving ``promised`` new pages); the pages handed to placement."""
        if self._job is None:
            return 0
        job, alive = self._job, [p for p in self._job_ids if p in self._in_flight]
        self._job, self._job_ids, self._in_flight = None, [], set()
        left = self._manager.place_pages(job, min_capacity=promised, reclaim=self._reclaim,
                                         keep=alive) if alive else []
        for p in set(alive).difference(left):
            self._queue.pop(p, None)
        self._stuck = self._stuck + 1 if left else 0
        self._stuck_at = self.cache.capacity_new_pages(keep_reserve=False) if left else 0
        return len(alive)

    def _collect(self, reqs: Sequence) -> None:
        for r in reqs:
            full = r.num_computed // PAGE_TOKENS
            if full <= r.num_sealed_pages:
                continue
            if r.num_sealed_pages < max(SEAL_FIRST_PAGES, len(r.prompt_ids) // PAGE_TOKENS):
                self._first_waiting = True
            for i in range(r.num_sealed_pages, full):
                r.prefix_node = self.prefix.insert(r.prefix_node, r.token_block(i), r.pages[i])
                if self.kv_compression:
                    self._queue[r.pages[i]] = (r.request_id, i)
            r.num_sealed_pages = full
        self._wait += 1

    def to_seal(self) -> list[int]:
        return sorted(self._queue, key=self._queue.__getitem__)
