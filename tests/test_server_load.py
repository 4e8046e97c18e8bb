"""The server under load, over real HTTP (uvicorn on 127.0.0.1, the demo model on the CPU), each
test bounded to a few seconds: huge bodies beside a running stream, concurrency past saturation
with preemption, mass disconnects, a short soak, compression on vs off and deterministic mode
under concurrent load."""

import asyncio
import json
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="server tests need fastapi (pip install -e '.[server]')")
import httpx  # noqa: E402
from test_server import live_server  # noqa: E402

from zipfusion.engine import LLMEngine  # noqa: E402
from zipfusion.server import openai as server_openai  # noqa: E402
from zipfusion.server.openai import create_app  # noqa: E402

T = 60


def stream_gaps(url: str, body: dict, out: list, started: threading.Event) -> None:
    """Stream a completion; append each chunk's arrival time to ``out``."""
    with httpx.Client(timeout=T) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out.append(time.perf_counter())
                started.set()


def test_huge_bodies_are_refused_before_parsing_and_do_not_stall_a_stream(monkeypatch):
    """A million prompt token ids (3 MB) or 400k logit_bias entries: a 413 counted from the raw
    bytes, never parsed; four of them at once while a stream runs leave its gaps as they were
    (before: 1.2 s of stall each, 7.1 s for four). A body within the bound is parsed on a worker
    thread, not on the event loop."""
    parsed_on = []
    real = server_openai.parse_body

    def spy(model, raw):
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:                     # no event loop in this thread: a worker
            on_loop = False
        parsed_on.append((on_loop, len(raw)))
        return real(model, raw)
    monkeypatch.setattr(server_openai, "parse_body", spy)
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
