"""Drive one LLMEngine from a background thread and stream each request's tokens to asyncio.
Only the engine thread touches the engine; the event loop hands it commands run between two
steps, so it never waits for a step.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import weakref
from dataclasses import dataclass

from ..engine import LLMEngine, SamplingParams
from ..engine.request import Request, Status

log = logging.getLogger("zipfusion.server")
# The loop that drives each engine, by engine id: one server per engine.
_DRIVERS: "weakref.WeakValueDictionary[int, EngineLoop]" = weakref.WeakValueDictionary()
_DRIVERS_LOCK = threading.Lock()


@dataclass
class Update:
    index: int  # prompt i, sample j: i * n + j
    new_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list | None = None
    error: str | None = None


_CLOSED = object()


class Group:
    """The engine requests of one HTTP request; ``async for update in group`` until all finish."""

    def __init__(self, loop: asyncio.AbstractEventLoop, size: int, name: str = ""):
        self.loop, self.size, self.name = loop, size, name
        self.queue: asyncio.Queue = asyncio.Queue()
        self.requests: list[Request | None] = [None] * size
        self.finished: set[int] = set()
        self.closed = False

    @property
    def done(self) -> bool:
        return len(self.finished) == self.size

    def push(self, update) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, update)
        except RuntimeError:  # the event loop is gone
            pass

    def close(self) -> None:
        self.closed = True
        self.queue.put_nowait(_CLOSED)

    def __aiter__(self):
        return self

    async def __anext__(self) -> Update:
        if self.done or self.closed:
            raise StopAsyncIteration
        update = await self.queue.get()
        if update is _CLOSED:
            raise StopAsyncIteration
        if update.finished:
            self.finished.add(update.index)
        return update


@dataclass
class _Tracked:
    group: Group
    index: int
    request: Request
    sent: int = 0


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics=None):
        self.engine = engine
        self.metrics = metrics
        self.commands: collections.deque = collections.deque()
        self.wake = threading.Event()
        self.tracked: dict[int, _Tracked] = {}
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="zipfusion-engine", daemon=True)
        with _DRIVERS_LOCK:
            other = _DRIVERS.get(id(engine))
            if other is not None and other.thread.is_alive():
                raise RuntimeError("this engine is already driven by another EngineLoop (another app); "
                                   "one server per engine: build a second LLMEngine")
            _DRIVERS[id(engine)] = self
            self.thread.start()

    def call(self, fn) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self.stopping:
            fut.set_exception(RuntimeError("the engine loop is shut down"))
            return fut
        self.commands.append((fn, fut))
        self.wake.set()
        return fut

    async def submit(self, items: list[tuple[list[int], SamplingParams]], name: str = "",
                     matchers: list | None = None) -> Group:
        """Queue one group of requests, all or none (ValueError/TypeError when one is invalid)."""
        group = Group(asyncio.get_running_loop(), len(items), name)
        await asyncio.wrap_future(self.call(lambda: self._add(group, items, matchers or [None] * len(items))))
        return group

    def abort(self, group: Group, why: str = "client disconnected") -> None:
        """Stop the group's unfinished requests at the next step boundary."""
        if not group.done:
            self.call(lambda: self._abort(group, why))

    def shutdown(self) -> None:
        self.stopping = True
        self.wake.set()
        self.thread.join(timeout=10)
        with _DRIVERS_LOCK:
            if _DRIVERS.get(id(self.engine)) is self:
                del _DRIVERS[id(self.engine)]

    def check_fits(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Refuse a request that could never finish (prompt + max_tokens beyond max_model_len)."""
        limit = self.engine.max_model_len
        need = len(prompt_ids) + (params.max_tokens or 0)
        if len(prompt_ids) >= limit or need > limit:
            raise ValueError(f"this model's maximum context length (max_model_len) is {limit} tokens, but "
                             f"{need} were requested ({len(prompt_ids)} in the prompt, {params.max_tokens} in the "
                             "completion); shorten the prompt or lower max_tokens")

    def _add(self, group: Group, items, matchers: list) -> None:
        reqs = []
        try:
            for (prompt_ids, params), matcher in zip(items, matchers):
                self.check_fits(prompt_ids, params)
                reqs.append(self.engine.add_request(prompt_ids, params, matcher))
        except BaseException:
            for r in reqs:
                self.engine.abort(r)
            raise
        for i, r in enumerate(reqs):
            group.requests[i] = r
            self.tracked[r.request_id] = _Tracked(group, i, r)

    def _abort(self, group: Group, why: str) -> None:
        for r in group.requests:
            if r is None or self.tracked.pop(r.request_id, None) is None:
                continue
            tokens = len(r.output_ids)
            if r.status != Status.FINISHED:
                self.engine.abort(r)
            if self.metrics is not None:
                self.metrics.on_finished(r)
            log.info("request %s[%d] aborted (%s) after %d generated tokens", group.name, group.requests.index(r),
                     why, tokens)
        if self.metrics is not None:
            self.metrics.on_step(self.engine)

    def _run_commands(self) -> None:
        while self.commands:
            fn, fut = self.commands.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)

    def _run(self) -> None:
        while not self.stopping:
            self.wake.clear()
            self._run_commands()
            if self.engine.has_work():
                try:
                    self.engine.step()
                except Exception as exc:  # keep serving: fail only the requests in flight
                    log.exception("engine step failed")
                    self._fail_all(f"engine error: {exc}")
                self._publish()
            elif not self.commands:
                self.wake.wait(timeout=1.0)
        for _, fut in self.commands:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError("the engine loop is shut down"))

    def _publish(self) -> None:
        m = self.metrics
        for rid, t in list(self.tracked.items()):
            r = t.request
            new = r.output_ids[t.sent:]
            finished = r.status == Status.FINISHED
            if new or finished:
                lps = r.logprobs[t.sent:t.sent + len(new)] if r.params.logprobs is not None else None
                if m is not None:
                    m.on_tokens(r, t.sent, len(new))
                t.sent += len(new)
                t.group.push(Update(t.index, list(new), finished, r.finish_reason, r.stop_reason, lps))
            if finished:
                del self.tracked[rid]
                if m is not None:
                    m.on_finished(r)
        if m is not None:
            m.on_step(self.engine)

    def _fail_all(self, message: str) -> None:
        for rid, t in list(self.tracked.items()):
            try:
                self.engine.abort(t.request)
            except Exception:
                log.exception("abort after a failed step")
            t.group.push(Update(t.index, [], True, "abort", error=message))
            del self.tracked[rid]
            if self.metrics is not None:
                self.metrics.on_finished(t.request)
