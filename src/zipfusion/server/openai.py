"""OpenAI-compatible HTTP API with vLLM's shapes and extra routes. Errors come in OpenAI's shape, limits
and values are checked before the work they guard, tokenization runs off the event loop, and a
client that leaves has its requests aborted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import json
import logging
import sys
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from ..engine import LLMEngine
from .auth import APIKeyMiddleware
from .body_worker import BodyWorker
from .engine_loop import EngineLoop, Group
from .errors import error_response, install_error_handlers
from .limits import BodyLimitMiddleware, ServerLimits, max_body_items
from .metrics import Metrics
from .protocol import (LARGE_BODY, BadRequest, BodyErrors, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                       TokenizeRequest, _Body, load_body)

log = logging.getLogger("zipfusion.server")
# How long a thread waiting for the GIL waits before the holder must hand it over (Python's default:
# 5 ms). The engine thread releases the GIL around every kernel call and takes it back dozens of
# times a step; behind a thread parsing a large body, each take-back waited the full interval.
GIL_SWITCH_S = 0.0005


def kv_cache_metadata(engine) -> dict:
    """What /v1/models says of the KV cache (storage, lossy or not, memory) and the weights."""
    c, w = engine.config, engine.weights
    return {"kv_cache_dtype": c.kv_cache_dtype, "kv_compression": c.kv_compression, "lossy": c.kv_lossy,
            "kv_memory_gb": round(engine.kv_memory_gb, 4), "max_num_seqs": c.max_num_seqs,
            "weight_compression": bool(w.compressed), "weights_bytes": w.original_bytes,
            "weights_stored_bytes": w.stored_bytes}


def default_model_name(source) -> str:
    """The name served when --served-model-name is not given: the folder's name or the .gguf's
    stem, never the absolute path."""
    name = str(source.name)
    if name == "demo" or "/" not in name and "\\" not in name and not name.lower().endswith(".gguf"):
        return name
    path = Path(name)
    return (path.stem if path.suffix.lower() == ".gguf" else path.name) or name
from .responses import ChatReply, CompletionReply, Reply, render
from .streaming import abort_on_disconnect, collect, event_stream
from .tools import guided_fields as tool_guided, renders_tools, tool_format, with_tools_prompt


class OpenAIServer:
    """One app's engine, loop, metrics, names and tokenizer thread. Route methods carry no return
    annotation: FastAPI would take it for a response model."""

    def __init__(self, engine: LLMEngine, names: list[str], default_max_tokens: int, limits: ServerLimits,
                 metrics_prefix: str = "zipfusion"):
        self.engine, self.names, self.name = engine, names, names[0]
        self.default_max_tokens = default_max_tokens
        self.limits = limits.resolved(engine.config.max_num_seqs)
        self.max_token_bytes: int | None = None
        self.metrics = Metrics(self.name, metrics_prefix)
        self.created = int(time.time())  # /v1/models' "created"
        self.tokenizer_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zipfusion-tokenizer")
        self.bodies = BodyWorker()
        self._loop: EngineLoop | None = None

    def engine_loop(self) -> EngineLoop:
        if self._loop is None:
            self._loop = EngineLoop(self.engine, self.metrics)
        return self._loop

    @contextlib.asynccontextmanager
    async def lifespan(self, _app):
        previous_switch = sys.getswitchinterval()
        sys.setswitchinterval(min(previous_switch, GIL_SWITCH_S))
        self.bodies.start()
        self.engine_loop()
        if self.engine.tokenizer is not None:
            self.max_token_bytes = await self.off_loop(self.engine.tokenizer.longest_token_bytes)
        gc.freeze()  # what startup built (model, libraries) out of the full collections that hold the GIL
        yield
        gc.unfreeze()
        self._loop.shutdown()
        self._loop = None
        self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self.bodies.close)
        sys.setswitchinterval(previous_switch)

    async def off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, fn, *args)

    async def health(self):
        return {"status": "ok"}

    async def models(self):
        return {"object": "list", "data": [{"id": n, "object": "model", "created": self.created, "owned_by": "zipfusion",
                                            "root": self.name,
                                            "max_model_len": self.engine.max_model_len,
                                            **kv_cache_metadata(self.engine)}
                                           for n in self.names]}

    async def version(self):
        from .. import __version__
        return {"version": __version__}

    def require_tokenizer(self, param: str):
        if self.engine.tokenizer is None:
            raise BadRequest("this model has no tokenizer", param=param)
        return self.engine.tokenizer

    async def tokenize_route(self, http: Request):
        """vLLM's /tokenize: a prompt's (or a chat's, template applied) token ids."""
        body = await self.parse(http, TokenizeRequest)
        self.check_model(body)
        if (body.prompt is None) == (body.messages is None):
            raise BadRequest("give either prompt (text) or messages (a chat)", param="prompt")
        tok = self.require_tokenizer("prompt" if body.prompt is not None else "messages")
        if body.prompt is not None:
            self.check_text_fits([body.prompt], "prompt")
            ids = await self.off_loop(lambda: tok.encode(body.prompt) if body.add_special_tokens
                                      else tok.encode_plain(body.prompt))
        else:
            conversation = body.conversation()
            self.check_text_fits([m["content"] for m in conversation], "messages")
            try:
                ids = await self.off_loop(self.render_chat, conversation, None, body.add_generation_prompt)
            except ValueError as exc:
                raise BadRequest(str(exc), param="messages") from None
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}

    async def detokenize_route(self, http: Request):
        """vLLM's /detokenize: token ids back to text."""
        body = await self.parse(http, DetokenizeRequest)
        self.check_model(body)
        tok = self.require_tokenizer("tokens")
        vocab = self.engine.model_config.vocab_size
        bad = next((i for i, t in enumerate(body.tokens) if t >= vocab), None)
        if bad is not None:
            raise BadRequest(f"tokens[{bad}] = {body.tokens[bad]} is not a token id of this model (0..{vocab - 1})",
                             param="tokens")
        return {"prompt": await self.off_loop(tok.decode, list(body.tokens))}

    async def prometheus(self):
        try:
            stats = await asyncio.wait_for(asyncio.wrap_future(self.engine_loop().call(self.engine.kv_stats)), 10)
            self.metrics.set_kv(stats)
        except (asyncio.TimeoutError, RuntimeError):
            pass
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def parse(self, http: Request, model):
        """The body as ``model``: a large one in the body worker process, others on the tokenizer thread."""
        raw = await http.body()
        try:
            if len(raw) >= LARGE_BODY:
                return await asyncio.wrap_future(self.bodies.submit(model, raw))
            return await self.off_loop(load_body, model, raw)
        except BodyErrors as exc:
            raise RequestValidationError(exc.errors) from None

    async def completions(self, http: Request):
        body = await self.parse(http, CompletionRequest)
        self.check_model(body)
        body.check()
        self.warn_unknown(body, "/v1/completions")
        p = body.prompt
        count = 1 if isinstance(p, str) or all(isinstance(x, int) for x in p) else len(p)
        body.check_limits(self.limits, count)
        texts, prompts = await self.completion_prompts(p)
        reply = CompletionReply(self.engine, self.name, self.off_loop, body, prompts, texts)
        return await self.generate(http, body, prompts, reply)

    async def chat(self, http: Request):
        body = await self.parse(http, ChatCompletionRequest)
        self.check_model(body)
        body.check()
        self.warn_unknown(body, "/v1/chat/completions")
        body.check_limits(self.limits)
        if self.engine.tokenizer is None:
            raise BadRequest("this model has no tokenizer, so it cannot serve chat; use /v1/completions with token ids")
        conversation, tools = body.conversation(), body.tool_list()
        template = self.engine.tokenizer.chat_template
        fmt = tool_format(template) if tools else None
        if tools and not renders_tools(template):
            conversation = with_tools_prompt(conversation, tools)
        if tools and body.tool_choice not in (None, "auto"):
            body.force_tool_calls(tool_guided(tools, body.tool_choice, fmt, body.parallel_tool_calls is not False))
        self.check_text_fits([m["content"] for m in conversation] + [json.dumps(tools)], "messages")
        try:
            prompt_ids = await self.off_loop(self.render_chat, conversation,
                                             tools if renders_tools(template) else None)
        except ValueError as exc:
            raise BadRequest(f"{exc}; use /v1/completions instead") from None
        reply = ChatReply(self.engine, self.name, self.off_loop, body, [prompt_ids], fmt)
        return await self.generate(http, body, [prompt_ids], reply)

    @staticmethod
    def warn_unknown(body: _Body, route: str) -> None:
        unknown = body.unknown_fields()
        if unknown:
            log.warning("%s: ignored field(s) this server does not know: %s", route,
                        ", ".join(repr(n)[:64] for n in unknown[:8]) + (" ..." if len(unknown) > 8 else ""))

    def check_text_fits(self, texts: list[str], param: str) -> None:
        """Refuse, before tokenizing, text longer than max_model_len x the longest token in bytes."""
        if self.max_token_bytes is None:
            return
        limit = self.engine.max_model_len * self.max_token_bytes
        size = sum(len(t.encode("utf-8")) for t in texts)
        if size > limit:
            raise BadRequest(f"{param} is {size} bytes of text, more than this model's maximum context length "
                             f"(max_model_len) of {self.engine.max_model_len} tokens can hold (a token is at most "
                             f"{self.max_token_bytes} bytes); shorten the prompt", param=param)

    def check_model(self, body: _Body) -> None:
        if body.model is not None and body.model not in self.names:
            raise BadRequest(f"model {body.model!r} is not served here; this server serves {self.name!r} "
                             "(see /v1/models)", 404, "model", code="model_not_found")

    async def completion_prompts(self, prompt) -> tuple[list[str | None], list[list[int]]]:
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
        for i, text in enumerate(texts):
            self.check_text_fits([text], f"prompt[{i}]" if len(texts) > 1 else "prompt")
        return await self.off_loop(self.engine.tokenizer.encode_many, texts)

    def render_chat(self, conversation: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
        tok = self.engine.tokenizer
        return tok.encode(tok.apply_chat_template(conversation, add_generation_prompt, tools=tools))

    async def submit(self, loop: EngineLoop, body: _Body, prompts: list[list[int]], rid: str) -> Group:
        e = self.engine
        await self.off_loop(body.check_engine, prompts, e.model_config.vocab_size, e.config.max_logprobs,
                            e.max_model_len, "messages" if isinstance(body, ChatCompletionRequest) else "prompt")
        items = body.engine_requests(prompts, self.default_max_tokens, e.max_model_len)
        matchers = None
        if items[0][1].guided:  # compiled on the tokenizer thread
            try:
                matchers = await self.off_loop(lambda: [self.engine.grammars.matcher(p) for _, p in items])
            except ValueError as exc:
                raise BadRequest(str(exc), param=body.guided_param()) from None
        try:
            return await loop.submit(items, rid, matchers)
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
            return Response(status_code=499)  # the client is gone
        return Response(await self.off_loop(render, await reply.body(group.requests)), media_type="application/json")


ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"},
                                                                     "event": {"type": "string"}}}


