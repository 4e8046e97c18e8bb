"""Large bodies parsed in the body worker process: the same request or the same error as the
in-process parse, replies unpickled in pieces of bounded size, a worker that dies fails only the
body it was parsing, and no worker outlives the server."""

import io
import json
import os
import pickle
import signal
import sys

import pytest

pytest.importorskip("fastapi", reason="server tests need fastapi (pip install -e '.[server]')")
import httpx  # noqa: E402
from fastapi.exceptions import RequestValidationError  # noqa: E402
from test_server import HOSTILE, live_server  # noqa: E402

from zipfusion.server import body_worker  # noqa: E402
from zipfusion.server.body_worker import PIECE, WORKER, BodyWorker, dumps, loads  # noqa: E402
from zipfusion.server.errors import validation_error  # noqa: E402
from zipfusion.server.protocol import (LARGE_BODY, BadRequest, BodyErrors, ChatCompletionRequest, CompletionRequest,  # noqa: E402
                                       DetokenizeRequest, TokenizeRequest, load_body)

T = 60


def nested(depth: int, fan: int):
    return [nested(depth - 1, fan) for _ in range(fan)] if depth else list(range(fan))


def large_bodies() -> list[tuple[type, bytes]]:
    ids = [[(i * 31 + j) % 2048 for j in range(1000)] for i in range(300)]
    big = {"prompt": ids, "max_tokens": 7, "temperature": 0.25, "top_p": 1e-300, "seed": -2**63,
           "logit_bias": {str(i): (i % 201) - 100.0 for i in range(50_000)}, "stop": ["a", "é"], "n": 1,
           "extra_field": {"x": [1.5, None, True, "s"] * 2000}}
    chat = {"messages": [{"role": "user" if i % 2 else "assistant", "content": f"m{i} ünï"} for i in range(20_000)],
            "guided_json": {"type": "object", "deep": nested(5, 8)}}
    out = [(CompletionRequest, json.dumps(big).encode()),
           (CompletionRequest, json.dumps(big).encode("utf-16-le")),
           (CompletionRequest, json.dumps({"prompt": list(range(300_000))}).encode()),
           (CompletionRequest, json.dumps({**big, "stop": ["ok", "\ud800"]}).encode()),           # lone surrogate
           (CompletionRequest, json.dumps({**big, "prompt": ids + [[1, -5]]}).encode()),          # a bad id, last
           (CompletionRequest, json.dumps({**big, "logit_bias": {str(i): 101.0 for i in range(30_000)}}).encode()),
           (CompletionRequest, json.dumps(big).encode()[:-3]),                                    # cut short
           (ChatCompletionRequest, json.dumps(chat).encode()),
           (ChatCompletionRequest, json.dumps({**chat, "messages": chat["messages"] + [{"role": "x"}]}).encode()),
           (TokenizeRequest, json.dumps({"prompt": "In the beginning " * 100_000}).encode()),
           (DetokenizeRequest, json.dumps({"tokens": list(range(200_000))}).encode()),
           (CompletionRequest, b"[" * 100_000 + b"]" * 100_000)]                                  # too deep
    return out + [(CompletionRequest, raw) for raw, *_ in HOSTILE] + [
        (ChatCompletionRequest, raw.replace(b'"prompt": "x"', b'"messages": [{"role": "user", "content": "x"}]'))
        for raw, *_ in HOSTILE]


def outcome(fn, model, raw):
    """What a parse gives, comparable across processes: the request, or the error as a client sees it."""
    try:
        return "ok", fn(model, raw)
    except BodyErrors as exc:
        return "400", validation_error(RequestValidationError(exc.errors)).body
    except BadRequest as exc:
        return "bad", (str(exc), exc.status, exc.param, exc.code)
    except Exception as exc:  # noqa: BLE001 (an unexpected one: the same type and message)
        return type(exc).__name__, str(exc)


@pytest.fixture(scope="module")
def worker():
    w = BodyWorker()
    yield w
    w.close()


def test_the_worker_gives_what_the_in_process_parse_gives(worker):
    kinds = set()
    for model, raw in large_bodies():
        local, remote = outcome(load_body, model, raw), outcome(worker.parse, model, raw)
        assert local[0] == remote[0], (raw[:80], local, remote)
        if local[0] == "ok":
            assert type(remote[1]) is model and remote[1] == local[1]
            assert remote[1].model_dump() == local[1].model_dump() and remote[1].model_extra == local[1].model_extra
        else:
            assert remote == local
        kinds.add(local[0])
    assert kinds == {"ok", "400", "bad", "RecursionError"}


