"""Property tests: random request lifecycles against a tiny arena with real bytes (CPU).

Operations: admit (prefill: allocate the prompt's pages, write tokens, compress full pages),
append tokens (a page boundary allocates a page, a full page is compressed), finish, preempt
the newest, compact. After every step: no two live pages overlap anywhere in the arena, every
page of every request reads back (open, or decoded from page_loc) exactly as written, and the
chunks add up. Conservative admission: an admitted request never hits MemoryExhausted.
Estimate admission: MemoryExhausted may happen, the scheduler preempts its newest request, and
nothing is corrupted. Compression never fails: a full page that finds no room stays open and is
sealed again later (as the engine does). With no request left, all memory is reusable.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from helpers import assert_packed_books
from zipfusion.format import PageLayout
from zipfusion.memory import Admission, KVCacheManager, MemoryExhausted, RunningRequest

LAYOUT = PageLayout(1, 64)
OPEN = LAYOUT.open_page_bytes
L = 3
SPIKE = [0.0, 0.02, 0.3]        # per layer: chance a token carries an outlier (makes blocks raw)


def token_data(seed: int, n: int) -> torch.Tensor:
    """[L, n, 2, H, D] bf16: compressible Gaussian data, outliers per layer as SPIKE says."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(L, n, 2, LAYOUT.num_kv_heads, LAYOUT.head_dim, generator=g)
    x = torch.sign(x) * x.abs().clamp(min=2.0 ** -9, max=4.0)
    for layer, p in enumerate(SPIKE):
        spikes = torch.rand(n, generator=g) < p
        x[layer, spikes, :, :, 0] = 2.0 ** 12
    return x.to(torch.bfloat16)


@dataclass
class Req:
    seed: int
    total: int                   # prompt + max new tokens
    data: torch.Tensor           # [L, total, 2, H, D]
    pages: list
    ntok: int = 0


