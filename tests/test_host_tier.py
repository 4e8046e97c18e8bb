"""The host tier (memory/host_tier.py) with the prefix cache: pages out to host memory as they are
stored and back bit for bit (compressed, stored in open form, still open; adversarial bits), then
a state machine over cache + host tier with a real arena (CPU): requests sharing prefixes come
and go, full pages are sealed, memory pressure evicts to the host and hits bring pages back;
after every step each held page reads back exactly the bytes its tokens were given, and at the
end all memory is free. Last, through the engine: the same tokens with the tier as without it."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import torch
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from helpers import assert_packed_books
from zipfusion import LLM, SamplingParams
from zipfusion.config import Tuning
from zipfusion.format import PageLayout
from zipfusion.format.layout import loc_is_open, loc_offset
from zipfusion.memory import KVCacheManager
from zipfusion.memory.host_tier import HostTier
from zipfusion.memory.prefix_cache import ROOT, PrefixCache

LAYOUT = PageLayout(1, 64)
OPEN = LAYOUT.open_page_bytes
L = 2


def page_data(key: int) -> torch.Tensor:
    """[L, 2, 16, 1, 64] bf16 for the page named ``key``: mostly compressible values, some keys
    all raw bits (NaN/Inf/subnormal patterns: stored in open form), some with one outlier."""
    g = torch.Generator().manual_seed(key)
    if key % 5 == 0:
        return torch.randint(-2**15, 2**15, (L, 2, 16, 1, 64), generator=g, dtype=torch.int16).view(torch.bfloat16)
    x = torch.randn(L, 2, 16, 1, 64, generator=g).clamp(-4, 4)
    if key % 5 == 1:
        x[0, 0, 3, 0, 7] = 2.0 ** 20
    return x.to(torch.bfloat16)


def manager(pages: int = 24, device: str = "cpu") -> KVCacheManager:
    chunk = 4 * OPEN
    return KVCacheManager(L, LAYOUT, budget_bytes=(pages // 4 + 2 * L) * chunk, chunk_bytes=chunk, device=device)


def write(m, page: int, data: torch.Tensor) -> None:
    for layer in range(L):
        m.open_page(layer, page).copy_(data[layer])


def read(m, page: int) -> torch.Tensor:
    return torch.stack([m.read_pages(layer, [page])[0] for layer in range(L)]).cpu()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


import pytest  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="pinned host transfers and the Triton codec need CUDA")])]


def stored_bytes(m, page: int) -> list[bytes]:
    """A stored page's bytes in every layer, as they lie in the arena."""
    t = m.table
    return [m.arena[loc_offset(int(t.loc[layer, page])):][:int(t.size[layer, page])].cpu().numpy().tobytes()
            for layer in range(L)]


@pytest.mark.parametrize("room", [True, False])
@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_is_bit_exact_in_every_form(device, room):
    """Pages out and back in every form: stored compressed pages return compressed, their very
    bytes placed again (no decode, nothing to seal: not among the ids left open); with no room
    for them (``room=False``: every placement refused) they are decoded into open pages instead;
    open pages come back open. Every page reads back bit for bit."""
    check_round_trip(device, room)


def check_round_trip(device, room, tuning=Tuning()):
    m = manager(device=device)
    ids = m.alloc_pages(10)
    for i, p in enumerate(ids):
        write(m, p, page_data(i))
    assert m.compress_pages(ids[:8]) == []                         # 8 stored (compressed or open form), 2 open
    compressed = [i for i, p in enumerate(ids[:8]) if not loc_is_open(m.table.loc[:, p]).all()]
    assert compressed, "page_data should give compressible pages"
    before = {i: stored_bytes(m, ids[i]) for i in compressed}
    host = HostTier(m, 1 << 20, tuning)
    host.start(wait=True)                        # CUDA: pinned by its thread
    recs = host.put(ids, ids)
    m.free_pages(ids)
    assert host.used == sum(r.size for r in recs) and host.used < 10 * L * OPEN     # compressed bytes travel
    back = m.alloc_pages(10)
    if not room:
        m._affordable = lambda *a: False                      # as when placing would cut into promised room
    left = host.take(recs, back)
    for i, p in enumerate(back):
        assert same_bits(read(m, p), page_data(i)), i
    came_back_stored = [i for i, p in enumerate(back) if m.page_state(p) == "stored"]
    assert came_back_stored == (compressed if room else [])
    assert sorted(left) == sorted(p for i, p in enumerate(back) if i not in came_back_stored)
    for i in came_back_stored:
        assert stored_bytes(m, back[i]) == before[i], i
    assert host.used == 0 and host.stats.pages_in == host.stats.pages_out == 10


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the tier's own CUDA stream needs CUDA")
def test_copies_out_run_on_their_stream_and_never_overwrite_a_swap_in():
    """Copies out run on the tier's stream: one that reuses the ring bytes of a swap-in still
    queued behind busy compute waits for it, and a swap-in waits for its pages' copy out."""
    m = manager(device="cuda")
    ids = m.alloc_pages(4)
    for i, p in enumerate(ids):
        write(m, p, page_data(i))
    m.compress_pages(ids)
    host = HostTier(m, 1 << 20)
    host.start(wait=True)
    torch.cuda._sleep(100_000_000)                      # the compute stream busy for a while
    recs = host.put(ids, ids)                           # its copy out waits for the gather behind it
    m.free_pages(ids)
    back = m.alloc_pages(4)
    host.take(recs, back)                               # waits for the copy out, then reads the ring
    torch.cuda._sleep(100_000_000)
    ids2 = m.alloc_pages(4)
    for i, p in enumerate(ids2):
        write(m, p, page_data(100 + i))
    m.compress_pages(ids2)
    recs2 = host.put(ids2, ids2)                        # the same ring bytes, after the swap-in read them
    assert recs2[0].start == recs[0].start and recs[0].copied is not None
    torch.cuda.synchronize()
    for i, p in enumerate(back):
        assert same_bits(read(m, p), page_data(i)), i
    m.free_pages(ids2)
    back2 = m.alloc_pages(4)
    host.take(recs2, back2)
    for i, p in enumerate(back2):
        assert same_bits(read(m, p), page_data(100 + i)), i


