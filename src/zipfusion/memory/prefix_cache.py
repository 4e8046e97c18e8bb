"""Prefix caching: full pages shared by every request that starts with the same tokens, keyed by
``(parent node id, the page's 16 token ids)`` (exact, no hash). A page nobody holds stays cached on
an LRU list and is evicted (to the host tier, where it stays matchable) only when memory is needed.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
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
    queried_tokens: int = 0
    hit_tokens: int = 0
    evicted_pages: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class PrefixCache:
    """Page reference counts, the prefix index and the LRU list of evictable pages."""

    def __init__(self, cache, enabled: bool = True, host=None):
        """``cache``: where pages are freed (``free``) and room is read (``capacity_new_pages``)."""
        self.enabled = enabled
        self.cache = cache
        self.host = host if enabled else None
        self._on_host: dict[int, Node] = {}
        self._by_key: dict[tuple, Node] = {}
        self._by_page: dict[int, Node] = {}
        self._evictable: OrderedDict[int, Node] = OrderedDict()     # oldest first
        self._next_id = ROOT + 1
        self.num_shared = 0                      # pages two or more requests hold
        self._room_per_page = 1.0
        self.stats = PrefixCacheStats()

    @property
    def num_cached_pages(self) -> int:
        return len(self._by_page)

    @property
    def num_evictable_pages(self) -> int:
        return len(self._evictable)

    def holders(self, page: int) -> int:
        node = self._by_page.get(page)
        return 1 if node is None else node.refs

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
        """Hold the pages of a matched chain (out of the LRU list; all on the device)."""
        for node in chain:
            node.refs += 1
            self.num_shared += node.refs == 2
            self._evictable.pop(node.page, None)
        return [node.page for node in chain]

    def swap_in(self, nodes: list[Node], pages: list[int], stream: int = 0, min_capacity: int = 0,
                reclaim=None) -> list[int]:
        """Bring host-tier ``nodes`` back into the open ``pages`` (just allocated; the caller holds them)."""
        left = self.host.take([n.host for n in nodes], pages, stream, min_capacity, reclaim)
        for node, page in zip(nodes, pages):
            del self._on_host[node.node_id]
            node.page, node.host, node.refs = page, None, 1
            self._by_page[page] = node
        return left

    def note_lookup(self, queried: int, hit: int) -> None:
        self.stats.queried_tokens += queried
        self.stats.hit_tokens += hit

    def insert(self, parent: int, tokens: Sequence[int], page: int) -> int:
        """Offer ``page`` (full, sealed, held by the caller) holding ``tokens`` after the chain node ``parent``."""
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

    def release(self, pages: Sequence[int]) -> list[int]:
        """A holder lets go of ``pages`` (a request's, in order)."""
        freed = []
        for page in reversed(pages):
            node = self._by_page.get(page)
            if node is None:
                freed.append(page)
                continue
            node.refs -= 1
            self.num_shared -= node.refs == 1
            if node.refs == 0:
                self._evictable[page] = node
        if freed:
            self.cache.free(freed)
        return freed

    def evict(self, n: int, to_host: bool = True) -> list[int]:
        """Free the ``n`` least recently used evictable pages (to the host tier, if any)."""
        nodes = []
        while self._evictable and len(nodes) < n:
            nodes.append(self._evictable.popitem(last=False)[1])
        return self._evict(nodes, to_host)

    def evict_pages(self, pages) -> list[int]:
        """Free those of ``pages`` that are cached and held by nobody (to the host tier, if any)."""
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
        self.cache.free(pages)
        self.stats.evicted_pages += len(pages)
        return pages

    def _to_host(self, nodes: list[Node]) -> set[int]:
        """Copy the nodes' pages to the host tier (it drops its oldest pages for room)."""
        kept = set()
        for node, rec in zip(nodes, self.host.put([node.page for node in nodes], nodes)):
            if rec is not None:
                node.host = rec
                self._on_host[node.node_id] = node
                kept.add(node.node_id)
        for node in self.host.take_dropped():
            self._host_dropped(node)
        return kept

    def _host_dropped(self, node: Node) -> None:
        if self._on_host.pop(node.node_id, None) is not None:
            node.host = None
            del self._by_key[node.key]

    def _drop_host(self) -> None:
        for node in list(self._on_host.values()):
            self.host.drop([node.host])
            self._host_dropped(node)

    def make_room(self, n: int, keep_reserve: bool = True) -> tuple[int, list[int]]:
        """Evict until the cache has room for ``n`` new pages or nothing is evictable."""
        evicted = []
        cap = start = self.cache.capacity_new_pages(keep_reserve=keep_reserve)
        ask = 0
        while cap < n and self._evictable:
            # what is missing at the room per evicted page seen last time (a stored page frees less)
            ask = max(math.ceil((n - cap) / self._room_per_page), ask)
            evicted += self.evict(ask)
            cap = self.cache.capacity_new_pages(keep_reserve=keep_reserve)
        if evicted and cap > start:
            self._room_per_page = min(1.0, max(0.5, (cap - start) / len(evicted)))
        return cap, evicted

    def clear(self) -> list[int]:
        """Forget everything nobody holds, host tier included (``LLM.reset_prefix_cache``)."""
        if self.host is not None:
            self._drop_host()
        return self.evict(len(self._evictable), to_host=False)

    @property
    def num_host_pages(self) -> int:
        return len(self._on_host)
