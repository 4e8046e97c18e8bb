"""Prefix caching (memory/prefix_cache.py, the scheduler's use of it): the index and its reference
counts on their own, then through the engine on the demo model (CPU): a hit gives the tokens a
miss gives (deterministic mode: bit for bit, compressed and uncompressed), computes only what is
new, survives eviction, aborts and preemptions, and leaves no page behind."""

from __future__ import annotations

import hashlib

import pytest

from zipfusion import LLM, SamplingParams
from zipfusion.memory.prefix_cache import ROOT, PrefixCache


class FakeCache:
    """Counts pages: capacity = free pages."""

    def __init__(self, n: int):
        self.free_ids, self.freed = set(range(n)), []

    def alloc(self, k):
        return [self.free_ids.pop() for _ in range(k)]

    def free(self, ids):
        assert not set(ids) & self.free_ids, "double free"
        self.free_ids.update(ids)
        self.freed += list(ids)

    def capacity_new_pages(self, keep_reserve=True):
        return len(self.free_ids)


def blocks(*tags):
    """Token ids of pages: each tag one page of 16 equal tokens."""
    return [t for tag in tags for t in [tag] * 16]


def cache_of(n=64, enabled=True):
    fake = FakeCache(n)
    return fake, PrefixCache(fake, enabled=enabled)


def insert_all(pc, tokens, pages):
    node = ROOT
    for i, p in enumerate(pages):
        node = pc.insert(node, tokens[16 * i:16 * i + 16], p)
    return node


def test_match_follows_the_chain_and_stops_at_the_first_miss():
    fake, pc = cache_of()
    a = fake.alloc(3)
    insert_all(pc, blocks(1, 2, 3), a)
    assert [n.page for n in pc.match(blocks(1, 2, 3, 4), 10)] == a
    assert [n.page for n in pc.match(blocks(1, 2, 9), 10)] == a[:2]
    assert pc.match(blocks(2, 3), 10) == []                      # same page content, other position
    assert [n.page for n in pc.match(blocks(1, 2, 3), 2)] == a[:2]  # capped
    assert pc.match(blocks(1, 2, 3)[:-1], 10)[-1].page == a[1]   # a partial page never matches


def test_refcounts_lru_tail_first_and_hits_refresh():
    fake, pc = cache_of()
    a, b = fake.alloc(3), fake.alloc(2)
    insert_all(pc, blocks(1, 2, 3), a)
    insert_all(pc, blocks(7, 8), b)
    held = pc.acquire(pc.match(blocks(1, 2), 10))                 # a second holder of a[:2]
    assert pc.release(a) == [] and pc.num_evictable_pages == 1     # only a[2] is nobody's
    pc.release(b)                                                 # b's tail first, then b's head
    pc.release(held)
    assert list(pc._evictable) == [a[2], b[1], b[0], a[1], a[0]]
    pc.acquire(pc.match(blocks(7), 10))                           # a hit takes b[0] off the list
    assert pc.evict(2) == [a[2], b[1]] and sorted(fake.freed) == sorted([a[2], b[1]])
    assert pc.match(blocks(1, 2, 3), 10)[-1].page == a[1]          # evicted: the chain ends before it
    assert pc.stats.evicted_pages == 2 and pc.num_cached_pages == 3


def test_a_duplicate_page_stays_its_owners_and_chains_through_the_first():
    fake, pc = cache_of()
    a, b = fake.alloc(2), fake.alloc(2)
    insert_all(pc, blocks(1, 2), a)
    insert_all(pc, blocks(1, 2), b)                               # computed at the same time
    assert pc.release(b) == [b[1], b[0]] and pc.num_evictable_pages == 0    # not cached: freed at once
    assert [n.page for n in pc.match(blocks(1, 2), 10)] == a


