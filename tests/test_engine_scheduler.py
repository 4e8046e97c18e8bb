"""Scheduler on a fake page pool: chunked prefill budget, mixed decode + prefill steps,
admission by capacity (the default estimate and vLLM's optimistic), max_num_seqs, decode page
growth, preemption of the newest request, sealing of full pages."""

import pytest
from hypothesis import example, given, settings, strategies as st

from zipfusion.config import Tuning
from zipfusion.engine.request import Request, Status
from zipfusion.engine.sampling import SamplingParams
from zipfusion.engine.scheduler import KVCacheTooSmall, Scheduler
from zipfusion.format import PAGE_TOKENS
from zipfusion.memory.kv_cache import KVCache


class FakeCache(KVCache):
    """A page pool whose manager (the seal's mechanics, driven by the page store) is itself:
    pages are compressed (recorded) whole when placed; a compress batch is ``slots_per_chunk``."""
    kv_compression = True            # it seals (records) full pages, as a compressing cache does
    slots_per_chunk = 1

    def __init__(self, pages):
        self.free_ids = list(range(pages))
        self.sealed = []

    def alloc(self, n, keep_reserve=True, reclaim=None):
        assert n <= len(self.free_ids), "scheduler allocated beyond capacity"
        out, self.free_ids = self.free_ids[:n], self.free_ids[n:]
        return out

    def free(self, ids):
        self.free_ids += list(ids)

    @property
    def manager(self):
        return self

    def set_streams(self, ids, streams):
        pass

    def analyze_pages(self, ids):
        return list(ids)

    def place_pages(self, job, min_capacity=0, reclaim=None, keep=None):
        keep = set(job if keep is None else keep)
        ids = [p for p in job if p in keep]
        return self.compress(ids) if ids else []

    def compress(self, ids):
        """The pages left open."""
        self.sealed += list(ids)
        return []

    def capacity_new_pages(self, keep_reserve=True):
        return len(self.free_ids)

    def stored_ratio(self):
        return 1.0


def req(i, n, max_tokens=16):
    """Request ``i`` with ``n`` prompt tokens of its own (no prefix shared with another)."""
    return Request(i, list(range(1000 * i + 3, 1000 * i + 3 + n)), SamplingParams(temperature=0, max_tokens=max_tokens))


def advance(sched, out):
    """What the engine does with a schedule: computed tokens counted, a token appended when
    sampled, then the page store's seal behind the forward (the earlier analysis placed, the
    pages filled collected, an analysis launched when due)."""
    for ch in out.prefill:
        ch.request.num_computed += ch.length
        if ch.completes:
            ch.request.output_ids.append(7)
    for r in out.decode:
        r.num_computed += 1
        r.output_ids.append(7)
    sched.after_forward([c.request for c in out.prefill] + out.decode)


def test_chunked_prefill_respects_the_token_budget():
    cache = FakeCache(100)
    s = Scheduler(cache, max_num_batched_tokens=32)
    a, b = req(0, 50), req(1, 10)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [(c.request.request_id, c.start, c.length) for c in out.prefill] == [(0, 0, 32)]
    advance(s, out)
    out = s.schedule()
    assert [(c.request.request_id, c.start, c.length) for c in out.prefill] == [(0, 32, 18), (1, 0, 10)]
    assert out.prefill[0].completes and out.prefill[1].completes
    advance(s, out)
    out = s.schedule()
    assert out.decode == [a, b] and not out.prefill
    assert len(a.pages) == 4 and len(b.pages) == 1                 # 51 and 11 tokens
    for _ in range(3):                 # a seal's analysis before one forward, its placement after the next
        advance(s, out)
        out = s.schedule()
    assert cache.sealed == a.pages[:3]                             # 48 of a's tokens are in full pages


