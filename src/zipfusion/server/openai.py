"""OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Same request and response shapes as vLLM and SGLang (non-OpenAI options such as ``top_k`` and
``ignore_eos`` arrive as extra body fields); ``"stream": true`` sends ``data: {json}`` events and
ends with ``data: [DONE]``. Errors come back as ``{"error": {"message", "type", "code"}}`` with
status 400 and never disturb the requests already running.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from typing import Any, Literal, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..engine import LLMEngine, SamplingParams
from .engine_loop import EngineLoop, Stream
from .metrics import Metrics


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = -1
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    n: int = 1
    logprobs: Any = None

    def sampling_params(self, default_max: int) -> SamplingParams:
        if self.n != 1:
            raise ValueError("only n=1 is supported; send one request per completion")
        if self.logprobs not in (None, False):
            raise ValueError("logprobs are not supported")
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              seed=self.seed, max_tokens=self.max_tokens or default_max, stop=self.stop,
                              stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                              min_tokens=self.min_tokens)


class CompletionBody(_Body):
    prompt: Union[str, list[int]]
    echo: bool = False


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class BadRequest(Exception):
    pass


def _error(message: str, status: int = 400, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


class TextDelta:
    """Incremental detokenisation that never sends text a stop string could still remove."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.ids, self.sent = tokenizer, [], ""
        self.hold = max((len(s) for s in stop), default=1) - 1

    def add(self, ids: list[int], final_text: str | None = None) -> str:
        self.ids += ids
        if final_text is not None:
            text = final_text
        else:
            text = self.tokenizer.decode(self.ids) if self.tokenizer else ""
            text = text[:max(len(self.sent), len(text) - self.hold)]
            if text.endswith("\ufffd"):          # an incomplete UTF-8 sequence: wait for more bytes
                text = text[:-1]
        delta = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent += delta
        return delta


def create_app(engine: LLMEngine, model_name: str | None = None, default_max_tokens: int = 256) -> FastAPI:
    loop_holder: dict[str, EngineLoop] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        if "loop" in loop_holder:
            loop_holder["loop"].shutdown()

    app = FastAPI(title="zipfusion", description="OpenAI-compatible server with a losslessly compressed KV cache",
                  lifespan=lifespan)
    name = model_name or engine.source.name
    metrics = Metrics(engine)

    def engine_loop() -> EngineLoop:
        if "loop" not in loop_holder:
            loop_holder["loop"] = EngineLoop(engine)
        return loop_holder["loop"]

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        details = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors())
        metrics.rejected.inc()
        return _error(f"malformed request: {details}")

    @app.exception_handler(BadRequest)
    async def _bad(_, exc: BadRequest):
        metrics.rejected.inc()
        return _error(str(exc))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "zipfusion",
                                            "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    def check_model(body: _Body) -> None:
        if body.model is not None and body.model != name:
            raise BadRequest(f"model {body.model!r} is not served here; this server serves {name!r} (see /v1/models)")

    def start(prompt_ids: list[int], body: _Body, max_tokens: int | None = None) -> tuple[Stream, SamplingParams]:
        try:
            if max_tokens is not None:
                body.max_tokens = max_tokens
            params = body.sampling_params(default_max_tokens)
            return engine_loop().submit(prompt_ids, params), params
        except (ValueError, TypeError) as exc:
            raise BadRequest(str(exc)) from None

    def encode(text: str) -> list[int]:
        if engine.tokenizer is None:
            raise BadRequest("this model has no tokenizer: send the prompt as a list of token ids")
        return engine.tokenizer.encode(text)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: Request):
        check_model(body)
        prompt_ids = encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        stream, params = start(prompt_ids, body)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        prefix = body.prompt if body.echo and isinstance(body.prompt, str) else ""

        def chunk(text: str, reason: str | None) -> dict:
            return {"id": rid, "object": "text_completion", "created": created, "model": name,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]}

        return await respond(stream, params, body.stream, http, prompt_ids, chunk, prefix)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, http: Request):
        check_model(body)
        if engine.tokenizer is None:
            raise BadRequest("this model has no tokenizer, so it cannot serve chat; use /v1/completions with token ids")
        try:
            text = engine.tokenizer.apply_chat_template([m.model_dump() for m in body.messages])
        except ValueError as exc:
            raise BadRequest(f"{exc}; use /v1/completions instead") from None
        prompt_ids = encode(text)
        stream, params = start(prompt_ids, body, body.max_completion_tokens or body.max_tokens)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str, reason: str | None, final: bool = False) -> dict:
            if final:
                return {"id": rid, "object": "chat.completion", "created": created, "model": name,
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                     "finish_reason": reason}]}
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": text},
                                 "finish_reason": reason}]}

        return await respond(stream, params, body.stream, http, prompt_ids, chunk, "", chat=True)

    async def respond(stream: Stream, params: SamplingParams, streaming: bool, http: Request,
                      prompt_ids: list[int], chunk, prefix: str, chat: bool = False):
        metrics.requests.inc()
        delta = TextDelta(engine.tokenizer, params.stop)
        started = time.perf_counter()

        def final_text() -> str:
            return engine.output_of(stream.request, None).outputs[0].text

        def usage() -> dict:
            n = len(stream.request.output_ids)
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": n, "total_tokens": len(prompt_ids) + n}

        if not streaming:
            try:
                async for update in stream:
                    if update.error:
                        return _error(update.error, 500, "server_error")
            finally:
                if not stream.done:
                    engine_loop().abort(stream)
            metrics.finished(stream.request, started)
            text = prefix + final_text()
            body = chunk(text, stream.request.finish_reason, True) if chat else chunk(text, stream.request.finish_reason)
            if not chat:
                body["object"] = "text_completion"
            body["usage"] = usage()
            return JSONResponse(body)

        async def events():
            try:
                if prefix:
                    yield f"data: {json.dumps(chunk(prefix, None))}\n\n"
                async for update in stream:
                    if await http.is_disconnected():
                        break
                    if update.error:
                        yield f"data: {json.dumps({'error': {'message': update.error, 'type': 'server_error'}})}\n\n"
                        break
                    text = delta.add(update.new_ids, final_text() if update.finished else None)
                    reason = update.finish_reason if update.finished else None
                    if text or reason:
                        yield f"data: {json.dumps(chunk(text, reason))}\n\n"
                    if update.finished:
                        metrics.finished(stream.request, started)
                yield "data: [DONE]\n\n"
            finally:
                if not stream.done:
                    engine_loop().abort(stream)

        return StreamingResponse(events(), media_type="text/event-stream")

    app.state.engine_loop = engine_loop
    return app