@pytest.mark.parametrize("device", DEVICES)
def test_copies_go_through_bounded_staging_buffers(device):
    """A copy out of many pages (an eviction burst) crosses through staging buffers of at most
    ``stage_out_bytes``, two taking turns (on CUDA each waits for its last copy to the ring, behind
    a busy compute stream here); a swap-in is staged and placed a page at a time
    (``stage_in_bytes``): every page still comes back bit for bit."""
    tuning = Tuning(stage_out_bytes=OPEN + 16, stage_in_bytes=1)   # about a layer of a page, a page a batch
    m = manager(device=device)
    ids = m.alloc_pages(10)
    for i, p in enumerate(ids):
        write(m, p, page_data(200 + i))
    m.compress_pages(ids[:6])
    host = HostTier(m, 1 << 20, tuning)
    host.start(wait=True)
    if device == "cuda":
        torch.cuda._sleep(50_000_000)
    recs = host.put(ids, ids)
    m.free_pages(ids)
    assert all(b is not None and b.numel() <= OPEN + 16 for b in host._stage)
    back = m.alloc_pages(10)
    host.take(recs, back)
    for i, p in enumerate(back):
        assert same_bits(read(m, p), page_data(200 + i)), i


def test_round_trip_in_one_page_decode_batches():
    """A swap-in decodes its compressed bytes in bounded batches: one page at a time, too."""
    check_round_trip("cpu", room=False, tuning=Tuning(decode_batch_bytes=1))