def test_admission_waits_for_capacity_and_max_num_seqs():
    cache = FakeCache(4)
    s = Scheduler(cache, max_num_seqs=2, max_num_batched_tokens=1000, admission="optimistic")
    for i in range(3):
        s.add(req(i, 20))                                          # 2 pages each
    out = s.schedule()
    assert [c.request.request_id for c in out.prefill] == [0, 1]   # max_num_seqs
    assert len(s.waiting) == 1 and cache.capacity_new_pages() == 0


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_decode_preempts_the_newest_and_recomputes(prefix_caching):
    """Without the prefix cache the preempted request recomputes everything; with it, its full
    page waits in the cache (evictable, not needed) and the resumed request starts after it."""
    cache = FakeCache(4)
    s = Scheduler(cache, max_num_batched_tokens=1000, admission="optimistic", prefix_caching=prefix_caching)
    a, b = req(0, 32), req(1, 31)                                   # 2 pages each, all memory
    s.add(a)
    s.add(b)
    advance(s, s.schedule())
    out = s.schedule()                                             # a needs a 3rd page for token 32
    assert out.preempted == [b] and out.decode == [a]
    assert b.status == Status.WAITING and b.pages == [] and b.num_computed == 0 and b.num_preemptions == 1
    assert list(s.waiting) == [b]
    advance(s, out)
    s.finish(a, "length")
    out = s.schedule()                                             # b comes back: prompt + its token
    start = 16 if prefix_caching else 0
    assert [(c.request.request_id, c.start, c.length) for c in out.prefill] == [(1, start, 32 - start)]


