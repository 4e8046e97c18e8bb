"""The OpenAI-compatible server on the CPU with the embedded demo model.

Most tests use FastAPI's TestClient; the ones about concurrency (client disconnects, metrics
while a request runs, /health during a long tokenization) run uvicorn on 127.0.0.1 in a thread.
Every HTTP call has a timeout (httpx), and every test a watchdog (TestClient has none).
"""

import faulthandler
import json
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="server tests need fastapi (pip install -e '.[server]')")
import httpx  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from zipfusion.engine import LLM, LLMEngine, SamplingParams  # noqa: E402
from zipfusion.server.openai import create_app  # noqa: E402
from helpers import live_server  # noqa: E402

T = 60      # seconds: the bound on any one HTTP call


@pytest.fixture(autouse=True)
def bounded():
    """TestClient calls run in-process without a timeout: a test that hangs dumps every
    thread's stack and ends the run instead of blocking CI."""
    faulthandler.dump_traceback_later(180, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="module")
def engine():
    return LLMEngine("demo", device="cpu", kv_memory_gb=0.05, max_model_len=256)


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine)) as c:
        yield c


@pytest.fixture(scope="module")
def offline():
    return LLM("demo", device="cpu", kv_memory_gb=0.05, max_model_len=256)


def offline_run(llm, prompt, n, **kw):
    kw = {"temperature": 0, "ignore_eos": True, **kw}
    return llm.generate([prompt], SamplingParams(max_tokens=n, **kw), use_tqdm=False)[0]


def wait_until(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def sse_events(lines):
    out = [line for line in lines if line]
    assert out[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in out[:-1]]


def metric(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


# -- basics ---------------------------------------------------------------------------------------------

def test_models_and_health(client):
    assert client.get("/health").json() == {"status": "ok"}
    data = client.get("/v1/models").json()["data"]
    assert data[0]["id"] == "demo" and data[0]["max_model_len"] == 256
    assert abs(data[0]["created"] - time.time()) < 3600                 # when the server started, not 0


def test_tokenize_detokenize_version(client, engine):
    import zipfusion
    assert client.get("/version").json() == {"version": zipfusion.__version__}
    r = client.post("/tokenize", json={"prompt": "In the beginning"}).json()
    assert r["tokens"] == engine.tokenizer.encode("In the beginning") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 256
    plain = client.post("/tokenize", json={"prompt": "In the beginning", "add_special_tokens": False}).json()
    assert plain["tokens"] == engine.tokenizer.encode_plain("In the beginning") != r["tokens"]
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["tokens"] == engine.tokenizer.encode(engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}]))
    assert client.post("/detokenize", json={"tokens": plain["tokens"]}).json() == {"prompt": "In the beginning"}
    for route, body, param in [("/tokenize", {}, "prompt"), ("/detokenize", {"tokens": [5, 99999]}, "tokens"),
                               ("/tokenize", {"prompt": "x", "model": "nope"}, "model")]:
        err = client.post(route, json=body).json()["error"]
        assert err["param"] == param, (route, body, err)
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                                  "logprobs": False, "top_logprobs": 0})
    assert r.status_code == 200, r.text          # schema-valid, so accepted: 0 top logprobs asks for nothing


