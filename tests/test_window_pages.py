"""Sliding-window models whose every layer has a window: pages wholly before the window of a
request's next token are given back (their place in the page list taken by the zeroed null page),
with the same tokens as a run that keeps every page, and admission counts the bound."""

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from zipfusion import LLM, SamplingParams  # noqa: E402
from zipfusion.engine.llm_engine import LLMEngine  # noqa: E402
from zipfusion.engine.request import Request  # noqa: E402
from zipfusion.engine.scheduler import Scheduler  # noqa: E402
from zipfusion.format import PAGE_TOKENS  # noqa: E402
from zipfusion.memory.admission import Admission, window_pages  # noqa: E402
from zipfusion.memory.kv_cache import KVCache  # noqa: E402
from helpers import save_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="module", params=[5, 21])          # shorter than a page; not a multiple of 16
def mistral(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"mistral{request.param}")
    save_tiny_checkpoint(folder, arch="mistral", sliding_window=request.param)
    return str(folder), request.param


def prompts(*lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def run(folder, ps, keep=False, monkeypatch=None, max_tokens=24, check=None, ahead=False, **kw):
    """Tokens and logprobs of ``ps`` (greedy), the engine, the most pages a decoding request held
    (``ahead``: async scheduling, each step scheduled before the last one's tokens are in)."""
    if keep:
        monkeypatch.setattr(LLMEngine, "_kv_window", lambda self: None)
    kw = {"device": "cpu", "kv_memory_gb": 0.01, "max_num_batched_tokens": kw.pop("budget", 32), **kw}
    llm = LLM(folder, **kw)
    if keep:
        monkeypatch.undo()
    eng, most = llm.engine, 0
    eng.async_scheduling = ahead
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    reqs = [eng.add_request(p, sp) for p in ps]
    while eng.has_work():
        eng.step()
        most = max([most] + [len(r.pages) - r.dropped_pages for r in eng.scheduler.running if not r.in_prefill])
        if check is not None:
            check(eng)
    return [(r.output_ids, r.logprobs) for r in reqs], eng, most


def held_books(eng):
    """Every page the cache has allocated is held by a running request, cached, or the null page;
    a dropped place holds the null page."""
    s = eng.scheduler
    live = set()
    for r in s.running:
        assert r.pages[:r.dropped_pages] == [s.pages.null_page] * r.dropped_pages
        live.update(r.pages[r.dropped_pages:])
    allocated = set((eng.cache.manager.table.state != 0).nonzero()[0].tolist())
    assert allocated == live | set(s.prefix._by_page) | {s.pages.null_page}


@pytest.mark.parametrize("compressed", [True, False])
def test_tokens_equal_keeping_every_page(mistral, compressed, monkeypatch):
    folder, w = mistral
    ps = prompts(70, 9, 40)                       # past the window; shorter than it (w=21); chunked
    dropped, eng, most = run(folder, ps, kv_compression=compressed, check=held_books)
    kept, eng_kept, _ = run(folder, ps, keep=True, monkeypatch=monkeypatch, kv_compression=compressed)
    assert dropped == kept
    assert eng_kept.scheduler.pages.pages_dropped == 0 and eng_kept.scheduler.pages.null_page is None
    # each request gave back every page before the window of the last token it fed
    want = sum(max(0, (len(p) + 24 - 1 - w) // PAGE_TOKENS) for p in ps)
    assert eng.scheduler.pages.pages_dropped == want > 0
    assert most <= window_pages(w) + 1            # (the step's own new token: given back at the next schedule)


def test_prefix_hits_and_preemption(mistral, monkeypatch):
    """Requests behind one cached prompt (their dropped pages only released: the cache keeps
    them), then a KV memory so small that requests are preempted and recomputed: deterministic
    mode, so that any schedule gives the tokens of an ample-memory run keeping every page."""
    folder, w = mistral
    shared = prompts(50, seed=1)[0]
    ps = [shared + t for t in prompts(3, 20, 1, seed=2)] + prompts(*range(2, 26), seed=3)
    ref, _, _ = run(folder, ps, keep=True, monkeypatch=monkeypatch, deterministic=True, max_tokens=40)
    small = dict(kv_memory_gb=0.0004, admission="optimistic", deterministic=True, max_tokens=40,
                 check=held_books)
    got, eng, _ = run(folder, ps, **small)
    assert got == ref == run(folder, ps, ahead=True, **small)[0]
    assert eng.scheduler.num_preemptions > 0 and eng.scheduler.prefix.stats.hit_tokens > 0
    assert eng.scheduler.pages.pages_dropped > 0


class Cache:
    """What admission asks of a cache: its capacity and the compression ratio."""
    def __init__(self, free):
        self.free = free

    def capacity_new_pages(self, keep_reserve=True):
        return self.free

    def stored_ratio(self):
        return 1.0


@pytest.mark.parametrize("mode", ["conservative", "estimate", "lookahead"])
def test_admission_counts_the_window(mode):
    """A long request under a 64-token window needs its window's pages, not its length's: more
    requests fit a small capacity."""
    def admitted(window):
        adm, running = Admission(Cache(40), mode, window=window), []
        while len(running) < 50 and adm.can_admit(16 * 20, 2000, running, certain=mode == "lookahead"):
            from zipfusion.memory.admission import RunningRequest
            running.append(RunningRequest(window_pages(window) if window else 21, 16 * 20 + 1, 16 * 20 + 2000,
                                          certain=mode == "lookahead"))
        return len(running)
    assert admitted(None) == 0 and admitted(64) >= 5
    assert Admission(Cache(4), mode, window=5).cap == 2 == window_pages(5) and window_pages(1) == 1
    assert window_pages(16) == 2 and window_pages(17) == 2 and window_pages(18) == 3


def test_engine_admits_more_at_a_small_budget(tmp_path):
    """The conservative admission (every page a request may hold set aside): with the window
    counted, more requests run at once than the same budget holds for the full lengths."""
    save_tiny_checkpoint(tmp_path, arch="mistral", sliding_window=16)
    ps = prompts(*[20] * 6, seed=4)

    def most_running(window):
        llm = LLM(str(tmp_path), device="cpu", kv_memory_gb=0.0006, admission="conservative",
                  kv_compression=False, max_num_batched_tokens=256)
        s = llm.engine.scheduler
        if window is None:
            s.admission.cap = None
        sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        for p in ps:
            llm.engine.add_request(p, sp)
        most = 0
        for _ in range(3):
            llm.engine.step()
            most = max(most, len(s.running))
        return most
    assert most_running(16) == 6 > 3 >= most_running(None)



@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_kernel_route(tmp_path, monkeypatch, device):
    """Our kernels (on the CPU the Triton interpreter, so one short prompt): the decode kernel
    skips the dropped places, the prefill restore reads the null page there, masked."""
    save_tiny_checkpoint(tmp_path, arch="mistral", sliding_window=5)
    ps = prompts(36) if device == "cpu" else prompts(300, 45, 20, seed=5)
    kw = dict(attention_backend="kernel", device=device, max_tokens=2 if device == "cpu" else 40, budget=16)
    for compressed in (True, False) if device == "cuda" else (True,):
        got, eng, _ = run(str(tmp_path), ps, kv_compression=compressed, **kw)
        assert got == run(str(tmp_path), ps, keep=True, monkeypatch=monkeypatch, kv_compression=compressed, **kw)[0]
        assert eng.scheduler.pages.pages_dropped > 0


class Pool(KVCache):
    """Page ids and nothing else (what the scheduler and the page store need of a cache)."""

    def __init__(self, pages):
        self.free_ids, self.size = list(range(pages)), pages

    def alloc(self, n, keep_reserve=True, reclaim=None):
        assert n <= len(self.free_ids), "allocated beyond capacity"
        out, self.free_ids = self.free_ids[:n], self.free_ids[n:]
        return out

    def free(self, ids):
        assert not set(ids) & set(self.free_ids), "a page freed twice"
        self.free_ids += list(ids)

    def capacity_new_pages(self, keep_reserve=True):
        return len(self.free_ids)


@settings(max_examples=40, deadline=None)
@given(window=st.integers(1, 70), pages=st.integers(16, 48), budget=st.sampled_from([16, 40, 256]),
       shared=st.integers(0, 70), caching=st.booleans(),
       reqs=st.lists(st.tuples(st.booleans(), st.integers(1, 90), st.integers(1, 60)), min_size=1, max_size=8))
@example(window=16, pages=16, budget=16, shared=0, caching=True, reqs=[(False, 90, 60)] * 3)
def test_conservative_admission_never_preempts_under_a_window(window, pages, budget, shared, caching, reqs):
    """Under the conservative admission a windowed request's promise is its window's span: no
    running request is ever preempted; each schedule leaves no page behind a window held, the
    null page in their places; every page allocated is held, cached or the null page; all finish."""
    pool = Pool(pages)
    s = Scheduler(pool, max_num_batched_tokens=budget, max_model_len=512, admission="conservative",
                  prefix_caching=caching, window=window)
    head = list(range(3, 3 + shared))
    all_reqs = [Request(i, (head if share else []) + list(range(1000 * i, 1000 * i + n)),
                        SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
                for i, (share, n, m) in enumerate(reqs)]
    for r in all_reqs:
        s.add(r)
    for _ in range(2000):
        if not s.has_work():
            break
        out = s.schedule()
        null = s.pages.null_page
        for r in s.running:
            behind = min(max(0, (r.num_computed + 1 - window) // PAGE_TOKENS), r.num_sealed_pages)
            assert r.dropped_pages >= behind and r.pages[:r.dropped_pages] == [null] * r.dropped_pages
            if not r.in_prefill:
                assert len(r.pages) - r.dropped_pages <= window_pages(window)
        live = {p for r in s.running for p in r.pages[r.dropped_pages:]}
        assert set(range(pages)) - set(pool.free_ids) == live | set(s.prefix._by_page) | {null}
        assert s.prefix.num_shared == sum(n.refs >= 2 for n in s.prefix._by_page.values())
        s.computed(out)
        sampled = out.decode + [ch.request for ch in out.prefill if ch.completes]
        s.after_forward(out.decode + [ch.request for ch in out.prefill])
        s.postprocess(sampled, [7] * len(sampled), {})
    assert not s.has_work() and s.num_preemptions == 0
    assert all(len(r.output_ids) == r.params.max_tokens for r in all_reqs)