class SealingCache(FakeCache):
    """Sealing 2 pages frees the room of one (compression); pages wait for a batch of 8."""
    slots_per_chunk = 8

    def compress(self, ids):
        self.sealed += list(ids)
        self.free_ids += [10_000 + len(self.sealed) + i for i in range(len(ids) // 2)]
        return []


def test_pages_waiting_for_a_seal_are_sealed_before_anyone_is_preempted():
    """Full pages wait for a compress batch; when a running request needs a page that is not
    there, the scheduler seals them first, and preempts only if that made no room (the case of
    the test above)."""
    cache = SealingCache(4)
    s = Scheduler(cache, max_num_batched_tokens=1000, admission="optimistic", prefix_caching=False)
    a, b = req(0, 32), req(1, 31)                                   # 2 pages each, all memory
    s.add(a)
    s.add(b)
    advance(s, s.schedule())                                        # a's 2 full pages and b's first wait
    assert cache.sealed == [] and cache.capacity_new_pages() == 0
    out = s.schedule()                                             # a needs a 3rd page for token 32
    assert out.preempted == [] and out.decode == [a, b]
    assert sorted(cache.sealed) == sorted(a.pages[:2] + b.pages[:1])


def test_full_pages_are_sealed_sooner_while_admission_waits_for_room():
    """A request refused for want of room asks the page store for its seals at the short wait
    (SEAL_MAX_WAIT): the pages waiting, once sealed, make room. With nobody waiting, pages that
    decode steps filled (past a request's first SEAL_FIRST_PAGES) wait SEAL_IDLE_WAIT steps after
    the last seal (a tail's seals of a page or two cost a placement each)."""
    from zipfusion.memory.page_store import SEAL_IDLE_WAIT, SEAL_MAX_WAIT

    def seals(waiting: bool) -> list[int]:
        cache = SealingCache(40)
        s = Scheduler(cache, max_num_batched_tokens=1000, prefix_caching=False)
        s.add(req(0, 95, max_tokens=400))          # prompt pages 0-4; decode fills page 5 in step 1, 6 in 17
        advance(s, s.schedule())
        if waiting:
            s.add(req(1, 30 * PAGE_TOKENS, max_tokens=16))         # fits alone, not beside request 0
        steps = []
        for step in range(1, 2 * SEAL_IDLE_WAIT):
            out = s.schedule()
            assert [ch.request.request_id for ch in out.prefill] == []
            sealed = len(cache.sealed)
            advance(s, out)
            steps += [step] * (len(cache.sealed) > sealed)
        return steps

    # pages 0-5 (a prompt's pages waiting: the short wait either way), then page 6: once full
    # (step 17) it waits for the short wait or, with nobody waiting, SEAL_IDLE_WAIT steps after the
    # analysis of the first seal (a step before its placement)
    assert seals(waiting=True)[:2] == [SEAL_MAX_WAIT, 17 + 1]
    assert seals(waiting=False)[:2] == [SEAL_MAX_WAIT, SEAL_MAX_WAIT + SEAL_IDLE_WAIT]


class ReserveCache(SealingCache):
    """SealingCache with a compression reserve of ``reserve`` pages: room that only
    ``keep_reserve=False`` may take."""

    def __init__(self, pages, reserve):
        super().__init__(pages)
        self.reserve = reserve

    def capacity_new_pages(self, keep_reserve=True):
        return max(0, len(self.free_ids) - (self.reserve if keep_reserve else 0))


def test_decode_seals_waiting_pages_before_it_takes_the_compression_reserve():
    """A decode page that fits only in the reserve: the pages waiting for a seal are sealed
    first (that needs the reserve intact, and frees room), and the reserve is left alone."""
    cache = ReserveCache(5, reserve=1)
    s = Scheduler(cache, max_num_batched_tokens=1000, admission="optimistic", prefix_caching=False)
    a, b = req(0, 32), req(1, 31)                                   # 2 pages each; 1 page is the reserve
    s.add(a)
    s.add(b)
    advance(s, s.schedule())
    assert cache.sealed == [] and cache.capacity_new_pages() == 0 and cache.capacity_new_pages(False) == 1
    out = s.schedule()                                             # a needs a 3rd page for token 32
    assert out.preempted == [] and out.decode == [a, b]
    assert sorted(cache.sealed) == sorted(a.pages[:2] + b.pages[:1])
    assert cache.capacity_new_pages(False) >= 1                    # the reserve is still there


def test_one_request_larger_than_memory_is_an_error():
    s = Scheduler(FakeCache(2), max_num_batched_tokens=1000)
    s.add(req(0, 40))
    out = s.schedule()                                             # the first 32 tokens fit
    assert out.prefill[0].length == 32
    advance(s, out)
    with pytest.raises(KVCacheTooSmall, match="kv_memory_gb"):
        s.schedule()


def test_running_requests_decode_while_a_long_prompt_is_prefilled_in_chunks():
    cache = FakeCache(100)
    s = Scheduler(cache, max_num_batched_tokens=32)
    a = req(0, 20)
    s.add(a)
    advance(s, s.schedule())                                       # a's prompt in one chunk
    b = req(1, 80)
    s.add(b)
    for start in (0, 31, 62):                                      # 1 decode token + 31 of b's prompt
        out = s.schedule()
        assert out.decode == [a]
        assert [(c.request.request_id, c.start, c.length) for c in out.prefill] == [(1, start, min(31, 80 - start))]
        assert out.num_tokens <= 32
        advance(s, out)
    assert not b.in_prefill and len(a.output_ids) == 4
    out = s.schedule()
    assert out.decode == [a, b] and not out.prefill


def test_estimate_admission_keeps_room_for_running_requests_outputs():
    """Optimistic admission fills memory with prompts and must preempt when outputs grow; the
    default admits the second request only when both prompts and outputs fit."""
    for mode, preempts in (("optimistic", True), ("estimate", False), ("conservative", False)):
        cache = FakeCache(6)
        s = Scheduler(cache, max_num_batched_tokens=1000, admission=mode)
        a, b = req(0, 32, max_tokens=32), req(1, 16, max_tokens=32)      # 4 and 3 pages with outputs
        s.add(a)
        s.add(b)
        preempted = 0
        while s.has_work():
            out = s.schedule()
            preempted += len(out.preempted)
            advance(s, out)
            for r in list(s.running):
                if len(r.output_ids) >= r.params.max_tokens:
                    s.finish(r, "length")
        assert (preempted > 0) == preempts, mode
        assert len(a.output_ids) >= 32 and len(b.output_ids) >= 32


class NoRoomCache(FakeCache):
    """Every seal finds no room: all pages stay open."""
    slots_per_chunk = 2

    def compress(self, ids):
        self.calls.append(list(ids))
        return list(ids)


def test_pages_left_open_wait_before_the_next_seal_try():
    """A seal that left pages open is not retried at every step (each try costs an analysis and a
    placement of every waiting page): SEAL_MAX_WAIT steps later, then twice, four times ... as
    long (SEAL_BACKOFF), or at once when a page is freed."""
    from zipfusion.memory.page_store import SEAL_BACKOFF, SEAL_MAX_WAIT
    cache = NoRoomCache(1000)
    cache.calls = []
    s = Scheduler(cache, max_num_batched_tokens=1000, admission="optimistic", prefix_caching=False)
    a, b = req(0, 64, max_tokens=2000), req(1, 8, max_tokens=1000)
    s.add(a)
    s.add(b)
    steps = []
    for step in range(SEAL_MAX_WAIT * (2 ** (SEAL_BACKOFF + 1) + 2 ** SEAL_BACKOFF + 1)):
        tries = len(cache.calls)
        advance(s, s.schedule())                                    # each step ends with a seal call
        steps += [step] * (len(cache.calls) - tries)
    gaps = [y - x for x, y in zip(steps, steps[1:])]
    # the first pages fill in step 0, are analysed behind its forward and placed behind step 1's
    assert steps[0] == 1 and gaps == [SEAL_MAX_WAIT << min(i, SEAL_BACKOFF) for i in range(len(gaps))]
    assert gaps[-2:] == [SEAL_MAX_WAIT << SEAL_BACKOFF] * 2, steps  # (the longest wait, again)
    tries = len(cache.calls)
    s.finish(b, "stop")                                             # pages let go of: try now
    for _ in range(2):                                              # analysed, then placed
        s.after_forward([])
    assert len(cache.calls) == tries + 1


def test_seals_put_pages_into_the_stream_of_their_requests_expected_finish():
    """A page's fill stream is the window of steps in which its request should finish: requests
    of fixed length finishing 1,000 steps apart get different streams, two finishing together
    the same one; a request behind a cached prefix (its pages likely outlive it) the extra one."""
    tuning = Tuning(fill_window=64)
    streams = {}

    class StreamCache(FakeCache):
        kv_compression = True                   # streams are only given to a cache that compresses

        def set_streams(self, ids, ss):
            streams.update(zip(ids, ss))

    cache = StreamCache(400)
    s = Scheduler(cache, max_num_batched_tokens=512, tuning=tuning)
    fixed = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731
    a = Request(0, list(range(3, 35)), fixed(10))
    b = Request(1, list(range(1003, 1035)), fixed(1000))
    c = Request(2, list(range(2003, 2035)), fixed(12))
    for r in (a, b, c):
        s.add(r)
    out = s.schedule()
    advance(s, out)                                                     # the full pages analysed
    sa, sb, sc = ({streams[p] for p in r.pages[:2]} for r in (a, b, c))
    assert len(sa) == len(sb) == len(sc) == 1 and sa == sc != sb
    assert sa == {(1 + 10 - 1) // 64 % tuning.fill_streams}        # step 1, 9 tokens still to come
    c.num_cached_tokens = 16                                            # as if its prompt hit the cache
    assert s._fill_streams([c.request_id]) == [tuning.fill_streams]


class TightCache(FakeCache):
    """Sealing sometimes finds no room (every other call leaves every page open)."""
    slots_per_chunk = 4

    def compress(self, ids):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls % 2:
            return list(ids)
        self.sealed += list(ids)
        return []


@settings(max_examples=40, deadline=None)
@given(prefixes=st.lists(st.integers(0, 80), min_size=1, max_size=3),
       reqs=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 40), st.integers(1, 24)), min_size=1, max_size=10),
       budget=st.sampled_from([16, 48, 256]), admission=st.sampled_from(["estimate", "optimistic"]),
       spare=st.integers(0, 40), tight=st.booleans())