def test_ring_drops_the_oldest_reuses_holes_and_wraps():
    """The tier's one pinned buffer as a ring: full, it drops its oldest pages (telling their
    owner); a page taken back leaves a hole reused once the tail passes it; bytes survive a wrap."""
    def data(i):              # values in [1, 2): every block compressed, no escapes: one size
        return (1 + torch.rand(L, 2, 16, 1, 64, generator=torch.Generator().manual_seed(i))).to(torch.bfloat16)
    m = manager()
    ids = m.alloc_pages(8)
    for i, p in enumerate(ids):
        write(m, p, data(i))
    assert m.compress_pages(ids) == []
    sizes = m.page_bytes(ids)[1].sum(0)
    size = int(sizes[0])
    assert (sizes == size).all() and size < L * OPEN
    host = HostTier(m, 3 * size + size // 2)
    a = host.put(ids[:3], ["a0", "a1", "a2"])
    assert host.take_dropped() == [] and host.used == 3 * size
    b = host.put(ids[3:4], ["b0"])                                  # no room at the head: a0 goes
    assert host.take_dropped() == ["a0"] and not a[0].live and b[0].start == 0   # wrapped to the front
    back = m.alloc_pages(1)
    host.take([a[2]], back)                                         # a hole at the head's end
    assert same_bits(read(m, back[0]), data(2))
    c = host.put(ids[4:6], ["c0", "c1"])                            # a1 goes; the hole is passed
    assert host.take_dropped() == ["a1"] and all(r.live for r in b + c)
    again = m.alloc_pages(3)
    host.take(b + c, again)
    for p, k in zip(again, (3, 4, 5)):
        assert same_bits(read(m, p), data(k))
    assert host.used == 0 and not host.ring


def test_a_tier_still_being_pinned_keeps_nothing_then_works():
    """On CUDA the buffer is pinned by a background thread: until it exists ``put`` keeps no page
    (as without a tier: they are recomputed) and the step goes on; then pages round-trip."""
    m = manager()
    ids = m.alloc_pages(2)
    for i, p in enumerate(ids):
        write(m, p, page_data(10 + i))
    host = HostTier(m, 1 << 20)
    host.pin = True                              # as on CUDA before the thread has finished
    assert not host.ready and host.put(ids, ["x", "y"]) == [None, None] and host.stats.pages_out == 0
    host.pin = False
    host._allocate()
    assert host.ready
    recs = host.put(ids, ["x", "y"])
    back = m.alloc_pages(2)
    host.take(recs, back)
    assert all(same_bits(read(m, b), page_data(10 + i)) for i, b in enumerate(back))


def test_host_tier_default_is_on_for_gpus_only():
    """kv_host_memory_gb=None: on the CPU no tier (host memory is the device's); 0 turns it off."""
    assert LLM("demo", device="cpu").engine.host_tier is None
    with pytest.raises(ValueError, match="kv_host_memory_gb must be a number >= 0"):
        LLM("demo", device="cpu", kv_host_memory_gb="lots")


class CacheMachine(RuleBasedStateMachine):
    """Requests are chains of page keys drawn from a few shared prefixes; a page's bytes are
    ``page_data`` of its chain, so a wrong hit or a corrupted transfer shows."""

    def __init__(self):
        super().__init__()
        self.m = manager(16)
        self.cap0 = self.m.capacity_new_pages()
        self.host = HostTier(self.m, 6 * L * OPEN)
        self.pc = PrefixCache(SimpleNamespace(free=self.m.free_pages, capacity_new_pages=self.m.capacity_new_pages),
                              host=self.host)
        self.reqs: list[tuple[list[int], list[int]]] = []          # (token blocks, pages)
        self.to_seal: set[int] = set()

    def _room(self, n: int) -> bool:
        cap, evicted = self.pc.make_room(n)
        self.to_seal.difference_update(evicted)
        return cap >= n

    @rule(prefix=st.integers(0, 2), shared=st.integers(0, 4), own=st.integers(0, 3), tag=st.integers(0, 9),
          promised=st.sampled_from([0, 4, 10**6]))
    def admit(self, prefix, shared, own, tag, promised):
        blocks = [100 * prefix + i for i in range(shared)] + [1000 + 10 * tag + i for i in range(own)]
        if not blocks:
            return
        tokens = [b for b in blocks for _ in range(16)]
        chain = self.pc.match(tokens, len(blocks))
        resident = [n for n in chain if n.page is not None]
        self.pc.acquire(resident)
        away = [n for n in chain if n.page is None]
        if not self._room(len(blocks) - len(resident)) or any(n.host is None for n in away):
            self.pc.release([n.page for n in resident])
            return
        if away:
            pages = self.m.alloc_pages(len(away))
            need = len(blocks) - len(chain)                                # this request's new pages
            # the room promised to others, and to this request's new pages, is kept
            left = self.pc.swap_in(away, pages, min_capacity=promised + need)
            assert self.m.capacity_new_pages() >= need
            assert set(left) <= set(pages)
            assert all(self.m.page_state(p) == "stored" for p in set(pages) - set(left))
            self.to_seal.update(left)
        new = self.m.alloc_pages(len(blocks) - len(chain))
        pages = [n.page for n in chain] + new
        node = chain[-1].node_id if chain else ROOT
        for i in range(len(chain), len(blocks)):
            write(self.m, pages[i], page_data(hash(tuple(blocks[:i + 1])) & 0xFFFFFF))
            node = self.pc.insert(node, tokens[16 * i:16 * i + 16], pages[i])
        self.to_seal.update(new)
        self.reqs.append((blocks, pages))

    @rule()
    def seal(self):
        ids = sorted(p for p in self.to_seal if self.m.page_state(p) == "open")
        self.to_seal = set(self.m.compress_pages(ids)) if ids else set()

    @rule(which=st.integers(0, 10))
    def finish(self, which):
        if self.reqs:
            _, pages = self.reqs.pop(which % len(self.reqs))
            self.to_seal.difference_update(self.pc.release(pages))

    @invariant()
    def packed_books_match_the_page_table(self):
        assert_packed_books(self.m)

    @rule(n=st.integers(1, 6))
    def evict(self, n):
        self.to_seal.difference_update(self.pc.evict(n))

    @invariant()
    def pages_hold_their_bytes(self):
        for blocks, pages in self.reqs:
            for i, p in enumerate(pages):
                assert same_bits(read(self.m, p), page_data(hash(tuple(blocks[:i + 1])) & 0xFFFFFF))
        assert 0 <= self.host.used <= self.host.budget

    def teardown(self):
        for _, pages in self.reqs:
            self.pc.release(pages)
        self.pc.clear()
        assert self.m.capacity_new_pages() == self.cap0 and self.host.used == 0


TestCacheAndHostTier = CacheMachine.TestCase
TestCacheAndHostTier.settings = settings(max_examples=25, stateful_step_count=30, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])


