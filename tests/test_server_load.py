"""The server under load, over real HTTP (uvicorn on 127.0.0.1, the demo model on the CPU), each
test bounded to a few seconds: huge bodies beside a running stream, concurrency past saturation
with preemption, mass disconnects, a short soak, compression on vs off and deterministic mode
under concurrent load."""

import asyncio
import json
import random
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="server tests need fastapi (pip install -e '.[server]')")
import httpx  # noqa: E402
from test_server import live_server  # noqa: E402

from zipfusion.engine import LLMEngine  # noqa: E402
from zipfusion.server import openai as server_openai  # noqa: E402
from zipfusion.server.limits import ServerLimits  # noqa: E402
from zipfusion.server.openai import create_app  # noqa: E402
from zipfusion.server.protocol import LARGE_BODY, may_hold_surrogates  # noqa: E402

T = 60


def stream_gaps(url: str, body: dict, out: list, started: threading.Event, stop: threading.Event | None = None) -> None:
    """Stream a completion; append each chunk's arrival time to ``out``; leave once ``stop`` is set."""
    with httpx.Client(timeout=T) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out.append(time.perf_counter())
                started.set()
            if stop is not None and stop.is_set():
                return


def test_huge_bodies_are_refused_before_parsing_and_do_not_stall_a_stream(monkeypatch):
    """A million prompt token ids (3 MB) or 400k logit_bias entries: a 413 counted from the raw
    bytes, never parsed; four of them at once while a stream runs leave its gaps as they were
    (before: 1.2 s of stall each, 7.1 s for four). A body within the bound is parsed on a worker
    thread, not on the event loop."""
    parsed_on = []
    real = server_openai.load_body

    def spy(model, raw):
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:                     # no event loop in this thread: a worker
            on_loop = False
        parsed_on.append((on_loop, len(raw)))
        return real(model, raw)
    monkeypatch.setattr(server_openai, "load_body", spy)
    engine = LLMEngine("demo", device="cpu", kv_memory_gb=0.05, max_model_len=256)
    ids = json.dumps({"prompt": list(range(1, 1_000_001)), "max_tokens": 1}).encode()
    bias = json.dumps({"prompt": "x", "logit_bias": {str(i): 1 for i in range(400_000)}}).encode()
    with live_server(create_app(engine)) as url:
        times, started = [], threading.Event()
        streamer = threading.Thread(target=stream_gaps, args=(url, {"prompt": "In the beginning", "max_tokens": 60,
                                                                    "ignore_eos": True, "stream": True},
                                                              times, started))
        streamer.start()
        assert started.wait(T)
        time.sleep(0.3)                          # the stream's own gaps first
        during_from = time.perf_counter()

        async def hammer():
            async with httpx.AsyncClient(timeout=T) as c:
                return await asyncio.gather(*[c.post(url + "/v1/completions", content=b, headers={
                    "content-type": "application/json"}) for b in (ids, bias, ids, bias)])
        replies = asyncio.run(hammer())
        during_to = time.perf_counter()
        streamer.join(T)
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=T)
    assert all(x.status_code == 413 and "JSON values" in x.json()["error"]["message"] for x in replies)
    assert r.status_code == 200 and len(times) == 60
    gaps = [(b - a, b) for a, b in zip(times, times[1:])]
    before = max(g for g, t in gaps if t < during_from)
    during = max((g for g, t in gaps if during_from <= t <= during_to + 0.5), default=0.0)
    assert during <= before + 0.5, (before, during)      # a generous margin on a loaded 2-core CPU
    assert all(size < 100_000 for _, size in parsed_on)  # the huge bodies never reached the parser
    assert parsed_on and not any(on_loop for on_loop, _ in parsed_on)


class LagProbe:
    """ASGI wrapper: a task on the server's event loop that sleeps 10 ms again and again and records
    (time, how late it woke)."""

    def __init__(self, app):
        self.app, self.lags = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            asyncio.get_running_loop().create_task(self.tick())
        await self.app(scope, receive, send)

    async def tick(self):
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            self.lags.append((now, now - t0 - 0.01))