@example(prefixes=[64], reqs=[(0, 5, 3)] * 6, budget=256, admission="estimate", spare=0, tight=False)
def test_every_request_finishes_and_every_page_comes_back(prefixes, reqs, budget, admission, spare, tight):
    """Requests behind a few shared prefixes, all sent at once, on a pool just big enough for the
    largest (plus ``spare``): whatever the budget, admission and seal luck, each finishes with
    its tokens (requests waiting for pages another is computing are never starved), the pages
    it computes at most once each time it runs, and every page is back once the cache is reset."""
    heads = [list(range(1000 * k + 3, 1000 * k + 3 + n)) for k, n in enumerate(prefixes)]
    rs = [Request(i, heads[p % len(heads)] + [50_000 + 100 * i + t for t in range(tail)],
                  SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
          for i, (p, tail, m) in enumerate(reqs)]
    largest = max(-(-(r.num_tokens + r.params.max_tokens) // 16) for r in rs)
    pages = largest + 1 + spare
    cache = (TightCache if tight else FakeCache)(pages)
    s = Scheduler(cache, max_num_batched_tokens=budget, max_model_len=4096, admission=admission)
    for r in rs:
        s.add(r)
    computed = {r.request_id: 0 for r in rs}
    for _ in range(4000):
        if not s.has_work():
            break
        out = s.schedule()
        for ch in out.prefill:
            computed[ch.request.request_id] += ch.length
        advance(s, out)
        for r in list(s.running):
            if len(r.output_ids) >= r.params.max_tokens:
                s.finish(r, "length")
    assert not s.has_work(), "requests starved"
    for r in rs:
        assert r.status == Status.FINISHED and len(r.output_ids) == r.params.max_tokens
        # a request computes at most its own tokens each time it runs (hits compute less)
        assert computed[r.request_id] <= (1 + r.num_preemptions) * r.num_tokens
    s.reset_prefix_cache()
    assert sorted(cache.free_ids) == list(range(pages))
