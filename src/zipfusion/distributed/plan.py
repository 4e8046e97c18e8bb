"""The step plan: what a worker needs to run the step rank 0 scheduled, and nothing more.

Per decode row: the request id, ``num_computed``, the pages and tokens the worker has not seen
yet. Per prefill chunk: the same plus ``start`` and ``length``. Rank 0 remembers how much of
each request it has sent (a request's tokens only grow; its pages only grow until it is
preempted or finished, when the runner's ``forget`` resets both sides). The worker keeps a
shadow :class:`~zipfusion.engine.request.Request` per request (tokens, pages, num_computed)
and hands its own :class:`~zipfusion.engine.runner.ModelRunner` the same
:class:`~zipfusion.engine.scheduler.SchedulerOutput` rank 0's runner gets. So the protocol does
not depend on what ``LLMEngine.step`` returns, only on the runner's input.
"""

from __future__ import annotations

from ..engine.request import Request
from ..engine.sampling import SamplingParams
from ..engine.scheduler import PrefillChunk, SchedulerOutput


class PlanWriter:
    """Rank 0: SchedulerOutput -> compact plan."""

    def __init__(self):
        self.sent: dict[int, list[int]] = {}          # request id -> [pages sent, tokens sent]

    def forget(self, rid: int) -> None:
        self.sent.pop(rid, None)

    def _entry(self, r) -> tuple:
        s = self.sent.setdefault(r.request_id, [0, 0])
        if len(r.pages) < s[0]:                        # pages shrank without a forget: resend all
            s[0] = 0
        pages_from, pages = s[0], list(r.pages[s[0]:])
        n = r.num_tokens
        tokens = list(r.tokens[s[1]:n]) if n > s[1] else []
        s[0], s[1] = len(r.pages), max(s[1], n)
        return (r.request_id, r.num_computed, pages_from, pages, tokens)

    def plan(self, out) -> dict:
        return {"decode": [self._entry(r) for r in out.decode],
                "prefill": [(self._entry(ch.request), ch.start, ch.length) for ch in out.prefill]}


_PARAMS = SamplingParams(max_tokens=None)


class PlanReader:
    """A worker: compact plan -> SchedulerOutput over shadow requests."""

    def __init__(self):
        self.shadows: dict[int, Request] = {}

    def forget(self, rid: int) -> None:
        self.shadows.pop(rid, None)

    def _shadow(self, entry) -> Request:
        rid, num_computed, pages_from, pages, tokens = entry
        r = self.shadows.get(rid)
        if r is None:
            r = self.shadows[rid] = Request(rid, [], _PARAMS)
        r.prompt_ids.extend(tokens)                    # the shadow's tokens: prompt + outputs so far
        del r.pages[pages_from:]
        r.pages.extend(pages)
        r.num_computed = num_computed
        return r

    def output(self, plan: dict) -> SchedulerOutput:
        return SchedulerOutput(decode=[self._shadow(e) for e in plan["decode"]],
                               prefill=[PrefillChunk(self._shadow(e), start, length)
                                        for e, start, length in plan["prefill"]])
