"""What one request may ask of the server: each limit a ``zipfusion serve`` option and a field here,
each refusal a 4xx before any work. Imports neither fastapi nor torch (the CLI reads it).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

MAX_REQUEST_BYTES = 8 * 2**20


def _opt(default, help: str, flag: str):
    return field(default=default, metadata={"help": help, "flag": flag})


@dataclass
class ServerLimits:
    max_request_bytes: int = _opt(MAX_REQUEST_BYTES, "largest request body in bytes; a larger one gets a 413 "
                                                     "unread", "--max-request-bytes")
    max_sequences: int | None = _opt(None, "most prompts x n in one request (default: a quarter of --max-num-seqs, "
                                           "at least 1)",
                                     "--max-sequences-per-request")
    max_stop: int = _opt(16, "most stop strings in one request", "--max-stop")
    max_stop_chars: int = _opt(256, "longest stop string in characters", "--max-stop-chars")
    max_stop_token_ids: int = _opt(256, "most stop_token_ids in one request", "--max-stop-token-ids")

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None and f.name == "max_sequences":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f.metadata['flag']} must be a positive int, got {v!r}")

    def resolved(self, max_num_seqs: int) -> "ServerLimits":
        """With ``max_sequences`` filled in from the engine's ``max_num_seqs``."""
        if self.max_sequences is not None:
            return self
        return ServerLimits(**{**{f.name: getattr(self, f.name) for f in fields(self)},
                               "max_sequences": max(1, max_num_seqs // 4)})


ITEM_SLACK = 65536  # JSON values beyond token ids and biases: fields, messages, schemas


def max_body_items(limits: ServerLimits, max_model_len: int, vocab: int) -> int:
    """The most JSON values a useful request body holds."""
    return limits.max_sequences * max_model_len + vocab + limits.max_stop_token_ids + ITEM_SLACK


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    for f in fields(ServerLimits):
        parser.add_argument(f.metadata["flag"], dest=f.name, type=int, default=f.default,
                            help=f.metadata["help"] + ("" if "(default:" in f.metadata["help"]
                                                       else f" (default: {f.default})"))


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(**{f.name: getattr(args, f.name) for f in fields(ServerLimits)})


class BodyLimitMiddleware:
    """Pure ASGI: a 413 in OpenAI's shape for a body beyond ``limit`` bytes or ``max_items`` JSON
    values (counted by its commas before parsing), the rest unread; other bodies pass unchanged."""

    def __init__(self, app, limit: int, on_reject=None, max_items: int | None = None):
        self.app, self.limit, self.on_reject, self.max_items = app, limit, on_reject, max_items

    async def _refuse(self, scope, receive, send, message: str, status: int = 413) -> None:
        from .errors import error_response
        if self.on_reject is not None:
            self.on_reject()
        await error_response(message, status, headers={"Connection": "close"})(scope, receive, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        too_big = (f"the request body is larger than this server's limit of {self.limit} bytes "
                   "(--max-request-bytes); send a smaller request")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                size = int(length)
            except ValueError:
                await self._refuse(scope, receive, send, "the Content-Length header is not a number", 400)
                return
            if size > self.limit:
                await self._refuse(scope, receive, send, too_big)
                return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending the body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await self._refuse(scope, receive, send, too_big)
                return
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False
        if self.max_items is not None and body.count(b",") >= self.max_items:
            await self._refuse(scope, receive, send, f"the request body holds more than {self.max_items} JSON values "
                               "(token ids, logit_bias entries, ...): more than this server can use in one request "
                               "(prompts x max_model_len tokens, one bias per vocabulary token); send a smaller "
                               "request")
            return

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