def test_each_piece_of_a_reply_builds_at_most_piece_objects():
    class Outline(pickle.Unpickler):   # a piece alone, its packed parts left as None
        def persistent_load(self, pid):
            pieces.extend(pid[1])

    def count(x) -> int:
        if isinstance(x, BaseException):
            return 1 + count(x.args)
        if isinstance(x, dict):
            return 1 + sum(1 + count(v) for v in x.values())
        if isinstance(x, (list, tuple)):
            return 1 + sum(count(v) for v in x)
        return 1
    value = {"rows": [[i] * 700 for i in range(40)], "flat": list(range(20_000)), "deep": nested(5, 8),
             "bias": {str(i): 0.5 for i in range(9000)}, "mixed": [{"a": list(range(i))} for i in range(300)]}
    error = BodyErrors([{"type": "x", "loc": ("body", "logit_bias", str(i)), "msg": "m"} for i in range(3000)])
    pieces, sizes = [dumps((value, error))], []
    while pieces:
        sizes.append(count(Outline(io.BytesIO(pieces.pop())).load()))
    back, error_back = loads(dumps((value, error)))
    assert back == value and type(error_back) is BodyErrors and error_back.errors == error.errors
    assert len(sizes) > 20 and max(sizes) <= PIECE + 2, max(sizes)   # + the piece's own list and a tuple


def kill(pid: int) -> None:
    """SIGKILL ``pid`` (a child of this process) and wait until it has exited, leaving it unreaped."""
    os.kill(pid, signal.SIGKILL)
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)


def test_a_dead_worker_is_started_again_and_fails_only_the_body_it_was_parsing():
    raw = json.dumps({"prompt": list(range(1000))}).encode()
    w = BodyWorker()
    try:
        first = w.parse(CompletionRequest, raw)
        pid = w.pid
        kill(pid)                                         # dies between bodies: nothing is lost
        assert w.parse(CompletionRequest, raw) == first and w.pid != pid
        w.command = [sys.executable, "-c", "import sys; sys.stdin.buffer.read(8); sys.exit(3)"]
        kill(w.pid)
        with pytest.raises(BadRequest, match=r"exited \(code 3\) while parsing this one") as exc:
            w.parse(CompletionRequest, raw)                   # dies during one: that one fails
        assert exc.value.status == 500
        w.command = WORKER
        assert w.parse(CompletionRequest, raw) == first
    finally:
        w.close()
    assert w.pid is None


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_the_server_parses_large_bodies_in_its_worker_and_ends_it(monkeypatch):
    from zipfusion.engine import LLMEngine
    from zipfusion.server.limits import ServerLimits
    from zipfusion.server.openai import create_app
    seen = []
    real = body_worker.loads
    monkeypatch.setattr(body_worker, "loads", lambda data: seen.append(len(data)) or real(data))
    engine = LLMEngine("demo", device="cpu", kv_memory_gb=0.01, max_model_len=128)
    app = create_app(engine, limits=ServerLimits(max_sequences=2000))        # room for 200k token ids
    tokens = [5 + i % 1500 for i in range(200_000)]

    def post(ids):
        raw = json.dumps({"tokens": ids}).encode()
        assert (len(raw) >= LARGE_BODY) == (len(ids) > 10)
        return httpx.post(url + "/detokenize", content=raw, headers={"content-type": "application/json"}, timeout=T)
    with live_server(app) as url:
        r = post(tokens)
        assert r.status_code == 200 and len(seen) == 1
        pid = app.state.bodies.pid
        kill(pid)
        r2, bad = post(tokens), post(tokens + [-1])
        assert r2.json() == r.json() and len(seen) == 3 and app.state.bodies.pid != pid
        assert bad.status_code == 400 and "tokens." in bad.json()["error"]["message"]
        small = post(tokens[:10])
        assert small.status_code == 200 and len(seen) == 3          # a small body stays in the server
        pid = app.state.bodies.pid
        assert not gone(pid)
    assert gone(pid) and app.state.bodies.pid is None