def _error(description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": ERROR_SCHEMA}}}


def _responses(api_key: bool, *codes: int) -> dict:
    text = {400: "A malformed or refused request (OpenAI's error shape)",
            401: "Missing or wrong API key", 404: "The model named is not served here",
            413: "The request body is larger than --max-request-bytes",
            500: "The engine failed while the request ran"}
    return {c: _error(text[c]) for c in codes if c != 401 or api_key}


def _walk(schema, fn) -> None:
    if isinstance(schema, dict):
        fn(schema)
        for v in schema.values():
            _walk(v, fn)
    elif isinstance(schema, list):
        for v in schema:
            _walk(v, fn)


def _document_limits(schemas: dict, server: "OpenAIServer") -> None:
    """This server's limits as JSON-schema bounds; rules across fields stay 400s."""
    engine, lim = server.engine, server.limits
    vocab, mml = engine.model_config.vocab_size, engine.max_model_len

    def token_ids(sch):
        if sch.get("type") == "integer" and sch.get("minimum") == 0:
            sch["maximum"] = vocab - 1

    def nonempty(sch):
        if sch.get("type") == "array":
            sch["minItems"] = 1

    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas.get(name, {}).get("properties", {})
        for key in ("max_tokens", "max_completion_tokens"):
            _walk(props.get(key), lambda sch: sch.update(maximum=mml - 1) if sch.get("type") == "integer" else None)
        for key in ("logprobs", "top_logprobs"):
            _walk(props.get(key), lambda sch: sch.update(maximum=engine.config.max_logprobs)
                  if sch.get("type") == "integer" else None)
        if "n" in props:
            props["n"]["maximum"] = min(props["n"].get("maximum", lim.max_sequences), lim.max_sequences)
        _walk(props.get("stop_token_ids"), token_ids)
        _walk(props.get("stop_token_ids"), lambda sch: sch.update(maxItems=lim.max_stop_token_ids)
              if sch.get("type") == "array" else None)
        _walk(props.get("stop"), lambda sch: sch.update(maxItems=lim.max_stop) if sch.get("type") == "array"
              else sch.update(maxLength=lim.max_stop_chars) if sch.get("type") == "string" else None)
        if "prompt" in props:
            _walk(props["prompt"], token_ids)
            _walk(props["prompt"], nonempty)
            for alt in props["prompt"].get("anyOf", []):
                if alt.get("type") == "array" and alt.get("items", {}).get("type") in ("array", "string"):
                    alt["maxItems"] = lim.max_sequences
                elif alt.get("type") == "array":
                    alt["maxItems"] = mml - 1


BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
          "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


def _document_bodies(doc: dict) -> None:
    """The request bodies (parsed by the routes off the event loop) as FastAPI describes a body."""
    from pydantic.json_schema import models_json_schema
    _, top = models_json_schema([(m, "validation") for m in BODIES.values()],
                                ref_template="#/components/schemas/{model}")
    doc.setdefault("components", {}).setdefault("schemas", {}).update(top.get("$defs", {}))
    for path, model in BODIES.items():
        op = doc["paths"][path]["post"]
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}