def test_completion_matches_offline_greedy(client, offline):
    r = client.post("/v1/completions", json={"model": "demo", "prompt": "In the beginning", "max_tokens": 12,
                                              "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == offline_run(offline, "In the beginning", 12).text
    assert body["usage"]["completion_tokens"] == 12
    assert body["choices"][0]["finish_reason"] == "length"


def test_streaming_concatenates_to_the_same_text(client, offline):
    with client.stream("POST", "/v1/completions", json={"prompt": "And God said", "max_tokens": 10,
                                                         "temperature": 0, "ignore_eos": True, "stream": True}) as r:
        chunks = sse_events(list(r.iter_lines()))
    assert "".join(c["choices"][0]["text"] for c in chunks) == offline_run(offline, "And God said", 10).text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks)              # no include_usage: no usage chunk


def test_bad_requests_are_refused_and_running_work_survives(client, engine):
    cases = [     # (body, words in the message, the error's param)
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens"),
        ({"prompt": "x", "temperature": -1}, "temperature", "temperature"),
        ({"max_tokens": 4}, "prompt", "prompt"),
        ({"prompt": "word " * 400, "max_tokens": 4}, "max_model_len", "prompt"),
        ({"prompt": "x", "max_tokens": 300}, "max_model_len", "max_tokens"),
        ({"prompt": [10**9], "max_tokens": 4}, "token id", "prompt"),
        ({"prompt": [], "max_tokens": 4}, "empty", "prompt"),
        ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format", "response_format"),
        ({"prompt": "x", "presence_penalty": 3}, "presence_penalty", "presence_penalty"),
        ({"prompt": "x", "logprobs": 21}, "max_logprobs", "logprobs"),
        ({"prompt": "x", "logprobs": 1, "echo": True}, "echo", "echo"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "stream_options"),
        ({"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}}, "continuous_usage_stats",
         "stream_options.continuous_usage_stats"),
        ({"prompt": "x", "best_of": 3}, "best_of", "best_of"),
        ({"prompt": "x", "suffix": "y"}, "suffix", "suffix"),
        ({"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias", "logit_bias"),
        ({"prompt": "x", "min_tokens": 300}, "min_tokens", "min_tokens"),         # above the default max_tokens
    ]
    for body, words, param in cases:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert words in err["message"] and err["param"] == param, (words, param, r.text)
        assert err["type"] == "invalid_request_error" and err["code"] is None       # OpenAI's: a string or null
    for body in ({"prompt": "x", "stop": "", "max_tokens": 2}, {"prompt": "x", "stop": ["", "zz"], "max_tokens": 2}):
        assert client.post("/v1/completions", json=body).status_code == 200       # "" stops nothing: dropped
    r = client.post("/v1/completions", json={"prompt": "x", "model": "gpt-4"})
    assert r.status_code == 404 and "not served here" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["type"] == "invalid_request_error"
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    chat = [
        ({"tools": [{"type": "function", "function": {"nom": "f"}}]}, "tools[0]"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 50}, "max_logprobs"),
        ({"max_completion_tokens": 300}, "max_model_len"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "image_url"),
        ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "tool_calls"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content: expected a string, a list of content"),
    ]
    for extra, words in chat:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (extra, r.text)
    # the engine is still healthy and serves
    r = client.post("/v1/completions", json={"prompt": "In the beginning", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert not engine.scheduler.has_work()


def test_one_engine_is_driven_by_one_server(client, engine):
    from zipfusion.server.engine_loop import EngineLoop
    client.get("/health")
    loop = client.app.state.engine_loop()                  # the TestClient app's engine thread
    with pytest.raises(RuntimeError, match="one server per engine"):
        EngineLoop(engine)
    assert loop.thread.is_alive()


def test_a_failed_engine_step_fails_only_the_requests_in_flight(client, engine, monkeypatch):
    real = engine.step
    calls = []

    def broken():
        if not calls:
            calls.append(1)
            raise RuntimeError("boom")
        return real()

    monkeypatch.setattr(engine, "step", broken)
    body = {"prompt": "In the beginning", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
    assert not engine.scheduler.has_work()
    r = client.post("/v1/completions", json=body)                 # the server goes on serving
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_404_and_405_in_openai_error_shape(client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] is None and "detail" not in r.json()
    r = client.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] is None


def test_stop_string_is_cut_in_stream_and_in_body(client, offline):
    ref = offline_run(offline, "In the beginning", 20).text
    words = ref.split()
    if len(words) < 3:
        pytest.skip("demo continuation too short to pick a stop word")
    stop = words[2]
    expect = ref[:ref.find(stop)]
    body = {"prompt": "In the beginning", "max_tokens": 20, "temperature": 0, "stop": [stop], "ignore_eos": True}
    r = client.post("/v1/completions", json=body)
    assert r.json()["choices"][0]["text"] == expect
    assert r.json()["choices"][0]["finish_reason"] == "stop" and r.json()["choices"][0]["stop_reason"] == stop
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        chunks = sse_events(list(s.iter_lines()))
    assert "".join(c["choices"][0]["text"] for c in chunks) == expect


# -- the OpenAI API's breadth ---------------------------------------------------------------------------

def test_a_list_of_prompts_gives_one_choice_per_prompt_in_order(client, offline):
    prompts = ["In the beginning", "And God said", "The LORD is my shepherd"]
    r = client.post("/v1/completions", json={"prompt": prompts, "max_tokens": 6, "temperature": 0,
                                              "ignore_eos": True})
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert [c["text"] for c in choices] == [offline_run(offline, p, 6).text for p in prompts]
    ids = offline.tokenizer.encode(prompts[0])
    r = client.post("/v1/completions", json={"prompt": [ids, ids], "max_tokens": 6, "temperature": 0,
                                              "ignore_eos": True})
    assert [c["text"] for c in r.json()["choices"]] == [offline_run(offline, prompts[0], 6).text] * 2
    assert r.json()["usage"]["prompt_tokens"] == 2 * len(ids)


def test_n_samples_with_seed_plus_i(client, offline):
    body = {"prompt": ["In the beginning", "And God said"], "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 3,
            "ignore_eos": True}
    choices = client.post("/v1/completions", json=body).json()["choices"]
    assert [c["index"] for c in choices] == list(range(6))              # prompt-major: index = p * n + i
    for c in choices:
        p, i = divmod(c["index"], 3)
        ref = offline_run(offline, body["prompt"][p], 8, temperature=1.0, seed=7 + i)
        assert c["text"] == ref.text
    assert len({c["text"] for c in choices[:3]}) > 1                   # different seeds, different samples
    # streamed: every index ends once, with the same texts
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        chunks = sse_events(list(s.iter_lines()))
    texts = {}
    for ch in chunks:
        for c in ch["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {c["index"]: c["text"] for c in choices}


def test_chat_content_parts_and_stream_shape(client):
    text = {"messages": [{"role": "user", "content": "Who made the heaven?"}], "max_tokens": 6, "temperature": 0}
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Who made"},
                                                        {"type": "text", "text": "the heaven?"}]}],
             "max_tokens": 6, "temperature": 0}
    joined = {"messages": [{"role": "user", "content": "Who made\nthe heaven?"}], "max_tokens": 6, "temperature": 0}
    a = client.post("/v1/chat/completions", json=parts).json()
    b = client.post("/v1/chat/completions", json=joined).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert a["object"] == "chat.completion" and a["choices"][0]["message"]["role"] == "assistant"
    with client.stream("POST", "/v1/chat/completions",
                       json={**text, "n": 2, "stream": True, "stream_options": {"include_usage": True}}) as s:
        chunks = sse_events(list(s.iter_lines()))
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    seen_role = set()
    for ch in chunks[:-1]:
        assert ch["object"] == "chat.completion.chunk" and "usage" not in ch
        for c in ch["choices"]:
            if "role" in c["delta"]:
                assert c["index"] not in seen_role            # the role only in each choice's first delta
                seen_role.add(c["index"])
            else:
                assert c["index"] in seen_role
    assert seen_role == {0, 1}
    content = "".join(c["delta"].get("content", "") for ch in chunks[:-1] for c in ch["choices"] if c["index"] == 0)
    assert content == client.post("/v1/chat/completions", json=text).json()["choices"][0]["message"]["content"]


def test_usage_reports_cached_prompt_tokens(client):
    """OpenAI's usage.prompt_tokens_details.cached_tokens: a repeated prompt is read from the prefix cache."""
    body = {"prompt": "The prefix cache keeps full pages of sixteen tokens. " * 6, "max_tokens": 2}
    first = client.post("/v1/completions", json=body).json()["usage"]
    again = client.post("/v1/completions", json=body).json()["usage"]
    assert again["prompt_tokens"] == first["prompt_tokens"] >= 32
    assert again["prompt_tokens_details"]["cached_tokens"] == (first["prompt_tokens"] - 1) // 16 * 16
    text = client.get("/metrics").text
    assert metric(text, "zipfusion:prefix_cache_hits_total") >= again["prompt_tokens_details"]["cached_tokens"]


def test_a_seeded_request_repeats_on_a_deterministic_server_cached_or_not():
    """Issue 48: three identical seeded chat requests at temperature 1 on a --deterministic
    server give the same text and logprobs, the first computing its prompt, the others reading
    it from the prefix cache; the seed's documentation (/openapi.json) says --deterministic is
    what makes a seed repeat."""
    eng = LLMEngine("demo", device="cpu", kv_memory_gb=0.02, max_model_len=256, deterministic=True,
                    max_num_batched_tokens=128)
    body = {"messages": [{"role": "user", "content": "And God said, Let there be light: and there was light. "
                                                     "Who made the heaven and the earth?"}],
            "max_tokens": 12, "seed": 7, "temperature": 1.0, "logprobs": True, "ignore_eos": True}
    with TestClient(create_app(eng)) as c:
        replies = [c.post("/v1/chat/completions", json=body).json() for _ in range(3)]
        seed_doc = c.get("/openapi.json").json()["components"]["schemas"]["ChatCompletionRequest"][
            "properties"]["seed"]["description"]
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies]
    assert cached[0] == 0 and cached[1] == cached[2] >= 16, cached
    first = replies[0]["choices"][0]
    for r in replies[1:]:
        assert r["choices"][0]["message"] == first["message"] and r["choices"][0]["logprobs"] == first["logprobs"]
    assert "--deterministic" in seed_doc and "prefix cache" in seed_doc