def test_make_room_evicts_just_enough_and_disabled_caches_nothing():
    fake, pc = cache_of(8)
    a = fake.alloc(8)
    insert_all(pc, blocks(*range(8)), a)
    pc.release(a)
    cap, evicted = pc.make_room(3)
    assert cap == 3 and evicted == a[::-1][:3]
    assert pc.clear() == a[::-1][3:] and fake.capacity_new_pages() == 8
    fake, off = cache_of(8, enabled=False)
    ids = fake.alloc(2)
    assert off.insert(ROOT, blocks(1), ids[0]) == ROOT and off.match(blocks(1, 2), 5) == []
    assert off.release(ids) == ids[::-1] and fake.capacity_new_pages() == 8


def test_make_room_learns_how_much_room_an_evicted_page_frees():
    """Where an evicted page frees half a page of room (stored pages: compressed, counted in
    whole chunks), make_room first asks for what is missing and needs several rounds (each a
    copy to the host tier); having seen the rate, a later call asks for about what it needs
    at once (within a round or two)."""
    fake, pc = cache_of(256)
    pages = fake.alloc(256)
    insert_all(pc, blocks(*range(256)), pages)
    pc.release(pages)
    fake.free = lambda ids, free=fake.free: free(ids[::2])        # every other page frees its room
    pc._free = fake.free
    rounds, per_call = [], []
    evict = pc.evict
    pc.evict = lambda k, **kw: rounds.append(k) or evict(k, **kw)
    for want in (8, 16, 24, 32, 40, 48):
        rounds.clear()
        cap, _ = pc.make_room(want)
        assert cap >= want
        per_call.append(len(rounds))
    assert per_call[0] >= 2 and per_call[-1] == 1, per_call


# -- through the engine ---------------------------------------------------------------------------

SP = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SHARED = list(range(3, 203))                                     # 200 tokens: 12 full pages and a part


def prompts():
    """Requests sharing SHARED, with tails of several lengths (one ends on a page boundary)."""
    return [SHARED + [300 + i] * n for i, n in enumerate((1, 8, 24, 40, 0))] + [SHARED[:96]]


def run(llm, batches):
    outs = [o for ps in batches for o in llm.generate([{"prompt_token_ids": p} for p in ps], SP, use_tqdm=False)]
    return hashlib.sha256(repr([o.token_ids for o in outs]).encode()).hexdigest(), outs


@pytest.mark.parametrize("compress", [True, False])
def test_hits_give_a_miss_tokens_bit_for_bit_deterministic(compress):
    """Deterministic mode: the same tokens with the cache as without it, whether the shared
    prefix is found (second batch) or computed; small chunks, so hits continue mid-prompt."""
    kw = dict(deterministic=True, kv_compression=compress, max_num_batched_tokens=64, kv_memory_gb=0.02)
    batches = [prompts()[:1], prompts(), prompts()[::-1]]
    ref, _ = run(LLM("demo", enable_prefix_caching=False, **kw), batches)
    llm = LLM("demo", **kw)
    got, outs = run(llm, batches)
    assert got == ref
    assert [o.num_cached_tokens for o in outs[1:6]] == [192] * 5   # every full page of SHARED
    assert outs[0].num_cached_tokens == 0 and outs[6].num_cached_tokens == 80   # 96 tokens: 5 pages + last
    s = llm.kv_stats()
    assert s["prefix_cache_hit_tokens"] >= 11 * 192 and 0 < s["prefix_cache_hit_rate"] < 1


def test_a_hit_computes_only_the_new_tokens():
    llm = LLM("demo", max_num_batched_tokens=4096)
    eng = llm.engine
    llm.generate([{"prompt_token_ids": SHARED}], SP, use_tqdm=False)
    eng.add_request(SHARED + [7] * 20, SP)
    computed = 0
    while eng.has_work():
        computed += eng.step().prefill_tokens
    assert computed == 200 + 20 - 192              # the tail only


