"""The OpenAI-compatible server on the CPU with the embedded demo model."""

import json

import pytest

pytest.importorskip("fastapi", reason="server tests need fastapi (pip install 'zipfusion[server]')")
from fastapi.testclient import TestClient  # noqa: E402

from zipfusion.engine import LLM, LLMEngine, SamplingParams  # noqa: E402
from zipfusion.server.openai import create_app  # noqa: E402


@pytest.fixture(scope="module")
def engine():
    return LLMEngine("demo", device="cpu", kv_memory_gb=0.05, max_model_len=256)


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine)) as c:
        yield c


def offline_greedy(prompt, n):
    llm = LLM("demo", device="cpu", kv_memory_gb=0.05, max_model_len=256)
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]


def test_models_and_health(client):
    assert client.get("/health").json() == {"status": "ok"}
    data = client.get("/v1/models").json()["data"]
    assert data[0]["id"] == "demo" and data[0]["max_model_len"] == 256


def test_completion_matches_offline_greedy(client):
    r = client.post("/v1/completions", json={"model": "demo", "prompt": "In the beginning", "max_tokens": 12,
                                              "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    ref = offline_greedy("In the beginning", 12)
    assert body["choices"][0]["text"] == ref.text
    assert body["usage"]["completion_tokens"] == 12
    assert body["choices"][0]["finish_reason"] == "length"


def test_streaming_concatenates_to_the_same_text(client):
    with client.stream("POST", "/v1/completions", json={"prompt": "And God said", "max_tokens": 10,
                                                         "temperature": 0, "ignore_eos": True, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == offline_greedy("And God said", 10).text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_bad_requests_are_refused_and_running_work_survives(client, engine):
    cases = [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"max_tokens": 4}, "prompt"),
        ({"prompt": "x", "model": "gpt-4"}, "not served here"),
        ({"prompt": "word " * 400, "max_tokens": 4}, "max_model_len"),
        ({"prompt": [10**9], "max_tokens": 4}, "token ids"),
        ({"prompt": "x", "n": 2}, "n=1"),
    ]
    for body, words in cases:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 400, (body, r.text)
        assert words in r.json()["error"]["message"], (words, r.text)
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    # the engine is still healthy and serves
    r = client.post("/v1/completions", json={"prompt": "In the beginning", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert not engine.scheduler.has_work()


def test_stop_string_is_cut_in_stream_and_in_body(client):
    ref = offline_greedy("In the beginning", 20).text
    words = ref.split()
    if len(words) < 3:
        pytest.skip("demo continuation too short to pick a stop word")
    stop = words[2]
    expect = ref[:ref.find(stop)]
    r = client.post("/v1/completions", json={"prompt": "In the beginning", "max_tokens": 20, "temperature": 0,
                                              "stop": [stop], "ignore_eos": True})
    assert r.json()["choices"][0]["text"] == expect
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    with client.stream("POST", "/v1/completions", json={"prompt": "In the beginning", "max_tokens": 20,
                                                         "temperature": 0, "stop": [stop], "ignore_eos": True,
                                                         "stream": True}) as s:
        lines = [line for line in s.iter_lines() if line and line != "data: [DONE]"]
    assert "".join(json.loads(l[6:])["choices"][0]["text"] for l in lines) == expect


def test_metrics_export_kv_numbers(client):
    client.post("/v1/completions", json={"prompt": "In the beginning", "max_tokens": 20, "temperature": 0,
                                         "ignore_eos": True})
    text = client.get("/metrics").text
    assert "zipfusion_requests_total" in text
    assert "zipfusion_kv_pages_compressed" in text
    assert "zipfusion_kv_arena_bytes" in text
