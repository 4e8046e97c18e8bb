"""OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Same request and response shapes as vLLM (non-OpenAI options such as ``top_k`` and
``ignore_eos`` arrive as extra body fields; see :mod:`.protocol` for what is accepted).
``"stream": true`` sends ``data: {json}`` events and ends with ``data: [DONE]``. Every error,
404 and 405 included, comes back as ``{"error": {"message", "type", "param", "code"}}``; a
refused request never disturbs the requests already running.

- A request that can never fit (prompt + max_tokens beyond max_model_len) is refused with a
  400 before it enters the batch; the engine checked at start-up that one max_model_len request
  fits in the KV memory, so an accepted request does not fail for lack of memory.
- A client that disconnects, streaming or not, has its requests aborted and their pages freed
  at the next step boundary.
- Tokenization, chat templates and the final detokenization run on a tokenizer thread, never
  on the event loop; streamed text is detokenized incrementally (a window of a few tokens).
- ``api_key``: every /v1 route needs ``Authorization: Bearer KEY`` (401 otherwise); /health
  and /metrics stay open, as in vLLM.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from ..engine import LLMEngine
from .auth import APIKeyMiddleware
from .engine_loop import EngineLoop, Group
from .errors import error_body, error_response, install_error_handlers
from .metrics import Metrics
from .protocol import BadRequest, ChatCompletionRequest, CompletionRequest, _Body



class TextDelta:
    """Incremental detokenization of one output: each call decodes a window of a few tokens
    (vLLM's prefix/read offsets), and never sends text a stop string could still remove."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.text = ""                     # text decoded so far
        self.sent = 0                      # characters of it already sent
        self.hold = max((len(s) for s in stop), default=1) - 1

    def add(self, ids: list[int]) -> str:
        self.ids += ids
        if self.tokenizer is None or not ids:
            return ""
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        window = self.tokenizer.decode(self.ids[self.prefix:])
        if len(window) > len(before) and not window.endswith("\ufffd"):   # else: an incomplete UTF-8 sequence
            self.text += window[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
        upto = len(self.text) - self.hold
        if upto <= self.sent:
            return ""
        delta = self.text[self.sent:upto]
        self.sent = upto
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of ``final_text`` (the engine's text, stop string cut) after what was sent."""
        delta = final_text[self.sent:] if final_text.startswith(self.text[:self.sent]) else ""
        self.sent = len(final_text)
        return delta


async def _wait_for_disconnect(http: Request) -> None:
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(engine: LLMEngine, model_name: str | list[str] | None = None, default_max_tokens: int = 256,
               api_key: str | None = None) -> FastAPI:
    names = [model_name] if isinstance(model_name, str) else list(model_name or []) or [engine.source.name]
    name = names[0]
    metrics = Metrics(name)
    holder: dict[str, EngineLoop] = {}
    tokenizer_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zipfusion-tokenizer")

    def engine_loop() -> EngineLoop:
        if "loop" not in holder:
            holder["loop"] = EngineLoop(engine, metrics)
        return holder["loop"]

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        engine_loop()
        yield
        holder.pop("loop").shutdown()
        tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="zipfusion", description="OpenAI-compatible server with a losslessly compressed KV cache",
                  lifespan=lifespan)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.state.engine_loop = engine_loop
    app.state.metrics = metrics
    app.state.model_names = names

    async def off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(tokenizer_pool, fn, *args)

    install_error_handlers(app, metrics)

    # -- plain routes --------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "zipfusion",
                                            "root": engine.source.name, "max_model_len": engine.max_model_len}
                                           for n in names]}

    @app.get("/metrics")
    async def prometheus():
        try:
            stats = await asyncio.wait_for(asyncio.wrap_future(engine_loop().call(engine.cache.stats)), 10)
            metrics.set_kv(stats)
        except (asyncio.TimeoutError, RuntimeError):
            pass                           # a busy or stopped engine: the other numbers still come
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    # -- helpers -------------------------------------------------------------------------------
    def check_model(body: _Body) -> None:
        if body.model is not None and body.model not in names:
            raise BadRequest(f"model {body.model!r} is not served here; this server serves {name!r} "
                             "(see /v1/models)", 404, "model")

    def encode_many(texts: list[str]) -> list[list[int]]:
        return [engine.tokenizer.encode(t) for t in texts]

    async def tokenize(texts: list[str]) -> list[list[int]]:
        if engine.tokenizer is None:
            raise BadRequest("this model has no tokenizer: send the prompt as a list of token ids", param="prompt")
        return await off_loop(encode_many, texts)

    async def submit(body: _Body, prompts: list[list[int]], rid: str) -> Group:
        items = body.engine_requests(prompts, default_max_tokens, engine.max_model_len)
        try:
            return await engine_loop().submit(items, rid)
        except (ValueError, TypeError) as exc:
            raise BadRequest(str(exc)) from None

    @contextlib.asynccontextmanager
    async def abort_on_disconnect(http: Request, group: Group):
        """While inside: a client that leaves gets its requests aborted at once. On the way out
        (also on an error or a cancellation) whatever is unfinished is aborted."""
        async def watch():
            await _wait_for_disconnect(http)
            if not group.done:
                engine_loop().abort(group, "client disconnected")
                group.close()

        task = asyncio.ensure_future(watch())
        try:
            yield
        finally:
            task.cancel()
            if not group.done:
                engine_loop().abort(group, "request ended early")

    def token_text(tid: int) -> str:
        return engine.tokenizer.decode([tid]) if engine.tokenizer is not None else f"token_id:{tid}"

    def top_entries(entry: dict, k: int) -> list[tuple[int, float]]:
        return [(t, lp.logprob) for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank)[:k]]

    def completion_logprobs(ids: list[int], entries: list[dict], k: int, offset: int) -> dict:
        tokens, lps, tops, offsets = [], [], [], []
        for tid, entry in zip(ids, entries):
            text = token_text(tid)
            tokens.append(text)
            lps.append(entry[tid].logprob)
            tops.append({token_text(t): lp for t, lp in top_entries(entry, k)} if k else None)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(ids: list[int], entries: list[dict], k: int) -> dict:
        def one(tid, lp):
            text = token_text(tid)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
        return {"content": [{**one(tid, entry[tid].logprob),
                             "top_logprobs": [one(t, lp) for t, lp in top_entries(entry, k)]}
                            for tid, entry in zip(ids, entries)]}

    def usage(prompts: list[list[int]], group: Group) -> dict:
        p = sum(len(ids) for ids in prompts)
        c = sum(len(r.output_ids) for r in group.requests if r is not None)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def final_text(req) -> str:
        return engine.output_of(req, None).outputs[0].text

    # -- the two generation routes ----------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        check_model(body)
        body.check()
        p = body.prompt
        if isinstance(p, str):
            texts, prompts = [p], await tokenize([p])
        elif all(isinstance(x, str) for x in p):
            texts, prompts = list(p), await tokenize(list(p))
        elif all(isinstance(x, int) for x in p):
            texts, prompts = [None], [list(p)]
        else:
            texts, prompts = [None] * len(p), [list(x) for x in p]
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        group = await submit(body, prompts, rid)
        n, k = body.n, body.logprobs

        async def echo_text(i: int) -> str:
            if not body.echo:
                return ""
            if texts[i // n] is not None:
                return texts[i // n]
            return await off_loop(engine.tokenizer.decode, prompts[i // n]) if engine.tokenizer else ""

        def choice(i, text, reason=None, stop_reason=None, lp=None) -> dict:
            return {"index": i, "text": text, "logprobs": lp, "finish_reason": reason, "stop_reason": stop_reason}

        def envelope(choices: list, **extra) -> dict:
            return {"id": rid, "object": "text_completion", "created": created, "model": name, "choices": choices,
                    **extra}

        if not body.stream:
            async with abort_on_disconnect(http, group):
                err = await collect(group)
            if err:
                return error_response(err, 500)
            if group.closed:
                return Response(status_code=499)            # the client is gone: nobody reads this
            choices = []
            for i, r in enumerate(group.requests):
                prefix = await echo_text(i)
                lp = (completion_logprobs(r.output_ids, r.logprobs, k, len(prefix)) if k is not None else None)
                choices.append(choice(i, prefix + await off_loop(final_text, r), r.finish_reason, r.stop_reason, lp))
            return JSONResponse(envelope(choices, usage=usage(prompts, group)))

        deltas = [TextDelta(engine.tokenizer, r.params.stop) for r in group.requests]
        offsets = [0] * len(deltas)

        async def events():
            async with abort_on_disconnect(http, group):
                for i in range(len(deltas)):
                    prefix = await echo_text(i)
                    if prefix:
                        offsets[i] = len(prefix)
                        yield sse(envelope([choice(i, prefix)]))
                async for u in group:
                    if u.error:
                        yield sse(error_body(u.error, 500))
                        break
                    d = deltas[u.index]
                    if u.finished:                # the engine's final text: a stop string already cut
                        text = d.finish(await off_loop(final_text, group.requests[u.index]))
                    else:
                        text = d.add(u.new_ids)
                    lp = None
                    if k is not None and u.new_ids:
                        lp = completion_logprobs(u.new_ids, u.logprobs, k, offsets[u.index])
                    offsets[u.index] += len(text)
                    if text or u.finished or lp:
                        yield sse(envelope([choice(u.index, text, u.finish_reason if u.finished else None,
                                                   u.stop_reason if u.finished else None, lp)]))
                else:
                    if body.stream_options and body.stream_options.include_usage:
                        yield sse(envelope([], usage=usage(prompts, group)))
                yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: Request):
        check_model(body)
        body.check()
        if engine.tokenizer is None:
            raise BadRequest("this model has no tokenizer, so it cannot serve chat; use /v1/completions with token ids")
        conversation = body.conversation()

        def render() -> list[int]:
            return engine.tokenizer.encode(engine.tokenizer.apply_chat_template(conversation))

        try:
            prompt_ids = await off_loop(render)
        except ValueError as exc:
            raise BadRequest(f"{exc}; use /v1/completions instead") from None
        prompts = [prompt_ids]
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        group = await submit(body, prompts, rid)
        k = (body.top_logprobs or 0) if body.logprobs else None

        if not body.stream:
            async with abort_on_disconnect(http, group):
                err = await collect(group)
            if err:
                return error_response(err, 500)
            if group.closed:
                return Response(status_code=499)
            choices = []
            for i, r in enumerate(group.requests):
                lp = chat_logprobs(r.output_ids, r.logprobs, k) if k is not None else None
                choices.append({"index": i, "message": {"role": "assistant", "content": await off_loop(final_text, r)},
                                "logprobs": lp, "finish_reason": r.finish_reason, "stop_reason": r.stop_reason})
            return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": name,
                                 "choices": choices, "usage": usage(prompts, group)})

        deltas = [TextDelta(engine.tokenizer, r.params.stop) for r in group.requests]

        def chunk(choices: list, **extra) -> dict:
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                    "choices": choices, **extra}

        async def events():
            async with abort_on_disconnect(http, group):
                for i in range(len(deltas)):       # the role, once per choice, in its first delta only
                    yield sse(chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                      "finish_reason": None}]))
                async for u in group:
                    if u.error:
                        yield sse(error_body(u.error, 500))
                        break
                    d = deltas[u.index]
                    if u.finished:                # the engine's final text: a stop string already cut
                        text = d.finish(await off_loop(final_text, group.requests[u.index]))
                    else:
                        text = d.add(u.new_ids)
                    lp = chat_logprobs(u.new_ids, u.logprobs, k) if k is not None and u.new_ids else None
                    if text or u.finished or lp:
                        c = {"index": u.index, "delta": {"content": text} if text else {}, "logprobs": lp,
                             "finish_reason": u.finish_reason if u.finished else None}
                        if u.finished:
                            c["stop_reason"] = u.stop_reason
                        yield sse(chunk([c]))
                else:
                    if body.stream_options and body.stream_options.include_usage:
                        yield sse(chunk([], usage=usage(prompts, group)))
                yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def collect(group: Group) -> str | None:
        """Wait for every request of the group; the engine's error, if a step failed."""
        async for u in group:
            if u.error:
                return u.error
        return None

    return app


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
