"""What the two generation routes send back, in OpenAI's shapes: the body, the streamed chunks,
logprobs and usage. Detokenization runs on the tokenizer thread, never on the event loop.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Awaitable, Callable

from .engine_loop import Update
from .protocol import CompletionRequest, _Body
from .tools import ToolStream, parse


def usage(prompts: list[list[int]], requests: list) -> dict:
    p = sum(len(ids) for ids in prompts)
    c = sum(len(r.output_ids) for r in requests if r is not None)
    cached = sum(r.num_cached_tokens or 0 for r in requests if r is not None)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached}}


def render(body: dict) -> bytes:
    """A whole reply as JSON, its choices last, one json.dumps per choice: each call holds the GIL
    throughout, so a reply of many choices is rendered in pieces other threads run between."""
    def dumps(obj) -> str:
        return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    head = dumps({k: v for k, v in body.items() if k != "choices"})
    return f'{head[:-1]},"choices":[{",".join(dumps(c) for c in body["choices"])}]}}'.encode()


def top_entries(entry: dict, k: int) -> list[tuple[int, float]]:
    """The ``k`` best (token id, logprob) of one position's {token id: Logprob}."""
    return [(t, lp.logprob) for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank)[:k]]


class Reply:
    """The replies of one generation request (``k``: top logprobs per token, None: none)."""

    id_prefix = body_object = chunk_object = ""

    def __init__(self, engine, model: str, run: Callable[..., Awaitable], body: _Body, prompts: list[list[int]]):
        self.id, self.created = f"{self.id_prefix}-{uuid.uuid4().hex}", int(time.time())
        self.engine, self.tokenizer, self.model, self.run = engine, engine.tokenizer, model, run
        self.prompts, self.size, self.k = prompts, len(prompts) * body.n, body.num_logprobs()

    def envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def token_text(self, tid: int) -> str:
        return self.tokenizer.decode([tid]) if self.tokenizer is not None else f"token_id:{tid}"

    async def final_text(self, req) -> str:
        """The engine's text of a finished request (a stop string already cut)."""
        return await self.run(lambda: self.engine.output_of(req, None).outputs[0].text)

    def usage_chunk(self, requests: list) -> dict:
        return self.envelope(self.chunk_object, [], usage=usage(self.prompts, requests))

    async def head(self) -> list[dict]:
        """The chunks streamed before the first token."""
        raise NotImplementedError

    def chunk(self, u: Update, text: str) -> dict | None:
        """The chunk streamed for one update whose new text is ``text``; None: nothing to send."""
        raise NotImplementedError

    async def body(self, requests: list) -> dict:
        """The whole response, once every request finished."""
        raise NotImplementedError