def test_near_limit_bodies_stall_neither_the_event_loop_nor_a_stream():
    """Two bodies of a million prompt token ids each (6 MB, within every limit: parsed whole, then
    refused by max_model_len) while a stream runs: the event loop's lateness stays within 0.1 s of
    its own baseline, the stream's gaps within 0.15 s of theirs. The bodies are parsed in the body
    worker process; the server still builds their ids as Python ints (in short GIL holds), which
    slows the engine thread's steps while it runs. Before: a 0.2-0.3 s pause with the parse on a
    thread of the server (the engine thread taking the GIL back from it dozens of times a step)."""
    engine = LLMEngine("demo", device="cpu", kv_memory_gb=0.05, max_model_len=1024)
    rows, rng = 1000, random.Random(0)
    bodies = [json.dumps({"prompt": [[rng.randrange(3, 2048) for _ in range(1000)] for _ in range(rows)],
                          "max_tokens": 100}).encode() for _ in range(2)]
    assert all(len(b) > 4 * LARGE_BODY for b in bodies)
    app = LagProbe(create_app(engine, limits=ServerLimits(max_sequences=rows)))
    with live_server(app) as url:
        times, started, stop = [], threading.Event(), threading.Event()
        streamer = threading.Thread(target=stream_gaps, args=(url, {"prompt": "In the beginning", "max_tokens": 1000,
                                                                    "ignore_eos": True, "stream": True},
                                                              times, started, stop))
        streamer.start()
        assert started.wait(T)
        time.sleep(0.5)                          # the baselines
        during_from = time.perf_counter()

        async def send():
            async with httpx.AsyncClient(timeout=T) as c:
                return await asyncio.gather(*[c.post(url + "/v1/completions", content=b, headers={
                    "content-type": "application/json"}) for b in bodies])
        replies = asyncio.run(send())
        during_to = time.perf_counter()
        time.sleep(0.1)
        stop.set()
        streamer.join(T)
    assert all(r.status_code == 400 and "max_model_len" in r.json()["error"]["message"] for r in replies)
    assert times[-1] > during_to, "the stream ended before the bodies were handled: lengthen it"

    def split(samples):
        before = max(v for t, v in samples if t < during_from)
        during = max(v for t, v in samples if during_from <= t <= during_to)
        return before, during
    lag_before, lag_during = split(app.lags)
    gap_before, gap_during = split([(b, b - a) for a, b in zip(times, times[1:])])
    assert lag_during <= lag_before + 0.1, (lag_before, lag_during)
    assert gap_during <= gap_before + 0.15, (gap_before, gap_during)


@pytest.mark.parametrize("raw, may", [
    (rb'{"prompt": "plain ascii"}', False),
    ('{"prompt": "\\u00e9 \ud55c\uae00"}'.encode(), False),       # a BMP escape, Hangul (raw bytes \xed\x95..)
    (rb'{"prompt": "\ud800"}', True),
    (rb'{"prompt": "\uDFFF"}', True),
    (rb'{"prompt": "\ud83d\ude00"}', True),                       # a valid pair: left to the full check
    (b'{"prompt": "\xed\xa0\x80"}', True),                          # a surrogate encoded raw
    ('{"prompt": "x"}'.encode("utf-16-le"), True),                 # not UTF-8: never skipped
])
def test_may_hold_surrogates(raw, may):
    assert may_hold_surrogates(raw) is may


def prompt(i: int, n: int = 30) -> list[int]:
    return [5 + (i * 7 + j) % 1500 for j in range(n)]