def test_cache_machine_swap_in_keeps_room_for_the_requests_new_pages():
    """A fresh draw of the machine above (pinned): two pages evicted to the host come back, one
    of them stored into a fresh packed chunk a layer, which took more room than its bytes; the
    request's four new pages must still fit (the swap-in keeps room for them)."""
    state = CacheMachine()
    state.admit(own=0, prefix=2, promised=0, shared=2, tag=0)
    state.seal()
    state.finish(which=0)
    state.evict(n=1)
    state.evict(n=1)
    state.admit(own=2, prefix=2, promised=0, shared=4, tag=0)
    state.packed_books_match_the_page_table()
    state.pages_hold_their_bytes()
    assert len(state.reqs) == 1 and len(state.reqs[0][1]) == 6
    state.teardown()


def test_engine_with_a_host_tier_gives_the_same_tokens_and_swaps():
    """A KV memory that preempts and evicts: with a host tier the evicted pages come back instead
    of being recomputed, and every token is the one a run without the tier gives."""
    shared = list(range(3, 203))
    ps = [shared[:120] + [9 + i] * (5 + 9 * i) for i in range(12)]
    sp = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    runs = {}
    for gb in (0, 0.05, 0.0005):                                   # none, room, too little room: drops
        eng = LLM("demo", kv_memory_gb=0.002, admission="optimistic", max_num_batched_tokens=64,
                  deterministic=True, kv_host_memory_gb=gb).engine
        if eng.host_tier is not None:
            eng.host_tier.start(wait=True)                         # CUDA: pinned before the run
        idle = eng.cache.stats()["pages_in_use"]                   # CUDA graphs hold a scratch page
        reqs = [eng.add_request(p, sp) for p in ps]
        computed, per_step = 0, []
        eng.add_observer(lambda res, st: per_step.append(st.recomputed_tokens))   # the step's numbers
        while eng.has_work():
            computed += eng.step().prefill_tokens
        recomputed = sum(per_step)
        stats = eng.reuse_stats()
        runs[gb] = (hashlib.sha256(repr([r.output_ids for r in reqs]).encode()).hexdigest(), computed, stats)
        assert stats["recomputed_tokens"] == recomputed <= computed
        eng.scheduler.reset_prefix_cache()
        assert eng.cache.stats()["pages_in_use"] == idle
    assert runs[0][0] == runs[0.05][0] == runs[0.0005][0]
    assert runs[0.05][2]["swapped_in_pages"] > 0 and runs[0.05][1] < runs[0][1]
    assert runs[0.05][2]["recomputed_tokens"] < runs[0][2]["recomputed_tokens"]
    assert runs[0][2]["preemptions"] > 0 and runs[0][2]["recomputed_tokens"] > 0
    for direction in ("out", "in"):                          # what the transfers cost is counted
        assert runs[0.05][2][f"swap_{direction}_host_s"] > 0 and runs[0.05][2][f"swap_{direction}_device_s"] > 0
    assert runs[0.0005][2]["host_tier_dropped_pages"] > 0
    assert "swapped_in_pages" not in runs[0][2]


def test_recomputed_tokens_are_those_computed_before_a_preemption():
    """Without a prefix cache every token a preempted request had computed is computed again:
    the prefill tokens beyond the prompts are the recomputed ones, plus at most one per
    preemption (the newest output, which a decode row would have computed)."""
    eng = LLM("demo", kv_memory_gb=0.002, admission="optimistic", max_num_batched_tokens=64,
              deterministic=True, enable_prefix_caching=False, kv_host_memory_gb=0).engine
    prompts = [[7 + i] * (20 + 13 * i) for i in range(10)]
    reqs = [eng.add_request(p, SamplingParams(max_tokens=90, temperature=0, ignore_eos=True)) for p in prompts]
    computed = 0
    while eng.has_work():
        computed += eng.step().prefill_tokens
    extra, n = computed - sum(map(len, prompts)), eng.scheduler.num_preemptions
    assert n > 0 and 0 < eng.recomputed_tokens <= extra <= eng.recomputed_tokens + n
    assert eng.recomputed_tokens >= sum(r.computed_before for r in reqs) > 0
