"""PageStore (memory/page_store.py): a page's life from allocation to free, and the seal in two
halves a step apart -- analysed behind one forward, placed behind the next -- with pages freed (and
their ids taken again) in between (CPU, the real arena)."""

from __future__ import annotations

import torch

from zipfusion.memory.kv_cache import ArenaKVCache
from zipfusion.format import PAGE_TOKENS
from zipfusion.engine.scheduler import Scheduler
from helpers import SMALL_LAYOUT, assert_contents, fill

OPEN = SMALL_LAYOUT.open_page_bytes


class Req:
    """What the page store reads of a request: its pages and how many of its tokens are computed."""

    def __init__(self, rid: int, pages: list[int], tokens: int, prompt: int = 0):
        self.request_id, self.pages, self.num_computed = rid, pages, tokens
        self.num_sealed_pages, self.prefix_node = 0, 0
        self.prompt_ids = list(range(prompt))

    def token_block(self, i: int) -> tuple:
        return tuple(range(1000 * self.request_id + PAGE_TOKENS * i, 1000 * self.request_id + PAGE_TOKENS * (i + 1)))


def store(prefix_caching: bool = False):
    """The cache, its page store and the scheduler that drives the seal (nothing running: nothing promised)."""
    cache = ArenaKVCache(2, SMALL_LAYOUT.num_kv_heads, SMALL_LAYOUT.head_dim, 64 * OPEN, "cpu", chunk_bytes=4 * OPEN)
    sched = Scheduler(cache, prefix_caching=prefix_caching)
    return cache, sched.pages, sched


def test_a_seal_is_placed_a_step_after_its_analysis():
    """Pages filled in step 0 are analysed behind its forward and placed behind step 1's: until
    then they are open pages (the capacity lags, it never runs ahead), and they read the same bits."""
    cache, ps, sched = store()
    m = cache.manager
    a = Req(0, ps.alloc(4), 4 * PAGE_TOKENS)
    written = fill(m, a.pages, [1.0, 0.9], seed=1)
    before = ps.capacity()
    assert sched.after_forward([a]) == 0                       # step 0: filled, analysed (a compress batch waits)
    assert ps.to_seal() == a.pages and {m.page_state(p) for p in a.pages} == {"open"}
    assert ps.capacity() == before
    assert sched.after_forward([]) == 4                        # step 1: placed
    assert {m.page_state(p) for p in a.pages} == {"stored"} and not ps.to_seal()
    assert m.stored_ratio() < 0.8
    assert_contents(m, written)


def test_how_long_full_pages_wait_for_their_seal():
    """Fewer full pages than a compress batch wait SEAL_MAX_WAIT steps for their seal while
    admission waits for room (``want_room``), SEAL_BUSY_WAIT in steps of SEAL_BUSY_ROWS requests
    or more (each request still fills at most a page in between; the seal's fixed cost serves
    more pages); when nothing waits for room, SEAL_IDLE_WAIT steps, and twice as long as before
    in a busy step (SEAL_IDLE_BATCHES)."""
    from zipfusion.memory.page_store import (SEAL_BUSY_ROWS, SEAL_BUSY_WAIT, SEAL_FIRST_PAGES,
                                             SEAL_IDLE_BATCHES, SEAL_IDLE_WAIT, SEAL_MAX_WAIT)

    def steps_to_seal(rows: int, room_wanted: bool, prompt: int = 0, first: bool = False) -> int:
        cache, ps, sched = store()
        m = cache.manager
        k = SEAL_FIRST_PAGES                                         # one full page to seal: no compress batch,
        a = Req(0, ps.alloc(k + 1), (k + 1) * PAGE_TOKENS, prompt)   # page k (pages 0..k-1 handed to a seal
        a.num_sealed_pages = k - 1 if first else k                   # before; with ``first`` page k-1 too)
        fill(m, a.pages, [1.0, 0.9], seed=1)
        idle = [Req(i, [], 0) for i in range(1, rows)]              # rows that fill no page
        for step in range(2 * SEAL_IDLE_WAIT):
            if room_wanted:
                ps.want_room()                                       # the scheduler, before each forward
            sched.after_forward([a] + idle)
            if m.page_state(a.pages[-1]) == "stored":
                return step                                          # analysed a step before
        raise AssertionError("never sealed")

    assert SEAL_MAX_WAIT < SEAL_BUSY_WAIT < SEAL_IDLE_BATCHES * SEAL_BUSY_WAIT <= SEAL_IDLE_WAIT
    assert steps_to_seal(1, True) == steps_to_seal(SEAL_BUSY_ROWS - 1, True) == SEAL_MAX_WAIT
    assert steps_to_seal(1, False) == steps_to_seal(SEAL_BUSY_ROWS - 1, False) == SEAL_IDLE_WAIT
    assert steps_to_seal(1, False, prompt=(SEAL_FIRST_PAGES + 1) * PAGE_TOKENS) == SEAL_MAX_WAIT  # a prompt's
    assert steps_to_seal(1, False, first=True) == SEAL_MAX_WAIT                # a request's first
    assert steps_to_seal(SEAL_BUSY_ROWS, True) == SEAL_BUSY_WAIT
    assert steps_to_seal(SEAL_BUSY_ROWS, False) == SEAL_IDLE_BATCHES * SEAL_BUSY_WAIT