@pytest.mark.parametrize("compress,ahead", [(True, False), (False, False), (True, True)])
def test_requests_arriving_together_compute_a_shared_prefix_once(compress, ahead):
    """Requests sent at once behind one long prefix: the first computes it, the others wait a
    step (each asks for pages another request is computing) and find it cached; the tokens are
    those of a run without the cache. Without the wait each request admitted beside the first
    computed its own copy (here: all six, at 4,096 tokens a step). ``ahead``: with async
    scheduling (the GPU's default), whose schedule is made before the step's tokens are back."""
    kw = dict(deterministic=True, kv_compression=compress, max_num_batched_tokens=4096)
    ps = prompts()[:5] + [[900] * 40] + prompts()[5:]
    ref, _ = run(LLM("demo", enable_prefix_caching=False, **kw), [ps])
    llm = LLM("demo", **kw)
    eng = llm.engine
    eng.async_scheduling = ahead
    reqs = [eng.add_request(p, SP) for p in ps]
    computed, first = 0, eng.step()
    assert first.prefill_tokens == len(ps[0]) + 40       # the first of the group, and the stranger
    computed += first.prefill_tokens
    while eng.has_work():
        computed += eng.step().prefill_tokens
    assert computed == sum(map(len, ps)) - 4 * 192 - 80     # four hits on SHARED, one on its first 80
    assert [r.num_cached_tokens for r in reqs] == [0, 192, 192, 192, 192, 0, 80]
    got = hashlib.sha256(repr([r.output_ids for r in reqs]).encode()).hexdigest()
    assert got == ref


def test_eviction_under_pressure_keeps_outputs_and_frees_everything():
    """A KV memory too small to keep every prefix: pages are evicted least recently used first,
    the tokens stay those of a run without the cache, and no page is left behind."""
    kw = dict(kv_memory_gb=0.004, max_num_batched_tokens=128, deterministic=True)
    group = [[[500 + g] * 16 * 12 + [g, g + 1 + i, 7] for i in range(2)] for g in range(24)]
    a, b = sum(group[:12], []), sum(group[12:], [])     # 24 requests, 13 pages each, 14 a pair (shared)
    batches = [a, b, a[:8]]              # b evicts a's prefixes (152 pages hold 10 pairs), a[:8] again
    ref, _ = run(LLM("demo", enable_prefix_caching=False, **kw), batches)
    llm = LLM("demo", **kw)
    cap0 = llm.engine.cache.capacity_new_pages()
    got, outs = run(llm, batches)
    assert got == ref
    s = llm.kv_stats()
    assert s["prefix_cache_evicted_pages"] > 0 and sum(o.num_cached_tokens for o in outs) > 0
    assert llm.engine.cache.stats()["pages_reclaimed"] > 0      # compaction dropped cached pages
    assert s["prefix_cache_pages"] == s["prefix_cache_evictable_pages"]        # nobody holds a page
    llm.reset_prefix_cache()
    assert llm.engine.cache.stats()["pages_in_use"] == 0 and llm.engine.cache.capacity_new_pages() == cap0


def test_abort_and_preemption_of_holders_of_shared_pages():
    """Optimistic admission in a small memory preempts; an abort lets go of shared pages while
    others hold them. The survivors' tokens are those of a run without the cache."""
    kw = dict(kv_memory_gb=0.002, admission="optimistic", max_num_batched_tokens=64, deterministic=True,
              kv_compression=False)                               # 84 pages; 41 preemptions without the cache
    sp = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    ps = [SHARED[:120] + [9 + i] * (5 + 9 * i) for i in range(12)]

    def go(llm):
        eng = llm.engine
        reqs = [eng.add_request(p, sp) for p in ps]
        for _ in range(6):
            eng.step()
        eng.abort(reqs[1])
        while eng.has_work():
            eng.step()
        return [r.output_ids for r in reqs if r is not reqs[1]], eng, reqs
    ref, _, _ = go(LLM("demo", enable_prefix_caching=False, **kw))
    got, eng, reqs = go(LLM("demo", **kw))
    assert got == ref and eng.scheduler.num_preemptions > 0
    # a lookup counts when its request starts, not at each admission undone for want of pages
    # (that counted 24,222 tokens here: 4.7x every start's prompt)
    starts = sum((len(p) + sp.max_tokens) * (1 + r.num_preemptions) for p, r in zip(ps, reqs))
    stats = eng.scheduler.prefix.stats
    assert 0 < stats.hit_tokens <= stats.queried_tokens <= starts
    eng.scheduler.reset_prefix_cache()
    assert eng.cache.stats()["pages_in_use"] == 0
