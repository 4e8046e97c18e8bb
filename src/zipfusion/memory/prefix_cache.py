"""Prefix caching: full, sealed pages shared by every request that starts with the same tokens.

A page's K/V depends only on its 16 tokens and everything before them, so a page is named by
the chain of token blocks that leads to it (vLLM's chained block hash, here exact): the key of
page ``i`` of a sequence is ``(node id of page i - 1, its 16 token ids)``, the first page's
parent being the root (0). Node ids are never reused, so a key names one prefix for good; no
hash can collide because the dict compares the token tuples themselves.

The seed's rule: a page is shared only once it is full and handed to the seal (it never
changes again, whether the memory manager has compressed it yet or not); the open last page of
a request is never shared. Life of a cached page:

* **inserted** by the request that computed it (``insert``), which holds it (``refs`` = 1);
* **hit** by a later request whose tokens start with its chain (``match`` then ``acquire``):
  ``refs`` += 1, no copy, the hit's prefill attends to it in place;
* **released** when a holder finishes or is preempted: at ``refs`` 0 it stays cached but
  *evictable*, on an LRU list (a request's pages are released tail first, so a prefix outlives
  its continuations);
* **evicted** (its page freed) only when memory is needed: ``make_room`` frees evictable
  pages, least recently used first, until the cache can give what is asked; and compaction
  drops the evictable pages it would otherwise move (``evict_pages``). With a host tier
  (host_tier.py) an evicted page's bytes move to host memory first and its node stays
  matchable: a hit on it brings the page back (``swap_in``) instead of recomputing it; the
  tier drops its oldest pages when full (and tells the cache, which forgets them).

A page whose chain parent was evicted can no longer be matched (its key names a dead node) and
is evicted in its turn. Two requests that compute the same page at once each keep their own
copy; the second one chains its later pages through the first one's node. Everything here is
bookkeeping on page ids (no torch): the KV cache frees, counts and stores.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..format import PAGE_TOKENS

ROOT = 0


@dataclass
class Node:
    node_id: int
    page: int | None              # None: on the host tier (``host`` holds its bytes)
    key: tuple
    refs: int = 1
    host: object = None


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0     # prompt tokens looked up at admission
    hit_tokens: int = 0         # of them found cached (computed by nobody this time)
    evicted_pages: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class PrefixCache:
    """Page reference counts, the prefix index and the LRU list of evictable pages.

    ``free``: frees page ids in the KV cache; ``capacity``: the KV cache's new-page capacity
    (``capacity(keep_reserve)``). With ``enabled=False`` nothing is cached: ``release`` frees
    every page at once, so the scheduler has one path either way.
    """

    def __init__(self, free: Callable[[list[int]], None], capacity: Callable[[bool], int], enabled: bool = True,
                 host=None):
        self.enabled = enabled
        self._free, self._capacity = free, capacity
        self.host = host if enabled else None                      # a HostTier, or None
        self._on_host: dict[int, Node] = {}                         # node id -> node
        self._by_key: dict[tuple, Node] = {}
        self._by_page: dict[int, Node] = {}
        self._evictable: OrderedDict[int, Node] = OrderedDict()     # oldest first
        self._next_id = ROOT + 1
        self._room_per_page = 1.0        # new-page room an evicted page freed in the last make_room
        self.stats = PrefixCacheStats()

    # -- what is cached -----------------------------------------------------------------------
    @property
    def num_cached_pages(self) -> int:
        return len(self._by_page)

    @property
    def num_evictable_pages(self) -> int:
        return len(self._evictable)

    # -- hits ---------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], max_pages: int) -> list[Node]:
        """The cached chain of pages that ``tokens`` start with, at most ``max_pages`` long."""
        if not self.enabled:
            return []
        chain, parent = [], ROOT
        for i in range(max_pages):
            node = self._by_key.get((parent, tuple(tokens[i * PAGE_TOKENS:(i + 1) * PAGE_TOKENS])))
            if node is None:
                break
            chain.append(node)
            parent = node.node_id
        return chain

    def acquire(self, chain: list[Node]) -> list[int]:
        """Hold the pages of a matched chain (out of the LRU list; all on the device); their ids."""
        for node in chain:
            node.refs += 1
            self._evictable.pop(node.page, None)
        return [node.page for node in chain]

    def swap_in(self, nodes: list[Node], pages: list[int], stream: int = 0, min_capacity: int = 0,
                reclaim=None) -> list[int]:
        """Bring host-tier ``nodes`` back into the open ``pages`` (just allocated; the caller
        holds them); those that were compressed are placed compressed where there is room
        (``HostTier.take``; ``reclaim``: compaction's policy there). Returns the pages left open,
        for the caller to seal."""
        left = self.host.take([n.host for n in nodes], pages, stream, min_capacity, reclaim)
        for node, page in zip(nodes, pages):
            del self._on_host[node.node_id]
            node.page, node.host, node.refs = page, None, 1
            self._by_page[page] = node
        return left

    def note_lookup(self, queried: int, hit: int) -> None:
        self.stats.queried_tokens += queried
        self.stats.hit_tokens += hit

    # -- inserting ----------------------------------------------------------------------------
    def insert(self, parent: int, tokens: Sequence[int], page: int) -> int:
        """Offer ``page`` (full, sealed, held by the caller) holding ``tokens`` after the chain
        node ``parent``; returns the node id that names this prefix (the page's own new node,
        or the node of an identical page cached before: then ``page`` stays the caller's)."""
        if not self.enabled:
            return ROOT
        key = (parent, tuple(tokens))
        node = self._by_key.get(key)
        if node is None:
            node = Node(self._next_id, page, key)
            self._next_id += 1
            self._by_key[key] = node
            self._by_page[page] = node
        return node.node_id

    # -- releasing and evicting -------------------------------------------------------------------
    def release(self, pages: Sequence[int]) -> list[int]:
        """A holder lets go of ``pages`` (a request's, in order): cached pages it was the last
        to hold become evictable (tail first), the others are freed. Returns the freed ids."""
        freed = []
        for page in reversed(pages):
            node = self._by_page.get(page)
            if node is None:
                freed.append(page)
                continue
            node.refs -= 1
            if node.refs == 0:
                self._evictable[page] = node
        if freed:
            self._free(freed)
        return freed

    def evict(self, n: int, to_host: bool = True) -> list[int]:
        """Free the ``n`` least recently used evictable pages (their bytes to the host tier, if
        there is one with room); their ids."""
        nodes = []
        while self._evictable and len(nodes) < n:
            nodes.append(self._evictable.popitem(last=False)[1])
        return self._evict(nodes, to_host)

    def evict_pages(self, pages) -> list[int]:
        """Free those of ``pages`` that are cached and held by nobody (to the host tier, if any):
        the memory manager's compaction drops them rather than move them. Their ids."""
        nodes = [self._evictable.pop(int(p)) for p in pages if int(p) in self._evictable]
        return self._evict(nodes, True)

    def _evict(self, nodes: list[Node], to_host: bool) -> list[int]:
        if not nodes:
            return []
        kept = self._to_host(nodes) if to_host and self.host is not None else set()
        for node in nodes:
            del self._by_page[node.page]
            if node.node_id not in kept:
                del self._by_key[node.key]
        pages = [node.page for node in nodes]
        for node in nodes:
            node.page = None
        self._free(pages)
        self.stats.evicted_pages += len(pages)
        return pages

    def _to_host(self, nodes: list[Node]) -> set[int]:
        """Copy the nodes' pages to the host tier (it drops its oldest pages for room); the ids
        of the nodes now kept there."""
        kept = set()
        for node, rec in zip(nodes, self.host.put([node.page for node in nodes], nodes)):
            if rec is not None:
                node.host = rec
                self._on_host[node.node_id] = node
                kept.add(node.node_id)
        for node in self.host.take_dropped():           # older pages dropped for their room
            self._host_dropped(node)
        return kept

    def _host_dropped(self, node: Node) -> None:
        """The host tier dropped a node's page for room: forget the node."""
        if self._on_host.pop(node.node_id, None) is not None:
            node.host = None
            del self._by_key[node.key]

    def _drop_host(self) -> None:
        """Forget every page on the host tier."""
        for node in list(self._on_host.values()):
            self.host.drop([node.host])
            self._host_dropped(node)

    def make_room(self, n: int, keep_reserve: bool = True) -> tuple[int, list[int]]:
        """Evict until the cache has room for ``n`` new pages or nothing is evictable; returns
        (the capacity then, the evicted page ids). A stored page frees less than an open one,
        so each round evicts what is missing at the rate of room per page the last call saw,
        and asks again (asking only for what is missing, a compressed run took about three
        times the rounds of an uncompressed one, each a copy to the host tier)."""
        evicted = []
        cap = start = self._capacity(keep_reserve)
        ask = 0
        while cap < n and self._evictable:
            # what is missing at the room an evicted page has freed (a stored page frees less
            # than an open one, and freed bytes count in whole chunks), and at least as many as
            # the last round: each round costs a copy to the host tier
            ask = max(math.ceil((n - cap) / self._room_per_page), ask)
            evicted += self.evict(ask)
            cap = self._capacity(keep_reserve)
        if evicted and cap > start:     # the next call starts from this call's rate, asking at
            # most twice what is missing in its first round (a few pages that freed a whole chunk's
            # room, or many that freed little, say little about the next call)
            self._room_per_page = min(1.0, max(0.5, (cap - start) / len(evicted)))
        return cap, evicted

    def clear(self) -> list[int]:
        """Forget everything nobody holds, host tier included (``LLM.reset_prefix_cache``); the
        freed page ids."""
        if self.host is not None:
            self._drop_host()
        return self.evict(len(self._evictable), to_host=False)

    @property
    def num_host_pages(self) -> int:
        return len(self._on_host)
