"""The model runner on every rank of a tensor-parallel engine (docs/distributed.md): rank 0 sends
each call to the workers first, with only what they have not seen of the step.
"""

from __future__ import annotations

from ..distributed.lockstep import apply_ops, report_of
from ..models import build_model, model_config, resolve_model
from ..models.compressed_weights import weight_sizes
from ..models.parallel import TensorParallel, use
from ..attention.backend import AttentionBackend
from .build import build_kv_cache, kv_memory_gb, parse_dtype
from .request import Request
from .runner import ModelRunner
from .sampling import SamplingParams
from .scheduler import PrefillChunk, SchedulerOutput


class TPRunner:
    """Rank 0's runner: each call goes to the workers first, then runs here."""

    def __init__(self, runner: ModelRunner, driver, max_model_len: int):
        self._runner, self._driver, self._writer = runner, driver, PlanWriter()
        driver.send("runner", max_model_len=max_model_len, max_num_seqs=runner.max_num_seqs,
                    use_cuda_graphs=runner.use_cuda_graphs)
        with driver.guard():
            driver.comm.report()

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def _call(self, kind: str, fn, **payload):
        d = self._driver
        d.send(kind, **payload)
        with d.guard():  # a failure mid-step leaves the workers mid-collective: fatal
            result = fn()
            d.comm.report()
        return result

    def run(self, out):
        plan = self._writer.plan(out)
        return self._call("step", lambda: self._runner.run(out), plan=plan)

    def capture_cuda_graphs(self, *args, **kwargs):
        return self._call("capture", lambda: self._runner.capture_cuda_graphs(*args, **kwargs),
                          args=args, kwargs=kwargs)


def serve(cfg, comm) -> None:
    """A worker (rank > 0): build this rank's model and cache, then follow rank 0's messages
    (replay its cache operations, build, capture, step) and report capacity, until told to exit."""
    dtype, device = parse_dtype(cfg.dtype), comm.device
    source = resolve_model(cfg.model, cfg.load_format, cfg.revision)
    mc = model_config(source)
    with use(TensorParallel(comm.world, comm.rank, comm.tp_group)):
        model = build_model(source, dtype=dtype, device=device, seed=cfg.seed, deterministic=cfg.deterministic,
                            weight_compression=cfg.weight_compression)
    saved = weight_sizes(model).saved_bytes
    gb = comm.min_over_ranks(kv_memory_gb(cfg, device, saved))  # the same collective as rank 0's agree_budget
    cache = build_kv_cache(cfg, mc, dtype, device, gb, comm.world)
    runner, reader, left_open = None, PlanReader(), set()
    while True:
        msg = comm.recv()
        apply_ops(cache, msg["ops"], left_open)
        kind = msg["kind"]
        if kind == "exit":
            break
        if kind == "runner":
            runner = ModelRunner(model, AttentionBackend.from_config(cfg, cache, mc, comm.world),
                                 msg["max_model_len"], msg["max_num_seqs"],
                                 use_cuda_graphs=msg["use_cuda_graphs"])
        elif kind == "capture":
            runner.capture_cuda_graphs(*msg["args"], **msg["kwargs"])
        elif kind == "step":
            runner.run(reader.output(msg["plan"]))
        elif kind is not None:
            raise ValueError(f"unknown message {kind!r}")
        comm.report(report_of(cache))
    comm.close()


class PlanWriter:
    """Rank 0: SchedulerOutput -> compact plan."""

    def __init__(self):
        self.sent: dict[int, list[int]] = {}  # request id -> [pages sent, tokens sent]

    def _entry(self, r) -> tuple:
        s = self.sent.setdefault(r.request_id, [0, 0])
        if len(r.pages) < s[0]:  # pages shrank (an end not seen): resend all
            s[0] = 0
        pages_from, pages = s[0], list(r.pages[s[0]:])
        n = r.num_tokens
        tokens = list(r.tokens[s[1]:n]) if n > s[1] else []
        s[0], s[1] = len(r.pages), max(s[1], n)
        return (r.request_id, r.num_computed, pages_from, pages, tokens)

    def plan(self, out) -> dict:
        for rid in out.ended:
            self.sent.pop(rid, None)
        return {"ended": out.ended, "decode": [self._entry(r) for r in out.decode],
                "prefill": [(self._entry(ch.request), ch.start, ch.length) for ch in out.prefill]}


_PARAMS = SamplingParams(max_tokens=None)


class PlanReader:
    """A worker: compact plan -> SchedulerOutput over shadow requests."""

    def __init__(self):
        self.shadows: dict[int, Request] = {}

    def _shadow(self, entry) -> Request:
        rid, num_computed, pages_from, pages, tokens = entry
        r = self.shadows.get(rid)
        if r is None:
            r = self.shadows[rid] = Request(rid, [], _PARAMS)
        r.prompt_ids.extend(tokens)
        del r.pages[pages_from:]
        r.pages.extend(pages)
        r.num_computed = num_computed
        return r

    def output(self, plan: dict) -> SchedulerOutput:
        for rid in plan["ended"]:
            self.shadows.pop(rid, None)
        return SchedulerOutput(ended=plan["ended"], decode=[self._shadow(e) for e in plan["decode"]],
                               prefill=[PrefillChunk(self._shadow(e), start, length)
                                        for e, start, length in plan["prefill"]])