def test_completion_stream_usage_chunk(client):
    with client.stream("POST", "/v1/completions", json={"prompt": "In the beginning", "max_tokens": 4, "temperature": 0,
                                                         "ignore_eos": True, "stream": True,
                                                         "stream_options": {"include_usage": True}}) as s:
        chunks = sse_events(list(s.iter_lines()))
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def test_return_token_ids_streams_one_chunk_per_token(client, offline):
    """vLLM's return_token_ids: the body and every streamed chunk carry their ids, one chunk per token."""
    body = {"prompt": "In the beginning", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    ref = offline.generate(["In the beginning"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                           use_tqdm=False)[0]
    r = client.post("/v1/completions", json=body).json()
    assert r["choices"][0]["token_ids"] == list(ref.token_ids)
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        chunks = sse_events(list(s.iter_lines()))
    ids = [c["token_ids"] for ch in chunks for c in ch["choices"]]
    assert sum(ids, []) == list(ref.token_ids) and all(len(i) == 1 for i in ids)
    plain = client.post("/v1/completions", json={**body, "return_token_ids": False}).json()
    assert "token_ids" not in plain["choices"][0]


def test_logprobs_completions_and_chat(client, offline):
    r = client.post("/v1/completions", json={"prompt": "In the beginning", "max_tokens": 5, "temperature": 0,
                                              "ignore_eos": True, "logprobs": 2}).json()
    lp = r["choices"][0]["logprobs"]
    ref = offline.generate(["In the beginning"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                                logprobs=2), use_tqdm=False)[0]
    assert len(lp["tokens"]) == 5 and "".join(lp["tokens"]) == r["choices"][0]["text"]
    for i, (tok, entry) in enumerate(zip(ref.token_ids, ref.outputs[0].logprobs)):
        assert lp["token_logprobs"][i] == pytest.approx(entry[tok].logprob)
        assert len(lp["top_logprobs"][i]) == 2
        assert max(lp["top_logprobs"][i].values()) == pytest.approx(lp["token_logprobs"][i])   # greedy
    assert lp["text_offset"][0] == 0
    chat = {"messages": [{"role": "user", "content": "Who?"}], "max_tokens": 4, "temperature": 0, "logprobs": True,
            "top_logprobs": 3}
    resp = client.post("/v1/chat/completions", json=chat).json()
    c = resp["choices"][0]
    content = c["logprobs"]["content"]
    assert len(content) == resp["usage"]["completion_tokens"] >= 1
    assert all(len(e["top_logprobs"]) == 3 and e["logprob"] <= 0 for e in content)
    assert "".join(e["token"] for e in content) == c["message"]["content"]
    with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as s:
        chunks = sse_events(list(s.iter_lines()))
    streamed = [e for ch in chunks for ch_c in ch["choices"] if ch_c.get("logprobs")
                for e in ch_c["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]


def test_penalties_are_applied_not_ignored(client):
    base = {"prompt": "And God said", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    plain = client.post("/v1/completions", json=base).json()["choices"][0]["text"]
    for extra in ({"repetition_penalty": 2.0}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        r = client.post("/v1/completions", json={**base, **extra})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] != plain, extra
    words = plain.split()
    penalised = client.post("/v1/completions", json={**base, "presence_penalty": 2.0}).json()["choices"][0]["text"]
    assert len(set(penalised.split())) >= len(set(words))        # fewer repeats


def test_served_model_name_and_api_key(live_engine):
    app = create_app(live_engine, ["zf", "alias"], api_key="sekret")
    with TestClient(app) as c:
        r = c.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        auth = {"Authorization": "Bearer sekret"}
        assert [m["id"] for m in c.get("/v1/models", headers=auth).json()["data"]] == ["zf", "alias"]
        r = c.post("/v1/completions", headers=auth, json={"model": "alias", "prompt": "In", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "zf"
        assert c.get("/health").status_code == 200                # open, as in vLLM
        assert c.get("/metrics").status_code == 200


# -- metrics --------------------------------------------------------------------------------------------

def test_metrics_names_as_vllm(client):
    client.post("/v1/completions", json={"prompt": "In the beginning", "max_tokens": 20, "temperature": 0,
                                         "ignore_eos": True})
    text = client.get("/metrics").text
    for name in ("zipfusion:prompt_tokens_total", "zipfusion:generation_tokens_total",
                 "zipfusion:num_requests_running", "zipfusion:num_requests_waiting", "zipfusion:num_preemptions_total",
                 "zipfusion:time_to_first_token_seconds_count", "zipfusion:inter_token_latency_seconds_count",
                 "zipfusion:e2e_request_latency_seconds_count", "zipfusion:kv_pages_compressed",
                 "zipfusion:kv_arena_bytes", "zipfusion:kv_cache_usage_perc", "zipfusion:kv_recomputed_tokens",
                 "zipfusion:kv_host_tier_bytes"):
        assert name in text, name
    assert metric(text, "zipfusion:request_success_total", finished_reason="length") >= 1
    assert metric(text, "zipfusion:time_to_first_token_seconds_count") >= 1
    assert metric(text, "zipfusion:inter_token_latency_seconds_count") >= 19
    assert metric(text, "zipfusion:kv_arena_bytes") > 0
    assert "TYPE zipfusion:num_preemptions_total counter" in text
    for counter in ("kv_pages_compressed", "kv_recomputed_tokens", "kv_compactions"):    # only grow: _total
        assert f"TYPE zipfusion:{counter}_total counter" in text and f"zipfusion:{counter}_total{{" in text
    assert "HELP zipfusion:kv_stored_pages KV pages stored compressed" in text
    used, cached = metric(text, "zipfusion:kv_cache_usage_perc"), metric(text, "zipfusion:kv_cache_cached_perc")
    assert used == 0 and 0 < cached < 1           # idle: the finished request's pages are cached, not used


def test_metrics_with_vllm_names():
    from zipfusion.server.metrics import Metrics
    m = Metrics("m", "vllm")
    m.set_kv({"bytes_in_use": 100, "arena_bytes": 1000, "pages_in_use": 4, "prefix_cache_evictable_pages": 1,
              "pages_compressed": 3})
    text = m.render().decode()
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:kv_pages_compressed_total"):
        assert name in text, name
    assert metric(text, "vllm:kv_cache_usage_perc") == 0.075 and metric(text, "vllm:kv_cache_cached_perc") == 0.025
    assert "zipfusion:" not in text
    with pytest.raises(ValueError, match="prefix"):
        Metrics("m", "sglang")


# -- concurrency: uvicorn on 127.0.0.1 ------------------------------------------------------------------

@pytest.fixture(scope="module")
def live_engine():
    """The live server's own engine: one engine is driven by one server (the TestClient app
    above has its engine thread running on ``engine`` for the whole module)."""
    return LLMEngine("demo", device="cpu", kv_memory_gb=0.05, max_model_len=256)


@pytest.fixture(scope="module")
def live(live_engine):
    app = create_app(live_engine)
    with live_server(app) as url:
        yield url, app


def kv_pages_in_use(app, engine) -> int:
    """Pages held by requests (the prefix cache keeps finished requests' full pages)."""
    s = app.state.engine_loop().call(engine.kv_stats).result(timeout=T)
    return s["pages_in_use"] - s["prefix_cache_evictable_pages"]


@pytest.mark.parametrize("streaming", [False, True])
def test_client_disconnect_aborts_and_frees_pages(live, live_engine, streaming, caplog):
    caplog.set_level("INFO", logger="zipfusion.server")
    url, app = live
    metrics = lambda: httpx.get(url + "/metrics", timeout=T).text   # noqa: E731
    aborted = metric(metrics(), "zipfusion:request_success_total", finished_reason="abort")
    body = {"prompt": "In the beginning", "max_tokens": 240, "temperature": 0, "ignore_eos": True,
            "stream": streaming}
    if streaming:
        with httpx.Client(timeout=T) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]            # some tokens came: the request is running
            assert any(line.startswith("data: {") for line in got)
            assert metric(metrics(), "zipfusion:num_requests_running") == 1
            assert metric(metrics(), "zipfusion:generation_tokens_total") > 0     # moves before the request ends
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=body, timeout=0.5)          # the client gives up
    wait_until(lambda: not live_engine.scheduler.has_work(), what="the abort")
    text = metrics()
    assert metric(text, "zipfusion:num_requests_running") == 0
    assert metric(text, "zipfusion:request_success_total", finished_reason="abort") == aborted + 1
    assert kv_pages_in_use(app, live_engine) == 0
    assert any("aborted (client disconnected)" in r.getMessage() for r in caplog.records)


def test_a_huge_prompt_is_refused_before_it_is_tokenized(live, live_engine, monkeypatch):
    """2.75 MB of text cannot be under max_model_len tokens: refused at once, never tokenized,
    and /health answers meanwhile."""
    url, _ = live
    calls = []
    monkeypatch.setattr(live_engine.tokenizer, "encode_many", lambda texts: calls.append(texts) or [[1]] * len(texts))
    huge = "In the beginning God created the heaven and the earth. " * 50000      # 2.75 MB
    result = {}

    def post():
        t0 = time.perf_counter()
        result["r"] = httpx.post(url + "/v1/completions", json={"prompt": huge, "max_tokens": 1}, timeout=T)
        result["s"] = time.perf_counter() - t0

    t = threading.Thread(target=post)
    t.start()
    latencies = []
    while t.is_alive() and len(latencies) < 20:
        t0 = time.perf_counter()
        assert httpx.get(url + "/health", timeout=T).status_code == 200
        latencies.append(time.perf_counter() - t0)
    t.join(T)
    r = result["r"]
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "prompt" and not calls
    assert result["s"] < 2.0 and max(latencies, default=0) < 0.5, (result, latencies)


def test_a_request_that_can_never_fit_is_a_400_and_small_ones_all_succeed():
    """A tiny KV memory: the engine lowers max_model_len to what fits; every request within it
    succeeds, alone or together (preempting if it must), and one beyond it is a 400 up front."""
    eng = LLMEngine("demo", device="cpu", kv_memory_gb=0.0002)         # 6 pages: 96 tokens
    limit = eng.max_model_len
    assert limit < 1024                                   # lowered from the model's 1024 positions
    with TestClient(create_app(eng)) as c:
        ids = list(range(5, 15))
        r = c.post("/v1/completions", json={"prompt": ids, "max_tokens": limit - len(ids) + 1})
        assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": ids})              # no max_tokens: what is left, capped
        assert r.status_code == 200, r.text
        body = {"prompt": ids, "max_tokens": limit - len(ids), "ignore_eos": True, "temperature": 0}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == limit - len(ids)
        r = c.post("/v1/completions", json={**body, "prompt": [ids] * 3})   # together: they take turns
        assert r.status_code == 200, r.text
        assert [ch["finish_reason"] for ch in r.json()["choices"]] == ["length"] * 3


def test_bench_serve_client_runs_against_a_live_server(live):
    """zipfusion bench serve's client half (zipfusion.bench.client), 4 requests against the live server."""
    import asyncio
    import math

    from zipfusion.bench import client, datasets, serve_results
    url, _ = live
    ds = datasets.build(datasets.resolve("random", 8, 6), "random", 4, seed=0)
    recs, duration, _ = asyncio.run(client.run_rate(url, ds, 50.0, model=None, timeout=T, metrics_interval=0.2))
    r = serve_results.rate_row(recs, duration, 50.0, {})
    assert r["completed"] == 4 and r["failed"] == r["lost"] == 0 and r["output_tokens"] == 24
    # one chunk per token (return_token_ids), unless the server sends two at once
    assert r["ttft_ms"]["n"] == 4 and 4 * 2 <= r["itl_ms"]["n"] <= 4 * 5 and r["ttft_ms"]["p50"] > 0
    # groups of 3 behind a shared 40-token prefix, one at a time: the ones after the first find it cached
    ds = datasets.build(datasets.resolve("random", 8, 2, shared_prefix=40, group=3), "random", 6, seed=1)
    recs, duration, _ = asyncio.run(client.run_rate(url, ds, math.inf, model=None, timeout=T, max_concurrency=1))
    r = serve_results.rate_row(recs, duration, math.inf, {})
    assert r["completed"] == 6 and r["input_tokens"] == 6 * 48 and r["cached_tokens"] >= 4 * 32


# -- issue 24: limits, strict values, unknown fields, the OpenAPI document --------------------------------

HOSTILE = [      # (raw body, status, words in the message, param)
    (b'{"prompt": "\\ud800abc", "max_tokens": 2}', 400, "surrogate", "prompt"),
    (b'{"messages": [{"role": "user", "content": "a\\udfff"}]}', 400, "surrogate", "messages"),
    (b'{"prompt": "x", "temperature": NaN}', 400, "finite", "temperature"),
    (b'{"prompt": "x", "temperature": Infinity}', 400, "finite", "temperature"),
    (b'{"prompt": "x", "top_p": -Infinity}', 400, "finite", "top_p"),
    (b'{"prompt": "x", "stream": "yes"}', 400, "boolean", "stream"),
    (b'{"prompt": "x", "max_tokens": "5"}', 400, "integer", "max_tokens"),
    (b'{"prompt": "x", "max_tokens": 5.0}', 400, "integer", "max_tokens"),
    (b'{"prompt": "x", "temperature": "0.5"}', 400, "number", "temperature"),
    (b'{"prompt": "x", "seed": 18446744073709551616}', 400, "seed", "seed"),
    (b'{"prompt": "x", "seed": 9223372036854775807, "n": 2}', 400, "seed", "seed"),
    (b'{"prompt": "x", "min_tokens": 9, "max_tokens": 2}', 400, "min_tokens", "min_tokens"),
    (b'{"prompt": "x", "top_p": 0}', 400, "top_p", "top_p"),
    (b'{"prompt": "x", "top_k": -2}', 400, "top_k", "top_k"),
    (b'{"prompt": "x", "repetition_penalty": 0}', 400, "repetition_penalty", "repetition_penalty"),
    (b'{"prompt": "x", "logit_bias": {"5": 101}}', 400, "logit_bias", "logit_bias.5"),
    (b'{"prompt": [-1]}', 400, "prompt: token ids must be >= 0 (prompt[0] is -1)", "prompt"),
    (b'{"prompt": [[5, 6], [7, -2]]}', 400, "prompt: token ids must be >= 0 (prompt[1][1] is -2)", "prompt"),
    (b'{"prompt": [1, "a"]}', 400, "prompt: expected a string, a list of strings, a list of token ids", "prompt"),
    (b'{"prompt": "x", "stop": 5}', 400, "stop: expected a string, a list of strings, or null", "stop"),
    (b'{"prompt": "x", "tem', 400, "not valid JSON", None),
    (b'{"prompt": "\xff\xfe"}', 400, "UTF-8", None),
    (b'[1, 2]', 400, "JSON object", None),
    (b'{"prompt": [[1, 2, 3], [1, 2, 3]], "n": 64, "max_tokens": 1}', 400, "2 prompt(s) x n=64 = 128 sequences",
     "prompt"),
    (b'{"prompt": "x", "n": 65}', 400, "--max-sequences-per-request", "n"),
    (b'{"prompt": "x", "stop": ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o", "p", "q"]}',
     400, "17 stop strings", "stop"),
    (b'{"prompt": "x", "stop": "' + b"s" * 257 + b'"}', 400, "257 characters", "stop"),
    (b'{"prompt": "x", "functions": [{"name": "f"}]}', 400, "function calling", "functions"),
    (b'{"prompt": "' + b"word " * 30000 + b'"}', 400, "max_model_len", "prompt"),
]


def test_hostile_values_get_a_400_in_openai_shape_and_the_server_goes_on(live, live_engine):
    """Each value of issue 24 on one keep-alive connection: a 4xx with a one-line message
    naming the field, the connection still usable, a running stream undisturbed."""
    url, _ = live
    body = {"prompt": "In the beginning", "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=T) as c, httpx.Client(timeout=T) as s, \
            s.stream("POST", url + "/v1/completions", json=body) as running:
        lines = running.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))        # the stream runs
        for raw, status, words, param in HOSTILE:
            r = c.post(url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == status, (raw[:80], r.text)
            err = r.json()["error"]
            assert words in err["message"] and "\n" not in err["message"], (raw[:80], err)
            assert err["param"] == param and err["code"] is None and err["type"] == "invalid_request_error", err
        r = c.post(url + "/v1/completions", json={"prompt": "In", "max_tokens": 2})     # same connection
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
    chunks = sum(1 for line in rest if line.startswith("data: {"))
    assert chunks >= 30                               # the stream got its tokens (one chunk each, give or take)
    wait_until(lambda: not live_engine.scheduler.has_work(), what="the stream's end")


def test_unknown_fields_are_ignored_with_a_warning(client, caplog):
    caplog.set_level("WARNING", logger="zipfusion.server")
    base = {"prompt": "In the beginning", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    ref = client.post("/v1/completions", json=base).json()["choices"][0]["text"]
    known = {"store": True, "reasoning_effort": "low", "user": "u1", "metadata": {"k": "v"}, "service_tier": "auto"}
    r = client.post("/v1/completions", json={**base, **known})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref
    assert not [rec for rec in caplog.records if "ignored" in rec.getMessage()]
    r = client.post("/v1/completions", json={**base, "foo": 1, "prediction": {"type": "content"}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref
    warned = [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()]
    assert len(warned) == 1 and "'foo'" in warned[0] and "'prediction'" in warned[0]
    chat = {"messages": [{"role": "user", "content": "Who?"}], "max_tokens": 2, **known, "parallel_tool_calls": True}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200


def test_body_limit_is_a_413_before_the_body_is_read():
    from zipfusion.server.limits import ServerLimits
    limits = ServerLimits(max_request_bytes=2000, max_sequences=3, max_stop=1)
    app = create_app(LLMEngine("demo", device="cpu", kv_memory_gb=0.01), limits=limits)
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"prompt": "x" * 3000})
        assert r.status_code == 413 and r.json()["error"]["code"] is None and "--max-request-bytes" in r.text

        def chunked():                                  # no Content-Length: counted as it comes
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"y" * 500
            yield b'"}'
        r = c.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        r = c.post("/v1/completions", json={"prompt": [[1, 2]] * 2, "n": 2, "max_tokens": 1})
        assert r.status_code == 400 and "at most 3" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": "x", "stop": ["a", "b"], "max_tokens": 1})
        assert r.status_code == 400 and "at most 1" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": "In", "max_tokens": 2, "n": 3})
        assert r.status_code == 200
        assert metric(c.get("/metrics").text, "zipfusion:requests_rejected_total") == 4


def test_openapi_says_what_the_server_does(client):
    doc = client.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = doc["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "400", "404", "413", "500"}, responses     # no 422; 401 only with a key
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        assert "error" in responses["400"]["content"]["application/json"]["schema"]["properties"]
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert client.get("/metrics").headers["content-type"].startswith("text/plain")
    props = schemas["CompletionRequest"]["properties"]
    assert props["max_tokens"]["anyOf"][0]["maximum"] == 255                     # max_model_len - 1
    assert props["n"]["maximum"] == 64                                           # max_num_seqs 256 // 4
    with_key = TestClient(create_app(LLMEngine("demo", device="cpu", kv_memory_gb=0.01), api_key="k"))
    doc = with_key.get("/openapi.json").json()
    assert "401" in doc["paths"]["/v1/completions"]["post"]["responses"]
    assert doc["paths"]["/v1/models"]["get"]["security"] == [{"bearer": []}]


def test_served_name_defaults_to_the_file_stem_not_its_path():
    from types import SimpleNamespace

    from zipfusion.server.openai import default_model_name
    assert default_model_name(SimpleNamespace(name="/abs/models/SmolLM2-135M.Q4_1.gguf")) == "SmolLM2-135M.Q4_1"
    assert default_model_name(SimpleNamespace(name="/abs/ckpt/Llama-3.1-8B/")) == "Llama-3.1-8B"
    assert default_model_name(SimpleNamespace(name="demo")) == "demo"
    assert default_model_name(SimpleNamespace(name="llama-3.1-8b-random")) == "llama-3.1-8b-random"
