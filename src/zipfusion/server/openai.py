"""OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Same request and response shapes as vLLM (non-OpenAI options such as ``top_k`` and
``ignore_eos`` arrive as extra body fields; see :mod:`.protocol` for what is accepted).
``"stream": true`` sends ``data: {json}`` events and ends with ``data: [DONE]`` (:mod:`.streaming`).
Every error, 404 and 405 included, comes back as ``{"error": {"message", "type", "param", "code"}}``
(:mod:`.errors`); a refused request never disturbs the requests already running.

- A request that can never fit (prompt + max_tokens beyond max_model_len) is refused with a
  400 before it enters the batch; the engine checked at start-up that one max_model_len request
  fits in the KV memory, so an accepted request does not fail for lack of memory.
- A client that disconnects, streaming or not, has its requests aborted and their pages freed
  at the next step boundary.
- Tokenization, chat templates and the final detokenization run on a tokenizer thread, never
  on the event loop; streamed text is detokenized incrementally (a window of a few tokens).
- ``api_key``: every /v1 route needs ``Authorization: Bearer KEY`` (401 otherwise); /health
  and /metrics stay open, as in vLLM (:mod:`.auth`).

:class:`OpenAIServer` holds the state of one app and has one method per route;
:func:`create_app` registers them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from ..engine import LLMEngine
from .auth import APIKeyMiddleware
from .engine_loop import EngineLoop, Group
from .errors import error_response, install_error_handlers
from .metrics import Metrics
from .protocol import BadRequest, ChatCompletionRequest, CompletionRequest, _Body
from .responses import ChatReply, CompletionReply, Reply
from .streaming import abort_on_disconnect, collect, event_stream


class OpenAIServer:
    """The engine, its loop (started on first use), the metrics, the served model names and the
    tokenizer thread of one app. The route methods carry no return annotation: FastAPI would
    take it for a response model."""

    def __init__(self, engine: LLMEngine, names: list[str], default_max_tokens: int):
        self.engine, self.names, self.name = engine, names, names[0]
        self.default_max_tokens = default_max_tokens
        self.metrics = Metrics(self.name)
        self.tokenizer_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zipfusion-tokenizer")
        self._loop: EngineLoop | None = None

    def engine_loop(self) -> EngineLoop:
        if self._loop is None:
            self._loop = EngineLoop(self.engine, self.metrics)
        return self._loop

    @contextlib.asynccontextmanager
    async def lifespan(self, _app):
        self.engine_loop()
        yield
        self._loop.shutdown()
        self._loop = None
        self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, fn, *args)

    # -- routes ---------------------------------------------------------------------------------
    async def health(self):
        return {"status": "ok"}

    async def models(self):
        return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "zipfusion",
                                            "root": self.engine.source.name,
                                            "max_model_len": self.engine.max_model_len}
                                           for n in self.names]}

    async def prometheus(self):
        try:
            stats = await asyncio.wait_for(asyncio.wrap_future(self.engine_loop().call(self.engine.cache.stats)), 10)
            self.metrics.set_kv(stats)
        except (asyncio.TimeoutError, RuntimeError):
            pass                           # a busy or stopped engine: the other numbers still come
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def completions(self, body: CompletionRequest, http: Request):
        self.check_model(body)
        body.check()
        texts, prompts = await self.completion_prompts(body.prompt)
        reply = CompletionReply(self.engine, self.name, self.off_loop, body, prompts, texts)
        return await self.generate(http, body, prompts, reply)

    async def chat(self, body: ChatCompletionRequest, http: Request):
        self.check_model(body)
        body.check()
        if self.engine.tokenizer is None:
            raise BadRequest("this model has no tokenizer, so it cannot serve chat; use /v1/completions with token ids")
        try:
            prompt_ids = await self.off_loop(self.render_chat, body.conversation())
        except ValueError as exc:
            raise BadRequest(f"{exc}; use /v1/completions instead") from None
        reply = ChatReply(self.engine, self.name, self.off_loop, body, [prompt_ids])
        return await self.generate(http, body, [prompt_ids], reply)

    # -- a generation request, from the body to the reply ------------------------------------------
    def check_model(self, body: _Body) -> None:
        if body.model is not None and body.model not in self.names:
            raise BadRequest(f"model {body.model!r} is not served here; this server serves {self.name!r} "
                             "(see /v1/models)", 404, "model")

    async def completion_prompts(self, prompt) -> tuple[list[str | None], list[list[int]]]:
        """The prompts as token ids, and as the client's text where it sent text (for echo)."""
        if isinstance(prompt, str):
            return [prompt], await self.tokenize([prompt])
        if all(isinstance(x, str) for x in prompt):
            return list(prompt), await self.tokenize(list(prompt))
        if all(isinstance(x, int) for x in prompt):
            return [None], [list(prompt)]
        return [None] * len(prompt), [list(x) for x in prompt]

    async def tokenize(self, texts: list[str]) -> list[list[int]]:
        if self.engine.tokenizer is None:
            raise BadRequest("this model has no tokenizer: send the prompt as a list of token ids", param="prompt")
        return await self.off_loop(self.encode_many, texts)

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        return [self.engine.tokenizer.encode(t) for t in texts]

    def render_chat(self, conversation: list[dict]) -> list[int]:
        return self.engine.tokenizer.encode(self.engine.tokenizer.apply_chat_template(conversation))

    async def submit(self, loop: EngineLoop, body: _Body, prompts: list[list[int]], rid: str) -> Group:
        items = body.engine_requests(prompts, self.default_max_tokens, self.engine.max_model_len)
        try:
            return await loop.submit(items, rid)
        except (ValueError, TypeError) as exc:
            raise BadRequest(str(exc)) from None

    async def generate(self, http: Request, body: _Body, prompts: list[list[int]], reply: Reply) -> Response:
        loop = self.engine_loop()
        group = await self.submit(loop, body, prompts, reply.id)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(event_stream(http, loop, group, reply, include_usage),
                                     media_type="text/event-stream")
        async with abort_on_disconnect(http, loop, group):
            err = await collect(group)
        if err:
            return error_response(err, 500)
        if group.closed:
            return Response(status_code=499)            # the client is gone: nobody reads this
        return JSONResponse(await reply.body(group.requests))


def create_app(engine: LLMEngine, model_name: str | list[str] | None = None, default_max_tokens: int = 256,
               api_key: str | None = None) -> FastAPI:
    names = [model_name] if isinstance(model_name, str) else list(model_name or []) or [engine.source.name]
    server = OpenAIServer(engine, names, default_max_tokens)
    app = FastAPI(title="zipfusion", description="OpenAI-compatible server with a losslessly compressed KV cache",
                  lifespan=server.lifespan)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    install_error_handlers(app, server.metrics)
    app.state.engine_loop = server.engine_loop
    app.state.metrics = server.metrics
    app.state.model_names = names
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/metrics", server.prometheus, methods=["GET"])
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat, methods=["POST"])
    return app