def _openapi(app: FastAPI, server: OpenAIServer, api_key: bool):
    """FastAPI's document, made to say what the server does: no 422, /metrics as text, limits."""
    def build() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        from fastapi.openapi.utils import get_openapi
        doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        _document_bodies(doc)
        for item in doc.get("paths", {}).values():
            for op in item.values():
                op.get("responses", {}).pop("422", None)
        schemas = doc.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        _document_limits(schemas, server)
        if api_key:
            doc.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            for path, item in doc.get("paths", {}).items():
                if path.startswith("/v1"):
                    for op in item.values():
                        op["security"] = [{"bearer": []}]
        app.openapi_schema = doc
        return doc
    return build


def create_app(engine: LLMEngine, model_name: str | list[str] | None = None, default_max_tokens: int = 256,
               api_key: str | None = None, limits: ServerLimits | None = None,
               metrics_prefix: str = "zipfusion") -> FastAPI:
    """The app serving ``engine``; ``model_name``: the name(s) it answers to."""
    names = ([model_name] if isinstance(model_name, str) else list(model_name or [])) or [
        default_model_name(engine.source)]
    server = OpenAIServer(engine, names, default_max_tokens, limits or ServerLimits(), metrics_prefix)
    app = FastAPI(title="zipfusion", description="OpenAI-compatible server with a losslessly compressed KV cache",
                  lifespan=server.lifespan)
    app.add_middleware(BodyLimitMiddleware, limit=server.limits.max_request_bytes,
                       on_reject=server.metrics.rejected.inc,
                       max_items=max_body_items(server.limits, engine.max_model_len, engine.model_config.vocab_size))
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)  # outermost: no body is read without the key
    install_error_handlers(app, server.metrics)
    app.state.engine_loop = server.engine_loop
    app.state.metrics = server.metrics
    app.state.bodies = server.bodies
    app.state.model_names = names
    app.state.limits = server.limits
    key = bool(api_key)
    generation = {200: {"description": "The completion (JSON), or server-sent events with stream=true",
                        "content": {"application/json": {"schema": {"type": "object"}},
                                    "text/event-stream": {"schema": SSE_EVENT}}},
                  **_responses(key, 400, 401, 404, 413, 500)}
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/v1/models", server.models, methods=["GET"], responses=_responses(key, 401))
    app.add_api_route("/metrics", server.prometheus, methods=["GET"], response_class=PlainTextResponse,
                      responses={200: {"description": "Prometheus text format",
                                       "content": {"text/plain": {"schema": {"type": "string"}}}}})
    app.add_api_route("/v1/completions", server.completions, methods=["POST"], responses=generation)
    app.add_api_route("/v1/chat/completions", server.chat, methods=["POST"], responses=generation)
    app.add_api_route("/tokenize", server.tokenize_route, methods=["POST"], responses=_responses(key, 400, 404, 413))
    app.add_api_route("/detokenize", server.detokenize_route, methods=["POST"], responses=_responses(key, 400, 404, 413))
    app.add_api_route("/version", server.version, methods=["GET"])
    app.openapi = _openapi(app, server, key)
    return app
