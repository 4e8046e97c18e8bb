"""Drive one LLMEngine from a background thread and stream each request's tokens to asyncio.

HTTP handlers call :meth:`EngineLoop.submit` (validation happens there, so a bad request is
refused before it touches the running batch) and then iterate the returned :class:`Stream`.
The thread runs ``engine.step()`` while there is work, and after each step hands every stream
the tokens it gained; a stream that is abandoned (client gone) is aborted and its pages freed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field

from ..engine import LLMEngine, SamplingParams
from ..engine.request import Request, Status

log = logging.getLogger("zipfusion.server")


@dataclass
class Update:
    new_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class Stream:
    """One request's tokens as they arrive; ``async for update in stream``."""

    request: Request
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    sent: int = 0                 # output tokens already handed over
    done: bool = False

    def push(self, update: Update) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, update)

    def __aiter__(self):
        return self

    async def __anext__(self) -> Update:
        if self.done:
            raise StopAsyncIteration
        update = await self.queue.get()
        self.done = update.finished
        return update


class EngineLoop:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.streams: dict[int, Stream] = {}
        self.stopping = False
        self.steps = 0
        self.thread = threading.Thread(target=self._run, name="zipfusion-engine", daemon=True)
        self.thread.start()

    # -- called from the event loop ---------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Stream:
        """Queue a request; raises ValueError/TypeError (nothing queued) when it is invalid."""
        limit = self.engine.max_model_len
        need = len(prompt_ids) + (params.max_tokens or 0)
        if len(prompt_ids) >= limit or need > limit:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens and max_tokens is {params.max_tokens}: "
                             f"{need} in all, but this server's max_model_len is {limit}; shorten the "
                             "prompt or lower max_tokens")
        loop = asyncio.get_running_loop()
        with self.lock:
            req = self.engine.add_request(prompt_ids, params)
            stream = Stream(req, loop)
            self.streams[req.request_id] = stream
        self.wake.set()
        return stream

    def abort(self, stream: Stream) -> None:
        with self.lock:
            req = stream.request
            if self.streams.pop(req.request_id, None) is not None and req.status != Status.FINISHED:
                sched = self.engine.scheduler
                if req in sched.waiting:
                    sched.waiting.remove(req)
                sched.finish(req, "abort")

    def shutdown(self) -> None:
        self.stopping = True
        self.wake.set()
        self.thread.join(timeout=10)

    # -- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        while not self.stopping:
            with self.lock:
                busy = self.engine.scheduler.has_work()
                if busy:
                    try:
                        self.engine.step()
                        self.steps += 1
                    except Exception as exc:   # keep serving: fail only the requests in flight
                        log.exception("engine step failed")
                        self._fail_all(f"engine error: {exc}")
                    self._publish()
            if not busy:
                self.wake.wait(timeout=0.5)
                self.wake.clear()

    def _publish(self) -> None:
        for rid, stream in list(self.streams.items()):
            req = stream.request
            new = req.output_ids[stream.sent:]
            finished = req.status == Status.FINISHED
            if new or finished:
                stream.sent += len(new)
                stream.push(Update(list(new), finished, req.finish_reason))
            if finished:
                del self.streams[rid]

    def _fail_all(self, message: str) -> None:
        sched = self.engine.scheduler
        for rid, stream in list(self.streams.items()):
            req = stream.request
            if req.status != Status.FINISHED:
                if req in sched.waiting:
                    sched.waiting.remove(req)
                sched.finish(req, "abort")
            stream.push(Update([], True, "abort", error=message))
            del self.streams[rid]