async def stream_ids(c: httpx.AsyncClient, url: str, body: dict) -> tuple[list[int], str | None]:
    """A streamed completion's token ids and finish reason."""
    ids, reason = [], None
    async with c.stream("POST", url + "/v1/completions", json={**body, "stream": True, "return_token_ids": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    ids += ch.get("token_ids") or []
                    reason = ch.get("finish_reason") or reason
    return ids, reason


def many(url: str, bodies: list[dict]) -> list:
    async def go():
        async with httpx.AsyncClient(timeout=T, limits=httpx.Limits(max_connections=len(bodies))) as c:
            return await asyncio.gather(*[stream_ids(c, url, b) for b in bodies])
    return asyncio.run(go())


def pages_settle(engine, timeout: float = 10.0) -> dict:
    """The KV numbers once the engine is idle: every page free or an evictable prefix-cache page."""
    deadline = time.monotonic() + timeout
    while engine.scheduler.has_work():
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.02)
    return engine.kv_stats()


GUIDED = r"[a-z]{3,6}( [a-z]{3,6}){3}\."


def test_64_streams_past_saturation_with_preemption_all_complete_exactly():
    """64 concurrent streams in a KV memory of 76 pages with optimistic admission: requests are
    preempted and recomputed, and every one ends with exactly its max_tokens tokens; 8 more under
    a grammar (a regex) keep it through their preemptions."""
    engine = LLMEngine("demo", device="cpu", kv_memory_gb=0.002, max_model_len=256, admission="optimistic",
                       max_num_seqs=128)
    with live_server(create_app(engine)) as url:
        free = [{"prompt": prompt(i), "max_tokens": 10, "ignore_eos": True, "temperature": 0} for i in range(64)]
        guided = [{"prompt": prompt(500 + i), "max_tokens": 40, "seed": i, "guided_regex": GUIDED} for i in range(8)]
        out = many(url, free + guided)
        stats = pages_settle(engine)
    assert all(len(ids) == 10 and reason == "length" for ids, reason in out[:64])
    import re
    texts = [engine.tokenizer.decode(ids) for ids, _ in out[64:]]
    assert all(re.fullmatch(GUIDED, t) for t in texts), texts
    assert engine.scheduler.num_preemptions > 0
    assert stats["pages_in_use"] == stats["prefix_cache_evictable_pages"]     # nothing held by a request


def test_mass_disconnect_returns_every_page_and_the_next_request_works():
    engine = LLMEngine("demo", device="cpu", kv_memory_gb=0.02, max_model_len=256)
    with live_server(create_app(engine)) as url:
        async def leave():
            clients = [httpx.AsyncClient(timeout=T) for _ in range(32)]
            streams = []
            for i, c in enumerate(clients):
                cm = c.stream("POST", url + "/v1/completions", json={"prompt": prompt(i), "max_tokens": 200,
                                                                     "ignore_eos": True, "stream": True})
                streams.append((cm, await cm.__aenter__()))
            for _, r in streams:                    # each has started streaming
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        break
            for (cm, _), c in zip(streams, clients):    # then all leave at once
                await cm.__aexit__(None, None, None)
                await c.aclose()
        asyncio.run(leave())
        stats = pages_settle(engine)
        assert stats["pages_in_use"] == stats["prefix_cache_evictable_pages"]
        text = httpx.get(url + "/metrics", timeout=T).text
        aborted = next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("zipfusion:request_success_total") and 'finished_reason="abort"' in line)
        assert aborted == 32                        # stopped where they were, not run to their 200 tokens
        assert len(engine.scheduler.running) == len(engine.scheduler.waiting) == 0
        (ids, reason), = many(url, [{"prompt": prompt(99), "max_tokens": 5, "ignore_eos": True}])
        assert len(ids) == 5 and reason == "length"


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="reads RSS from Linux /proc")
def test_a_short_soak_keeps_memory_flat():
    """Rounds of 16 concurrent requests (fresh prompts, so the prefix cache fills and evicts) for a
    few seconds: this process's RSS (server and engine in it) after the warm-up rounds stays flat."""
    engine = LLMEngine("demo", device="cpu", kv_memory_gb=0.01, max_model_len=256)
    with live_server(create_app(engine)) as url:
        def round_(k):
            return many(url, [{"prompt": prompt(1000 * k + i, 40), "max_tokens": 6, "ignore_eos": True}
                              for i in range(16)])
        for k in range(2):
            round_(k)
        start, k, deadline = rss_mib(), 2, time.monotonic() + 3.0
        while time.monotonic() < deadline:
            assert all(len(ids) == 6 for ids, _ in round_(k))
            k += 1
        growth = rss_mib() - start
    assert k >= 4 and growth < 32, (k, growth)


def test_deterministic_under_concurrent_load_and_compression_on_vs_off():
    """--deterministic: a seeded sampled request gives the same tokens alone and among 15 others,
    and the same again with the KV cache uncompressed (bf16: every bit kept)."""
    target = {"prompt": prompt(7, 40), "max_tokens": 12, "temperature": 1.0, "seed": 3, "ignore_eos": True}
    others = [{"prompt": prompt(100 + i, 20 + i), "max_tokens": 8 + i % 5, "temperature": 0.8, "ignore_eos": True}
              for i in range(15)]
    runs = {}
    for compression in (True, False):
        engine = LLMEngine("demo", device="cpu", kv_memory_gb=0.02, max_model_len=256, deterministic=True,
                           dtype="bfloat16", kv_compression=compression)
        with live_server(create_app(engine)) as url:
            alone = many(url, [target])[0]
            crowd = many(url, others[:7] + [target] + others[7:])[7]
        runs[compression] = (alone, crowd)
    (alone, crowd), (alone_open, crowd_open) = runs[True], runs[False]
    assert len(alone[0]) == 12 and alone == crowd == alone_open == crowd_open


def test_a_reply_rendered_choice_by_choice_is_the_same_json():
    from zipfusion.server.responses import render
    body = {"id": "cmpl-1", "object": "text_completion", "model": 'a "model"', "usage": {"prompt_tokens": 3},
            "choices": [{"index": i, "text": "é\"\\\n" * i, "logprobs": {"top_logprobs": [{"x": -1.5}]}}
                        for i in range(3)]}
    assert json.loads(render(body)) == body and json.loads(render({**body, "choices": []}))["choices"] == []
    with pytest.raises(ValueError):
        render({**body, "choices": [{"logprob": float("nan")}]})