def test_a_busy_step_with_room_to_spare_seals_two_compress_batches_at_once():
    """A compress batch of full pages is sealed at once, except in a step of SEAL_BUSY_ROWS
    requests or more while nothing waits for room: then it waits for a second
    (SEAL_IDLE_BATCHES), one placement for both."""
    from zipfusion.memory.page_store import SEAL_BUSY_ROWS, SEAL_IDLE_BATCHES

    def sealed_after_one_step(rows: int, batches: int, room_wanted: bool = False) -> bool:
        cache, ps, sched = store()
        m = cache.manager
        n = batches * ps.seal_min_pages
        a = Req(0, ps.alloc(n), n * PAGE_TOKENS)
        fill(m, a.pages, [1.0, 0.9], seed=2)
        idle = [Req(i, [], 0) for i in range(1, rows)]
        if room_wanted:
            ps.want_room()
        sched.after_forward([a] + idle)                                 # analysed if due ...
        sched.after_forward([a] + idle)                                 # ... placed
        return {m.page_state(p) for p in a.pages} == {"stored"}

    assert SEAL_IDLE_BATCHES == 2
    assert sealed_after_one_step(1, 1)
    assert sealed_after_one_step(SEAL_BUSY_ROWS, 1, room_wanted=True)
    assert not sealed_after_one_step(SEAL_BUSY_ROWS, 1)
    assert sealed_after_one_step(SEAL_BUSY_ROWS, 2)


def test_pages_freed_between_analysis_and_placement_are_left_alone():
    """A request finishes after its pages' analysis: they are freed, and their ids may serve new
    open pages before the placement. The placement seals only the pages still alive; the new pages
    under the old ids stay open with their own bits."""
    cache, ps, sched = store()
    m = cache.manager
    a = Req(0, ps.alloc(4), 4 * PAGE_TOKENS)
    b = Req(1, ps.alloc(4), 4 * PAGE_TOKENS)
    written = fill(m, a.pages + b.pages, [1.0, 1.0], seed=2)
    assert sched.after_forward([a, b]) == 0                    # step 0: all eight analysed
    ps.release(a.pages)                                     # a finishes: its pages freed
    for layer in range(2):
        for p in a.pages:
            del written[layer, p]
    again = ps.alloc(4)                                     # last freed, first taken: a's ids again
    assert sorted(again) == sorted(a.pages)
    written.update(fill(m, again, [0.0, 0.0], seed=3))      # other bits (incompressible)
    assert sched.after_forward([]) == 4                        # step 1: only b's pages handed to the seal
    assert {m.page_state(p) for p in b.pages} == {"stored"}
    assert {m.page_state(p) for p in again} == {"open"}
    assert not ps.to_seal()
    assert_contents(m, written)


def test_seal_now_places_the_analysed_pages_and_the_rest():
    """The scheduler's last resort before a preemption: whatever waits is sealed at once, the
    seal in flight (analysed, not placed) and pages too few for a seal of their own alike; it
    says whether the capacity grew."""
    cache, ps, sched = store()
    m = cache.manager
    a = Req(0, ps.alloc(16), 16 * PAGE_TOKENS)
    written = fill(m, a.pages, [1.0, 1.0], seed=4)
    a.num_computed = 8 * PAGE_TOKENS
    sched.after_forward([a])                                   # the first eight analysed: in flight
    assert len(ps.to_seal()) == 8
    before = ps.capacity(keep_reserve=False)
    grew = sched.seal_now()
    assert grew == (ps.capacity(keep_reserve=False) > before) and not ps.to_seal()
    assert {m.page_state(p) for p in a.pages[:8]} == {"stored"}
    a.num_computed = 11 * PAGE_TOKENS
    assert sched.after_forward([a]) == 0                       # three more: too few to be due
    assert ps.to_seal() == a.pages[8:11]
    sched.seal_now()
    assert not ps.to_seal() and {m.page_state(p) for p in a.pages[:11]} == {"stored"}
    assert_contents(m, written)


def test_full_pages_join_the_prefix_cache_and_eviction_leaves_the_seal_queue():
    """With prefix caching, a full page is cached as it is collected; released by its request it
    stays (evictable); evicted for room it is freed, and leaves the seal queue with it."""
    cache, ps, sched = store(prefix_caching=True)
    a = Req(0, ps.alloc(2), 2 * PAGE_TOKENS)
    sched.after_forward([a])
    assert ps.prefix.num_cached_pages == 2 and len(ps.to_seal()) == 2
    ps.release(a.pages)
    assert ps.prefix.num_evictable_pages == 2 and len(ps.to_seal()) == 2     # cached, still to seal
    ps.make_room(ps.capacity() + 2)                         # more than is free: evicts both
    assert ps.prefix.num_cached_pages == 0 and not ps.to_seal()
    assert torch.all(cache.page_loc[:, a.pages] == -1)
