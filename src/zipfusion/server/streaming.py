"""From a :class:`~.engine_loop.Group` to the client: server-sent events for ``"stream": true``,
the whole group for a plain body, and the abort of a client that leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import AsyncIterator

from fastapi import Request

from .engine_loop import EngineLoop, Group
from .errors import error_body
from .responses import Reply

DONE = "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class TextDelta:
    """Incremental detokenization of one output (vLLM's prefix/read offsets); never sends text a
    stop string could still remove."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.text = ""
        self.sent = 0  # characters already sent
        self.hold = max((len(s) for s in stop), default=1) - 1

    def add(self, ids: list[int]) -> str:
        self.ids += ids
        if self.tokenizer is None or not ids:
            return ""
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        window = self.tokenizer.decode(self.ids[self.prefix:])
        if len(window) > len(before) and not window.endswith("\ufffd"):  # else: an incomplete UTF-8 sequence
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


async def wait_for_disconnect(http: Request) -> None:
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return


@contextlib.asynccontextmanager
async def abort_on_disconnect(http: Request, loop: EngineLoop, group: Group):
    """A client that leaves gets its requests aborted; on the way out, whatever is unfinished."""
    async def watch():
        await wait_for_disconnect(http)
        if not group.done:
            loop.abort(group, "client disconnected")
            group.close()

    task = asyncio.ensure_future(watch())
    try:
        yield
    finally:
        task.cancel()
        if not group.done:
            loop.abort(group, "request ended early")


async def collect(group: Group) -> str | None:
    """Wait for every request of the group; the engine's error, if a step failed."""
    async for u in group:
        if u.error:
            return u.error
    return None


async def event_stream(http: Request, loop: EngineLoop, group: Group, reply: Reply,
                       include_usage: bool) -> AsyncIterator[str]:
    deltas = [TextDelta(reply.tokenizer, r.params.stop) for r in group.requests]
    async with abort_on_disconnect(http, loop, group):
        for chunk in await reply.head():
            yield sse(chunk)
        async for u in group:
            if u.error:
                yield sse(error_body(u.error, 500))
                break
            if u.finished:  # the engine's final text: a stop string already cut
                text = deltas[u.index].finish(await reply.final_text(group.requests[u.index]))
            else:
                text = deltas[u.index].add(u.new_ids)
            chunk = reply.chunk(u, text)
            if chunk is not None:
                yield sse(chunk)
        else:
            if include_usage:
                yield sse(reply.usage_chunk(group.requests))
        yield DONE