class CompletionReply(Reply):
    id_prefix, body_object, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, engine, model: str, run, body: CompletionRequest, prompts: list[list[int]],
                 texts: list[str | None]):
        super().__init__(engine, model, run, body, prompts)
        self.texts, self.echo, self.n = texts, body.echo, body.n
        self.return_ids = body.return_token_ids
        self.offsets = [0] * self.size  # characters streamed per choice

    async def echo_texts(self) -> list[str]:
        """Each prompt as text when echo was asked, else ""; a prompt of token ids is decoded."""
        if not self.echo:
            return [""] * len(self.prompts)
        return [await self.prompt_text(text, ids) for text, ids in zip(self.texts, self.prompts)]

    async def prompt_text(self, text: str | None, ids: list[int]) -> str:
        if text is not None:
            return text
        return await self.run(self.tokenizer.decode, ids) if self.tokenizer else ""

    def choice(self, i: int, text: str, reason=None, stop_reason=None, lp=None, ids=None) -> dict:
        c = {"index": i, "text": text, "logprobs": lp, "finish_reason": reason, "stop_reason": stop_reason}
        if self.return_ids and ids is not None:
            c["token_ids"] = ids
        return c

    def logprobs(self, ids: list[int], entries: list[dict], offset: int) -> dict | None:
        if self.k is None:
            return None
        tokens, lps, tops, offsets = [], [], [], []
        for tid, entry in zip(ids, entries):
            text = self.token_text(tid)
            tokens.append(text)
            lps.append(entry[tid].logprob)
            tops.append({self.token_text(t): lp for t, lp in top_entries(entry, self.k)} if self.k else None)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    async def head(self) -> list[dict]:
        echo, chunks = await self.echo_texts(), []
        for i in range(self.size):
            prefix = echo[i // self.n]
            if prefix:
                self.offsets[i] = len(prefix)
                chunks.append(self.envelope(self.chunk_object, [self.choice(i, prefix)]))
        return chunks

    def chunk(self, u: Update, text: str) -> dict | None:
        lp = self.logprobs(u.new_ids, u.logprobs, self.offsets[u.index]) if u.new_ids else None
        self.offsets[u.index] += len(text)
        if not (text or u.finished or lp or (self.return_ids and u.new_ids)):
            return None
        end = (u.finish_reason, u.stop_reason) if u.finished else (None, None)
        return self.envelope(self.chunk_object, [self.choice(u.index, text, *end, lp, u.new_ids)])

    async def body(self, requests: list) -> dict:
        echo, choices = await self.echo_texts(), []
        for i, r in enumerate(requests):
            prefix = echo[i // self.n]
            lp = await self.run(self.logprobs, r.output_ids, r.logprobs, len(prefix))
            choices.append(self.choice(i, prefix + await self.final_text(r), r.finish_reason, r.stop_reason, lp,
                                       list(r.output_ids)))
        return self.envelope(self.body_object, choices, usage=usage(self.prompts, requests))


class ChatReply(Reply):
    """``fmt``: the tool-call format of the output (:mod:`.tools`), None without tools."""
    id_prefix, body_object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, engine, model: str, run, body, prompts: list[list[int]], fmt: str | None = None):
        super().__init__(engine, model, run, body, prompts)
        self.fmt, self.named = fmt, isinstance(body.tool_choice, dict)
        self.streams = [ToolStream(fmt) for _ in range(self.size)] if fmt else None

    def finish_reason(self, reason: str | None, calls: bool) -> str | None:
        """OpenAI's: "tool_calls" when the model called tools (not for a named function)."""
        return "tool_calls" if calls and reason == "stop" and not self.named else reason

    def logprobs(self, ids: list[int], entries: list[dict]) -> dict | None:
        if self.k is None:
            return None

        def one(tid, lp):
            text = self.token_text(tid)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
        return {"content": [{**one(tid, entry[tid].logprob),
                             "top_logprobs": [one(t, lp) for t, lp in top_entries(entry, self.k)]}
                            for tid, entry in zip(ids, entries)]}

    async def head(self) -> list[dict]:
        return [self.envelope(self.chunk_object, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None}])
                for i in range(self.size)]

    def chunk(self, u: Update, text: str) -> dict | None:
        calls = []
        if self.streams is not None:
            s = self.streams[u.index]
            text, calls = s.feed(text)
            if u.finished:
                rest, more = s.finish()
                text, calls = text + rest, calls + more
        lp = self.logprobs(u.new_ids, u.logprobs) if u.new_ids else None
        if not (text or calls or u.finished or lp):
            return None
        delta = {"content": text} if text else {}
        if calls:
            delta["tool_calls"] = calls
        c = {"index": u.index, "delta": delta, "logprobs": lp, "finish_reason": None}
        if u.finished:
            c["finish_reason"] = self.finish_reason(u.finish_reason, bool(self.streams and self.streams[u.index].count))
            c["stop_reason"] = u.stop_reason
        return self.envelope(self.chunk_object, [c])

    async def message(self, r) -> tuple[dict, bool]:
        text = await self.final_text(r)
        if self.fmt is None:
            return {"role": "assistant", "content": text}, False
        content, calls = parse(text, self.fmt)
        return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}, bool(calls)

    async def body(self, requests: list) -> dict:
        choices = []
        for i, r in enumerate(requests):
            message, calls = await self.message(r)
            lp = await self.run(self.logprobs, r.output_ids, r.logprobs)
            choices.append({"index": i, "message": message, "logprobs": lp,
                            "finish_reason": self.finish_reason(r.finish_reason, calls), "stop_reason": r.stop_reason})
        return self.envelope(self.body_object, choices, usage=usage(self.prompts, requests))