class ManagerMachine(RuleBasedStateMachine):
    MODE = "conservative"
    RESERVE = 2                   # the manager's default compression reserve (chunks per layer)
    SHARED = True                 # one pool for all layers (False: static per-layer chunks)

    def __init__(self):
        super().__init__()
        self._threads = torch.get_num_threads()
        torch.set_num_threads(1)          # tiny tensors: far faster on a busy 2-core box
        chunk = 4 * OPEN
        self.m = KVCacheManager(L, LAYOUT, budget_bytes=24 * chunk, chunk_bytes=chunk,
                                reserve_chunks=self.RESERVE, shared_pool=self.SHARED)
        self.adm = Admission(self.m, mode=self.MODE)
        self.empty_capacity = self.m.capacity_new_pages()
        self.reqs: list[Req] = []
        self.unsealed: set[int] = set()          # full pages compression left open
        self.next_seed = 0
        self.exhausted = 0

    def teardown(self):
        torch.set_num_threads(self._threads)

    # ------------------------------------------------------------------ helpers
    def _write(self, req: Req, upto: int) -> None:
        """Write tokens req.ntok .. upto-1 into the request's open pages."""
        t = req.ntok
        while t < upto:
            i, j = divmod(t, 16)
            k = min(16 - j, upto - t)
            for layer in range(L):
                self.m.open_page(layer, req.pages[i])[:, j:j + k] = req.data[layer, t:t + k].transpose(0, 1)
            t += k
        req.ntok = upto

    def _alloc(self, req: Req, n: int) -> bool:
        """Allocate n pages for req; on MemoryExhausted preempt the newest request (estimate)."""
        while True:
            try:
                req.pages += self.m.alloc_pages(n)
                return True
            except MemoryExhausted:
                assert self.MODE == "estimate", "an admitted request hit MemoryExhausted"
                self.exhausted += 1
                victim = self.reqs[-1]
                self._free(victim)
                if victim is req:
                    return False

    def _free(self, req: Req) -> None:
        self.m.free_pages(req.pages)
        self.unsealed.difference_update(req.pages)
        self.reqs.remove(req)

    def _seal(self, ids: list[int]) -> None:
        """Compress full pages (and those left open before), as the engine's seal does, each
        request's into one of three fill streams."""
        ids = sorted(self.unsealed | set(ids))
        if ids:
            stream = {p: r.seed % 3 for r in self.reqs for p in r.pages}
            self.m.set_streams(ids, [stream[p] for p in ids])
            promised = self.adm.promised_pages([RunningRequest(len(r.pages), r.ntok, r.total) for r in self.reqs])
            self.unsealed = set(self.m.compress_pages(ids, min_capacity=promised))

    # ------------------------------------------------------------------ rules
    @rule(prompt=st.integers(1, 200), out=st.integers(0, 60))
    def admit(self, prompt, out):
        running = [RunningRequest(len(r.pages), r.ntok, r.total) for r in self.reqs]
        if not self.adm.can_admit(prompt, out, running):
            return
        req = Req(self.next_seed, prompt + out, token_data(self.next_seed, prompt + out), [])
        self.next_seed += 1
        self.reqs.append(req)
        if not self._alloc(req, -(-prompt // 16)):
            return
        self._write(req, prompt)
        self._seal(req.pages[:prompt // 16])

    @precondition(lambda self: self.reqs)
    @rule(which=st.integers(0, 100), k=st.integers(1, 24))
    def append(self, which, k):
        req = self.reqs[which % len(self.reqs)]
        for _ in range(min(k, req.total - req.ntok)):
            if req.ntok % 16 == 0 and not self._alloc(req, 1):
                return
            self._write(req, req.ntok + 1)
            if req.ntok % 16 == 0:
                self._seal([req.pages[-1]])

    @precondition(lambda self: self.reqs)
    @rule(which=st.integers(0, 100))
    def finish(self, which):
        self._free(self.reqs[which % len(self.reqs)])

    @precondition(lambda self: self.reqs)
    @rule()
    def preempt_newest(self):
        self._free(self.reqs[-1])

    @rule()
    def compact(self):
        self.m.compact()
        self._seal([])

    # ------------------------------------------------------------------ invariants
    @invariant()
    def no_overlap_and_chunks_add_up(self):
        m = self.m
        ids = np.nonzero(m.table.state != 0)[0]
        loc = m.table.loc[:, ids]
        assert (loc >= 0).all()
        start = (loc & ~1).ravel()
        size = np.where((m.table.state[ids] == 1)[None, :], OPEN, m.table.size[:, ids]).ravel()
        o = np.argsort(start)
        assert (start[o][1:] >= (start + size)[o][:-1]).all(), "two live pages overlap"
        assert ((start % 16) == 0).all() and ((start + size) <= m.arena.numel()).all()
        assert (start // m.chunk_bytes == (start + size - 1) // m.chunk_bytes).all()
        owned = m.open.num_groups * L + sum(len(c) for c in m.packed.chunks)
        pools = range(m.pool.num_pools)
        assert owned + sum(m.pool.available(p) for p in pools) == sum(m.pool.chunks_per_pool)
        assert m.capacity_new_pages() >= 0

    @invariant()
    def packed_books_match_the_page_table(self):
        assert_packed_books(self.m)

    @invariant()
    def contents_are_what_was_written(self):
        reqs = [r for r in self.reqs if r.ntok]
        if not reqs:
            return
        ids = [p for r in reqs for p in r.pages[:-(-r.ntok // 16)]]
        for layer in range(L):
            got = self.m.read_pages(layer, ids)                          # [n, 2, 16, H, D]
            got = got.transpose(1, 2).reshape(-1, 16, 2, LAYOUT.num_kv_heads, LAYOUT.head_dim)
            first = 0
            for r in reqs:
                n = -(-r.ntok // 16)
                mine = got[first:first + n].reshape(-1, 2, LAYOUT.num_kv_heads, LAYOUT.head_dim)
                want = r.data[layer, :r.ntok]
                assert torch.equal(mine[:r.ntok].view(torch.int16), want.view(torch.int16))
                first += n

    @invariant()
    def all_memory_reusable_when_idle(self):
        if not self.reqs:
            assert self.m.capacity_new_pages() == self.empty_capacity
            assert self.m.open.num_groups == 0 and not any(self.m.packed.chunks)


class EstimateMachine(ManagerMachine):
    MODE = "estimate"


class StaticMachine(ManagerMachine):
    SHARED = False


SETTINGS = settings(max_examples=20, stateful_step_count=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
TestConservative = ManagerMachine.TestCase
TestConservative.settings = SETTINGS
TestEstimate = EstimateMachine.TestCase
TestEstimate.settings = SETTINGS
TestStatic = StaticMachine.TestCase
TestStatic.settings = SETTINGS


def test_estimate_reported_sequence():
    """Found by fresh draws (issue 10): prompts of 1, 97 and 176 tokens admitted in estimate mode
    once raised MemoryExhausted out of compression. Now compression leaves pages open instead."""
    for outs in ((0, 0, 0), (60, 60, 60), (0, 30, 60)):
        m = EstimateMachine()
        for prompt, out in zip((1, 97, 176), outs):
            m.admit(prompt, out)
            m.no_overlap_and_chunks_add_up()
            m.contents_are_what_was_written()
        for which in range(3):
            m.append(which, 24)
            m.contents_are_what_was_written()
        m.teardown()


def replay(machine_cls, ops) -> None:
    """Run one reported sequence of rules, checking the invariants after each."""
    m = machine_cls()
    try:
        for name, kw in ops:
            getattr(m, name)(**kw)
            m.no_overlap_and_chunks_add_up()
            m.contents_are_what_was_written()
    finally:
        m.teardown()


def test_conservative_reported_sequence():
    """Found by fresh draws (issue 20): a page sealed into fresh chunks took a group's worth of
    pool chunks back from the capacity that admission had promised; the next page of an admitted
    request then hit MemoryExhausted. Sealing now waits until it pays for itself."""
    admits = [(145, 0), (1, 0), (127, 2), (1, 0), (1, 0)]
    replay(ManagerMachine, [("admit", dict(prompt=p, out=o)) for p, o in admits]
           + [("append", dict(which=57, k=2))])


def test_static_reported_sequence():
    """Found at 20x the example count (issue 24): static per-layer pools, the same cause."""
    replay(StaticMachine, [("admit", dict(prompt=200, out=41)), ("admit", dict(prompt=96, out=0)),
                           ("append", dict(which=0, k=11)), ("append", dict(which=0, k=14)),
                           ("append", dict(which=0, k=16))])
