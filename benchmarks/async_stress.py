#!/usr/bin/env python3
"""Async-scheduling stress: many short engine runs with random device delays between the host's
decisions and the device's progress, each bounded in time and checked against the plain order.

The `long` workload with async scheduling stopped making progress three times (2026-12-05/06,
docs/design.md "The hang:"), the GPU busy and the host waiting for a step's tokens; the cause was
never found. This harness looks for it (or anything like it) where it would show first: a worker
process builds one engine (``check_pages=True``: a decode call over a bad page location is a
device-side assert, not a spin; prefix caching and the host tier on; a KV budget that binds, so
pages seal, compact, get evicted and requests are preempted), then runs case after case: the
case's requests once in the plain order (``async_scheduling`` off, no delays: the reference), then
``--variants`` times with async scheduling on and random delays injected at these points:

  before_forward  the device sleeps (``torch.cuda._sleep`` on the compute stream) after the step's
                  schedule and before its forward, so the next step is scheduled while it lags
  after_forward   the same between the forward and the sampling (the tokens come back later)
  chunk_release   before a released chunk's event is recorded (``ChunkPool._reads_done``): the
                  chunk stays pending longer, so ``take`` finds pending chunks and the device waits
  host_copy       the host tier's copy stream sleeps before a copy out (GPU)
  to_device       the compute stream sleeps before a host-to-device copy of the runner's inputs,
                  the page table's changes or the codec's (GPU: ``memory.copy.to_device``)
  host            the host sleeps instead at either forward point (the device runs ahead)

On the CPU nothing overlaps (the forward runs in the host's thread), so the device's progress is
a step clock: a released chunk's event completes a random 0..``--max-lag`` steps later
(``zipfusion.testing.LateEvent``), the page table is kept apart (mirrored, as on CUDA) and the
schedule is made ahead as on the GPU (the engine's ``async_scheduling`` attribute set on).

Modes (``--modes``, the time split evenly between them, one engine each):
  fast  the engine's default (not deterministic, default admission): every request at once,
        outputs of known length (``ignore_eos``), so the async schedule can be the plain one;
        each run's schedule digest (per step: decode rows, prefill tokens, preemptions) is
        compared: under the same schedule the tokens must be the same bits, under another one
        (placement follows the free lists a run leaves and when chunks come back) other tokens
        are rounding and the run is counted apart as "diverged", not failed
  det   ``deterministic=True`` (tokens depend on the request alone), optimistic admission (it
        preempts): requests arriving over the run, aborts at random steps, stop tokens taken from
        the reference's outputs, seeded sampling at temperature 0.8; every request must give the
        reference's tokens up to its stop, an aborted one a prefix of them
A run that does not finish within ``--run-timeout``, or a step within ``--step-timeout`` (the
engine's watchdog), is a hang: the worker prints every thread's stack and exits, the driver keeps
the stacks, ``nvidia-smi``'s view of the GPU (taken every 10 s of a run) and the case's replay
line (``--replay``: its seed and config; the device's timing itself does not replay), and starts
a new worker at the next case. An exception (a device-side
assert of ``check_pages`` included) is an error, recorded the same way. After each run the engine
must be idle with no page left in use once the prefix cache is dropped.

    python3 benchmarks/async_stress.py --minutes 6 --out DIR                    # GPU: 8B random, 1.5 GiB KV
    python3 benchmarks/async_stress.py --shape long --minutes 2 --out DIR      # 16K prompts, 3 GiB
    python3 benchmarks/async_stress.py --smoke --minutes 1 --out DIR           # CPU, demo model
    python3 benchmarks/async_stress.py --replay '{"mode": "fast", "first_case": 0, "cases": 8, ...}' --out DIR
Writes DIR/async_stress.json (runs, seconds, hangs, mismatches, errors, every run's record) and
DIR/worker_<n>.err (each worker's stderr); prints a line per run and a short table last.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import queue
import random
import shlex
import subprocess
import sys
import threading
import time
from collections import Counter

from zipfusion.bench.datasets import lognormal, random_prompts
from zipfusion.bench.offline import die_with_parent
from zipfusion.bench.process import child_environment
from zipfusion.bench.report import versions, write_json

# per shape: requests, prompt median and cap, shared prefix tokens (a third of the requests, one of
# three prefixes), output median and cap, KV GiB, max_num_batched_tokens; the s a run and one step may
# take (a step past it: the engine's watchdog ends the worker with every thread's stack)
SHAPES = {
    "mixed": dict(requests=40, prompt=800, prompt_cap=6000, prefix=1024, output=100, output_cap=400,
                  kv_gb=1.5, batched=4096, run_timeout=240, step_timeout=30),
    "long": dict(requests=6, prompt=14000, prompt_cap=16000, prefix=0, output=160, output_cap=256,
                 kv_gb=3.0, batched=8192, run_timeout=300, step_timeout=30),
}
SMOKE = {   # the demo model on the CPU (3 layers, 2 KV heads x 64: 8 KiB a page a layer)
    "mixed": dict(requests=12, prompt=40, prompt_cap=110, prefix=32, output=10, output_cap=30,
                  kv_gb=80 * 8192 / 2**30, batched=64, run_timeout=60, step_timeout=20, chunk_bytes=4 * 8192,
                  host_gb=0.002),
    "long": dict(requests=3, prompt=300, prompt_cap=400, prefix=0, output=8, output_cap=12,
                 kv_gb=160 * 8192 / 2**30, batched=128, run_timeout=60, step_timeout=20, chunk_bytes=4 * 8192,
                 host_gb=0.002),
}
COUNTERS = ("compactions", "pages_moved", "pages_compressed", "prefix_cache_hit_tokens", "prefix_cache_evicted_pages",
            "recomputed_tokens")    # the engine's counters a run's record keeps (its own share)
FAULTS = ("hang", "mismatch")       # --fault: the harness's own check that it catches each


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


# ============================================================================ the injected delays
class Delays:
    """Random delays at the points the module's docstring lists, drawn from ``seed`` while ``active``: on CUDA a
    ``torch.cuda._sleep`` of up to ``max_ms`` on the stream the point is on (skewed to short ones),
    or now and then a host sleep instead; on the CPU a released chunk's event completes 0..``max_lag``
    steps later (``clock``: the steps run)."""

    def __init__(self, cuda: bool, prob: float, max_ms: float, max_lag: int):
        self.cuda, self.prob, self.max_ms, self.max_lag = cuda, prob, max_ms, max_lag
        self.active = False
        self.rng = random.Random(0)
        self.counts: Counter = Counter()
        self.clock, self.waits = [0], [0]
        self.cycles_per_ms = self._calibrate() if cuda else 0.0

    def start(self, seed: int) -> None:
        self.rng, self.counts, self.waits[0], self.active = random.Random(seed), Counter(), 0, True

    @staticmethod
    def _calibrate() -> float:
        """GPU clock cycles per millisecond of ``torch.cuda._sleep``."""
        import torch
        torch.cuda._sleep(1000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(20_000_000)
        b.record()
        b.synchronize()
        return 20_000_000 / max(a.elapsed_time(b), 1e-3)

    def at(self, point: str, stream=None) -> None:
        # copies are many a step: fewer delays there, or a step would mostly sleep
        if not self.active or self.rng.random() >= self.prob * (0.25 if point == "to_device" else 1):
            return
        ms = self.max_ms * self.rng.random() ** 2
        if not self.cuda or (point.endswith("forward") and self.rng.random() < 0.25):
            self.counts["host"] += 1
            time.sleep(ms / 1e3)
            return
        import torch
        self.counts[point] += 1
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            torch.cuda._sleep(int(ms * self.cycles_per_ms))

    def late_event(self):
        """A CPU chunk release's event (see the class)."""
        from zipfusion.testing import LateEvent
        lag = self.rng.randint(0, self.max_lag)
        self.counts["chunk_release"] += lag > 0
        return LateEvent(self.clock, lag, self.waits)


def install(eng, delays: Delays, fault_state: dict) -> list[str]:
    """Wrap the engine's runner and the memory system's release and copy points with ``delays``
    (in this process only: nothing in src/ changes); returns the points that could not be hooked
    (a refactor moved them)."""
    from zipfusion.memory import chunks
    missing = []
    run = eng.runner.run

    def run_delayed(out):
        delays.at("before_forward")
        if fault_state.get("hang_now"):            # --fault hang: a step that never ends
            while True:
                time.sleep(1)
        logits = run(out)
        delays.at("after_forward")
        return logits
    eng.runner.run = run_delayed

    reads_done = getattr(chunks.ChunkPool, "_reads_done", None)
    if reads_done is None:
        missing.append("chunk_release")
    else:
        def reads_done_delayed(pool):
            if delays.active and not delays.cuda:
                return delays.late_event()
            delays.at("chunk_release")
            return reads_done(pool)
        chunks.ChunkPool._reads_done = reads_done_delayed
    take = getattr(chunks.ChunkPool, "take", None)
    if take is not None and hasattr(chunks.ChunkPool, "pending"):
        def take_counted(pool, *a, **k):
            if delays.active and pool.pending():
                delays.counts["take_with_pending"] += 1
            return take(pool, *a, **k)
        chunks.ChunkPool.take = take_counted
    if delays.cuda:
        import importlib
        for name in ("engine.runner", "memory.page_table", "memory.codec", "attention.prefill_stored"):
            mod = importlib.import_module("zipfusion." + name)
            copy = getattr(mod, "to_device", None)
            if copy is None:
                missing.append(f"to_device ({name})")
                continue

            def copy_delayed(*a, _copy=copy, **k):
                delays.at("to_device")
                return _copy(*a, **k)
            mod.to_device = copy_delayed
    tier = eng.host_tier
    stage = getattr(tier, "_stage_batch", None)
    if tier is not None and stage is not None and delays.cuda:
        def stage_delayed(*a, **k):
            delays.at("host_copy", getattr(tier, "stream", None))
            return stage(*a, **k)
        tier._stage_batch = stage_delayed
    elif delays.cuda:
        missing.append("host_copy")
    return missing


def mirror_page_tables() -> None:
    """On the CPU: page tables kept apart from the kernels' copy, brought up to date before each
    forward as on CUDA (``PageTable(mirrored=True)``); before the engine is built."""
    from zipfusion.memory import page_table
    init = page_table.PageTable.__init__

    def mirrored(self, *a, **k):
        init(self, *a[:3], **{**k, "mirrored": True})
    page_table.PageTable.__init__ = mirrored


# ============================================================================ a case
def make_case(job: dict, case: int, vocab: int, max_len: int) -> dict:
    """The requests of case ``case`` (a function of the job's seed and the case alone): prompts,
    sampling, and for det mode arrival steps, aborts and stop positions."""
    s = job["shape"]
    rng = random.Random(job["seed"] * 1_000_003 + case)
    n = s["requests"]
    plens = lognormal(s["prompt"], s["prompt_cap"], n, rng)
    prompts = random_prompts(plens, vocab, rng.randrange(2**31))
    if s["prefix"]:
        system = random_prompts([s["prefix"]] * 3, vocab, rng.randrange(2**31))
        prompts = [system[i // 3 % 3] + p if i % 3 == 0 else p for i, p in enumerate(prompts)]
    outs = lognormal(s["output"], s["output_cap"], n, rng)
    outs = [max(2, min(o, max_len - len(p) - 1)) for p, o in zip(prompts, outs)]
    prompts = [p[:max_len - o - 1] for p, o in zip(prompts, outs)]
    sampled = [rng.random() < 0.3 for _ in range(n)]
    reqs = [{"prompt": p, "max_tokens": o, "temperature": 0.8 if t else 0.0, "seed": rng.randrange(2**31)}
            for p, o, t in zip(prompts, outs, sampled)]
    if job["mode"] == "det":
        span = 4 * s["output"]
        for r in reqs:
            r["arrive"] = 0 if rng.random() < 0.5 else rng.randrange(span)
            r["abort"] = r["arrive"] + rng.randrange(1, span) if rng.random() < 0.15 else None
            r["stop_at"] = rng.randrange(1, r["max_tokens"]) if rng.random() < 0.25 else None
    return {"case": case, "requests": reqs}


def params(r: dict, stop_token: int | None = None):
    from zipfusion import SamplingParams
    return SamplingParams(temperature=r["temperature"], seed=r["seed"], max_tokens=r["max_tokens"],
                          ignore_eos=True, stop_token_ids=[stop_token] if stop_token is not None else None)


def run_case(eng, c: dict, stressed: bool, reference: list | None) -> dict:
    """The case's requests run to the end: every request at once (the reference run and fast
    mode), or arriving and aborted at their steps with stops from ``reference`` (det mode's
    stressed runs). Returns outputs, finish reasons and the run's numbers."""
    det = stressed and "arrive" in c["requests"][0]
    pending = sorted(range(len(c["requests"])), key=lambda i: c["requests"][i].get("arrive", 0) if det else 0)
    reqs: dict[int, object] = {}
    stops = {}
    if det:
        for i, r in enumerate(c["requests"]):
            if r["stop_at"] is not None:
                ref = reference[i]["tokens"]
                k = next((j for j in range(r["stop_at"], len(ref)) if ref[j] not in ref[:j]), None)
                if k is not None:
                    stops[i] = (ref[k], k)
    if eng.device.type == "cuda":     # every run starts with the device idle and no chunk pending
        import torch
        torch.cuda.synchronize()
    DELAYS.clock[0] += DELAYS.max_lag + 1
    digest, steps, t0 = [], 0, time.perf_counter()
    eng.reset_stats()
    restore_state(eng)
    before = eng.kv_stats()
    while pending or eng.has_work():
        while pending and (not det or c["requests"][pending[0]].get("arrive", 0) <= steps):
            i = pending.pop(0)
            reqs[i] = eng.add_request(c["requests"][i]["prompt"],
                                      params(c["requests"][i], stops[i][0] if i in stops else None))
        if det:
            for i, r in enumerate(c["requests"]):
                if r["abort"] == steps and i in reqs:
                    eng.abort(reqs[i])
        if not eng.has_work():
            steps += 1
            continue
        res = eng.step()
        steps += 1
        DELAYS.clock[0] += 1
        digest.append((res.decode_rows, res.prefill_tokens, res.preempted))
    seconds = time.perf_counter() - t0
    after = eng.kv_stats()
    out = [{"tokens": list(reqs[i].output_ids), "finish": reqs[i].finish_reason}
           for i in range(len(c["requests"]))]
    return {"outputs": out, "stops": {i: k for i, (_, k) in stops.items()}, "seconds": seconds, "steps": steps,
            "digest": hash(tuple(digest)), "preemptions": eng.scheduler.num_preemptions,
            **{k: after[k] - before.get(k, 0) for k in COUNTERS if k in after}, "leak": leaked_pages(eng)}


_FRESH: dict = {}       # id(object) -> its numbers before the engine's first run


def restore_state(eng) -> None:
    """The numbers the scheduler, admission and the page store learn as they run (admission's
    margin, the seal's wait counters, ...) put back to what they were before the engine's first
    run, so that every run of a case starts from them."""
    s = eng.scheduler
    for obj in (s, getattr(s, "admission", None), getattr(s, "pages", None)):
        if obj is None:
            continue
        if id(obj) not in _FRESH:
            _FRESH[id(obj)] = {k: v for k, v in vars(obj).items() if type(v) in (int, float, bool)}
        vars(obj).update(_FRESH[id(obj)])


def leaked_pages(eng) -> int | None:
    """Pages still in use once the engine is idle and its prefix cache dropped (the CUDA graphs'
    scratch page aside): must be 0."""
    if eng.has_work():
        return -1
    eng.scheduler.reset_prefix_cache()
    try:
        return eng.cache.stats()["pages_in_use"] - len(eng.runner._scratch)
    except (AttributeError, KeyError):
        return None


def compare(c: dict, ref: list, got: dict, fault: bool) -> str | None:
    """Why the stressed run's tokens are wrong, or None."""
    outs = got["outputs"]
    if fault and outs[0]["tokens"]:                          # --fault mismatch
        outs[0]["tokens"][-1] += 1
    for i, (r, a, b) in enumerate(zip(c["requests"], ref, outs)):
        want, finish = a["tokens"], a["finish"]
        if i in got["stops"]:
            want, finish = want[:got["stops"][i] + 1], "stop"
        if b["finish"] == "abort" and r.get("abort") is not None:
            if b["tokens"] != want[:len(b["tokens"])]:
                return f"request {i} (aborted): tokens are not a prefix of the reference's"
            continue
        if b["tokens"] != want or b["finish"] != finish:
            j = next((j for j, (x, y) in enumerate(zip(b["tokens"], want)) if x != y), min(len(b["tokens"]), len(want)))
            return (f"request {i}: {len(b['tokens'])} tokens ({b['finish']}) vs the reference's {len(want)} "
                    f"({finish}), first difference at {j}")
    return None


# ============================================================================ the worker
DELAYS: Delays


def build(job: dict):
    import torch
    from zipfusion import LLM
    s = job["shape"]
    cuda = job["device"] != "cpu" and torch.cuda.is_available()
    global DELAYS
    DELAYS = Delays(cuda, job["prob"], job["max_ms"], job["max_lag"])
    if not cuda:
        mirror_page_tables()
        torch.set_num_threads(1)        # small steps: threads would only spin (benchmarks/cpu_threads.py)
    max_len = s["prompt_cap"] + s["prefix"] + s["output_cap"] + 16
    opts = dict(device=job["device"], kv_memory_gb=s["kv_gb"], max_model_len=max_len, max_num_seqs=64,
                max_num_batched_tokens=s["batched"], check_pages=True, async_scheduling=True,
                deterministic=job["mode"] == "det", admission="optimistic" if job["mode"] == "det" else "estimate",
                watchdog_timeout_s=job["build_timeout"])      # the step's limit once the kernels are built
    if "chunk_bytes" in s:
        opts["chunk_bytes"] = s["chunk_bytes"]
    if "host_gb" in s:
        opts["kv_host_memory_gb"] = s["host_gb"]
    llm = LLM(job["model"], **{**opts, **job["engine"]})
    return llm.engine, max_len


def worker(job: dict) -> None:
    """Cases from ``job["first_case"]`` until ``job["deadline"]`` (time.time()) or ``job["cases"]``
    cases: ``START``/``RUN`` lines on stdout, one JSON each."""
    import torch
    faulthandler.enable()                   # a fatal error (a segfault) leaves the stacks too
    t0 = time.perf_counter()
    eng, max_len = build(job)
    fault = {}
    missing = install(eng, DELAYS, fault)
    eng.async_scheduling = False            # a first run off the record: a fresh engine's first
    t1 = time.perf_counter()                # schedules differ (and its kernels build)
    run_case(eng, make_case(job, -1, eng.model_config.vocab_size, max_len), False, None)
    warm_s = time.perf_counter() - t1
    if getattr(eng, "watchdog", None) is not None:
        eng.watchdog.timeout_s = job["shape"]["step_timeout"]
    emit("READY", {"build_s": t1 - t0, "warm_up_s": warm_s, "unhooked": missing,
                   "device": torch.cuda.get_device_name() if DELAYS.cuda else "cpu",
                   "kv_memory_gb": eng.kv_memory_gb, "max_model_len": max_len})
    timeout = job["shape"]["run_timeout"]
    last = job["first_case"] + job["cases"] if job.get("cases") else None
    case = job["first_case"]
    longest = 0.0                            # the longest run of this worker so far

    def time_left() -> bool:                  # another run fits before the deadline
        return bool(job.get("cases")) or time.time() + 1.2 * longest < job["deadline"]
    while (last is None or case < last) and time_left():
        c = make_case(job, case, eng.model_config.vocab_size, max_len)
        ref = None
        for variant in range(job["variants"] + 1):
            stressed = variant > 0
            if stressed and not time_left():
                break
            seed = (job["seed"] * 1_000_003 + case) * 97 + variant
            head = {"mode": job["mode"], "case": case, "variant": variant, "seed": seed}
            emit("START", head)
            eng.async_scheduling = stressed
            fault["hang_now"] = job.get("fault") == "hang" and stressed and case == 0
            if stressed:
                DELAYS.start(seed)
            faulthandler.dump_traceback_later(timeout, exit=True)
            try:
                got = run_case(eng, c, stressed, ref)
            except BaseException as exc:
                faulthandler.cancel_dump_traceback_later()
                import traceback
                emit("RUN", {**head, "verdict": "error", "detail": f"{type(exc).__name__}: {exc}"[:2000],
                             "traceback": traceback.format_exc()[-6000:]})
                return                                  # the engine (and on CUDA the context) is suspect
            finally:
                DELAYS.active = False
            faulthandler.cancel_dump_traceback_later()
            longest = max(longest, got["seconds"]) if variant else got["seconds"]
            rec = {**head, **{k: v for k, v in got.items() if k not in ("outputs", "stops", "digest")},
                   "tokens": sum(len(o["tokens"]) for o in got["outputs"]),
                   "aborted": sum(o["finish"] == "abort" for o in got["outputs"]),
                   "stopped": sum(o["finish"] == "stop" for o in got["outputs"])}
            if not stressed:
                ref, ref_digest = got["outputs"], got["digest"]
                rec["verdict"] = "reference"
            else:
                why = compare(c, ref, got, job.get("fault") == "mismatch" and case == 0)
                rec.update(delays=dict(DELAYS.counts), device_waits=DELAYS.waits[0],
                           same_schedule=got["digest"] == ref_digest if job["mode"] == "fast" else None)
                leak = f"{got['leak']} pages still in use after the run" if got["leak"] else None
                # fast mode: other tokens under another schedule are rounding (batch composition), not a fault
                diverged = why and not leak and rec["same_schedule"] is False
                why = why or leak
                rec["verdict"] = "diverged" if diverged else "mismatch" if why else "ok"
                if why:
                    rec["detail"] = why
            emit("RUN", rec)
        case += 1
    emit("DONE", {})


def emit(kind: str, obj: dict) -> None:
    print(kind + " " + json.dumps(obj, default=str), flush=True)


# ============================================================================ the driver
def gpu_snapshot() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def start_worker(job: dict, err_path: str):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(job)]
    err = open(err_path, "w")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=child_environment(),
                         preexec_fn=die_with_parent)
    lines: queue.Queue = queue.Queue()

    def pump():
        for line in p.stdout:
            lines.put(line)
        lines.put(None)
    threading.Thread(target=pump, daemon=True).start()
    return p, lines, err


def drive(job: dict, budget_s: float, out: str, result: dict, build_timeout: float) -> None:
    """Workers of ``job`` (one engine each) until ``budget_s`` is spent or ``job["cases"]`` cases
    ran; each run's record into ``result``."""
    t_end = time.time() + budget_s
    case, stop_at = job["first_case"], job["first_case"] + job["cases"] if job.get("cases") else None
    timeout, cuda = job["shape"]["run_timeout"], job["device"] != "cpu"
    need = 20.0                                 # s a new worker needs to build and run (from the last one)
    while time.time() < t_end - need and (stop_at is None or case < stop_at):
        n = len(result["workers"])
        err_path = os.path.join(out, f"worker_{n}.err")
        spec = {**job, "first_case": case, "deadline": t_end,
                "cases": (stop_at - case) if stop_at else None}
        p, lines, err = start_worker(spec, err_path)
        info = {"mode": job["mode"], "first_case": case, "stderr": err_path}
        result["workers"].append(info)
        current, since, snap, snapped, end = None, time.time(), None, time.time(), None
        while True:
            limit = build_timeout if "build_s" not in info else timeout + 15
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                line = ""
            now = time.time()
            if line is None:
                end = "exit"
                break
            if not line:
                if current and cuda and now - snapped > 10:
                    snap, snapped = gpu_snapshot(), now      # is the GPU busy (a kernel runs on) or idle?
                if now - since > limit:
                    end = "killed"
                    break
                continue
            kind, _, body = line.partition(" ")
            try:
                obj = json.loads(body)
            except json.JSONDecodeError:
                continue
            since = now
            if kind == "READY":
                info.update(obj)
                need = obj["build_s"] + obj["warm_up_s"]
                log(f"[{job['mode']}] engine built in {obj['build_s']:.0f} s on {obj['device']} (a first run "
                    f"{obj['warm_up_s']:.0f} s), KV {obj['kv_memory_gb']:.3g} GiB"
                    + (f"; not hooked: {obj['unhooked']}" if obj["unhooked"] else ""))
            elif kind == "START":
                current, snap = obj, None
                result["in_progress"] = {**obj, "since": time.strftime("%H:%M:%S", time.gmtime(now))}
                write_json(result, os.path.join(out, "async_stress.json"))   # (a driver killed now leaves it)
            elif kind == "RUN":
                current = None
                record(result, obj, spec, out)
                case = obj["case"] + 1 if obj["verdict"] == "error" else obj["case"]
                if obj["verdict"] == "error":
                    break
            elif kind == "DONE":
                end = "done"
                break
        if p.poll() is None:
            if end == "killed":
                p.kill()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        err.close()
        info["exit"] = p.returncode
        if current is not None:                  # it died or was killed inside a run: a hang (or a crash)
            tail = open(err_path, errors="replace").read()[-12000:]
            hung = end == "killed" or "Timeout (" in tail or p.returncode == 70
            rec = {**current, "verdict": "hang" if hung else "error", "exit": p.returncode,
                   "seconds": time.time() - since if end == "killed" else timeout, "gpu": snap,
                   "detail": ("a step stalled past the step timeout (the engine's watchdog)" if p.returncode == 70
                              else "the run did not finish within the run timeout") if hung
                   else f"worker exit {p.returncode}",
                   "stacks": tail, "replay": replay_line(spec, current)}
            record(result, rec, spec, out)
            case = current["case"] + 1
        elif end in ("exit", "killed") and "build_s" not in info:
            tail = open(err_path, errors="replace").read()[-6000:]
            result["errors"].append({"mode": job["mode"], "case": case, "variant": None, "stacks": tail,
                                     "detail": f"the worker did not start (exit {p.returncode}): "
                                               + (tail.strip().splitlines() or ["?"])[-1]})
            log(f"[{job['mode']}] the worker did not start: see {err_path}")
            return
        result["seconds"] = time.time() - result["t0"]
        write_json(result, os.path.join(out, "async_stress.json"))
        if end == "done":
            return


def replay_line(job: dict, run: dict) -> str:
    """The command that runs the worker's cases again, from its first up to ``run``'s: the
    engine's state at a run follows from every run before it on that engine."""
    spec = {k: job[k] for k in ("mode", "model", "device", "seed", "shape", "variants", "prob", "max_ms",
                                "max_lag", "engine", "build_timeout", "first_case")}
    spec["cases"] = run["case"] - job["first_case"] + 1
    return f"python3 benchmarks/async_stress.py --replay {shlex.quote(json.dumps(spec))}"


def record(result: dict, rec: dict, job: dict, out: str) -> None:
    result["records"].append(rec)
    result["in_progress"] = None
    v = rec["verdict"]
    if v in ("mismatch", "error", "hang", "diverged"):
        rec.setdefault("replay", replay_line(job, rec))
        result[{"mismatch": "mismatches", "error": "errors", "hang": "hangs", "diverged": "diverged"}[v]].append(rec)
    result["seconds"] = time.time() - result["t0"]
    write_json(result, os.path.join(out, "async_stress.json"))     # kept as it goes: a run cut short has it
    el = time.time() - result["t0"]
    n = sum(bool(r["variant"]) for r in result["records"])
    what = v
    more = ""
    if v in ("ok", "mismatch", "diverged"):
        d = dict(rec["delays"])
        pend = d.pop("take_with_pending", 0)
        more = (f" {rec['seconds']:.1f} s, {rec['steps']} steps, {rec['preemptions']} preempted, "
                f"{rec.get('compactions', '?')} compactions, {rec['aborted']} aborted, {rec['stopped']} stopped, "
                f"{sum(d.values())} delays, {pend} takes with chunks pending")
        if rec.get("same_schedule") is False:
            more += ", schedule differed"
    elif v == "reference":
        more = f" {rec['seconds']:.1f} s, {rec['steps']} steps, {rec['preemptions']} preempted"
    log(f"[{n:4d} | {el / 60:4.1f} min] {rec['mode']} case {rec['case']} v{rec['variant']}: {what}{more}"
        + (f": {rec.get('detail', '')[:200]}" if v not in ("ok", "reference") else ""))


def summary(result: dict) -> str:
    """The rarity line and the table."""
    n = sum(bool(r["variant"]) for r in result["records"])
    cut = result.get("in_progress")
    rows = [f"async stress: {n} stressed runs in {result['seconds'] / 60:.1f} min; {rarity(result)}"
            + (f"\nCUT SHORT inside {cut['mode']} case {cut['case']} v{cut['variant']} (started {cut['since']} UTC): "
               f"a hang the run's limits did not reach? see the worker's stderr" if cut else ""),
            "| mode | stressed runs | reference runs | hangs | mismatches | errors | "
            "schedule differed (other tokens) | steps (stressed) | median run s | preemptions |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    recs = result["records"]
    for mode in sorted({r["mode"] for r in recs}) + ["all"]:
        rs = [r for r in recs if mode in ("all", r["mode"])]
        st = [r for r in rs if r["variant"]]
        secs = sorted(r["seconds"] for r in st if r.get("seconds") is not None and r["verdict"] != "hang")
        count = lambda v: sum(r["verdict"] == v for r in rs)     # noqa: E731
        rows.append(f"| {mode} | {len(st)} | {len(rs) - len(st)} | {count('hang')} | {count('mismatch')} | "
                    f"{count('error')} | {sum(r.get('same_schedule') is False for r in st)} ({count('diverged')}) | "
                    f"{sum(r.get('steps') or 0 for r in st)} | {secs[len(secs) // 2] if secs else 0:.1f} | "
                    f"{sum(r.get('preemptions') or 0 for r in rs)} |")
    return "\n".join(rows)


def rarity(result: dict) -> str:
    """The hang rate this run bounds: with none in N stressed runs, fewer than 3/N a run at 95 %
    (the rule of three); with k, k/N."""
    st = [r for r in result["records"] if r["variant"]]
    n, k = len(st), sum(r["verdict"] == "hang" for r in st)
    steps = sum(r.get("steps") or 0 for r in st)
    plain = sum(r["verdict"] == "hang" and not r["variant"] for r in result["records"])
    if plain:
        return f"{plain} hang(s) in the plain order (reference runs) and {k} in {n} stressed runs"
    if not n:
        return "no stressed run finished"
    if k:
        return f"{k} hang(s) in {n} stressed runs ({steps} steps): {k / n:.3g} a run"
    return (f"no hang in {n} stressed runs ({steps} engine steps): the hang rate is below "
            f"{3 / n:.3g} a run and {3 / max(steps, 1):.2g} a step (95 %, rule of three)")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="async_stress_out")
    ap.add_argument("--model", default=None, help="default: llama-3.1-8b-random (--smoke: demo)")
    ap.add_argument("--device", default=None, help="default: cuda (--smoke: cpu)")
    ap.add_argument("--smoke", action="store_true", help="the demo model on the CPU, tiny sizes")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="mixed")
    ap.add_argument("--modes", default="fast,det")
    ap.add_argument("--minutes", type=float, default=None, help="time budget (default: 6; with --cases none)")
    ap.add_argument("--cases", type=int, default=None, help="cases per mode (each: a reference + --variants runs)")
    ap.add_argument("--variants", type=int, default=2, help="stressed runs per case")
    ap.add_argument("--prob", type=float, default=0.35, help="chance of a delay at each point")
    ap.add_argument("--max-ms", type=float, default=6.0, help="longest device delay (ms)")
    ap.add_argument("--max-lag", type=int, default=4, help="CPU: most steps a released chunk stays pending")
    ap.add_argument("--kv-gb", type=float, default=None, help="KV GiB (default: the shape's)")
    ap.add_argument("--requests", type=int, default=None, help="requests a case (default: the shape's)")
    ap.add_argument("--run-timeout", type=float, default=None, help="s a run may take (default: the shape's)")
    ap.add_argument("--step-timeout", type=float, default=None, help="s one engine step may take (default: the "
                                                                     "shape's)")
    ap.add_argument("--build-timeout", type=float, default=600)
    ap.add_argument("--engine-args", default="{}", help="JSON of more LLM options")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fault", choices=FAULTS, default=None, help="inject a hang or a wrong token (self-check)")
    ap.add_argument("--replay", default=None, help="a failed run's spec (its replay line): run that case alone")
    ap.add_argument("--summarize", default=None, help="print the table of DIR/async_stress.json (a run cut short)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    for name, lo in (("variants", 1), ("prob", 0), ("max_ms", 0), ("max_lag", 0)):
        if getattr(a, name) < lo:
            ap.error(f"--{name.replace('_', '-')} must be >= {lo}")
    if not 0 <= a.prob <= 1:
        ap.error("--prob is a probability: give 0..1")
    bad = set(a.modes.split(",")) - {"fast", "det"}
    if bad:
        ap.error(f"--modes: unknown {sorted(bad)}; give fast, det or both")
    try:
        a.engine = json.loads(a.engine_args)
    except json.JSONDecodeError as e:
        ap.error(f"--engine-args is not JSON ({e}); give e.g. '{{\"enforce_eager\": true}}'")
    return a


def main(argv=None) -> int:
    a = parse(argv)
    if a.worker:
        worker(json.loads(a.worker))
        return 0
    if a.summarize:
        with open(os.path.join(a.summarize, "async_stress.json")) as f:
            print(summary(json.load(f)))
        return 0
    os.makedirs(a.out, exist_ok=True)
    if a.replay:
        spec = json.loads(a.replay)
        jobs = [spec]
        budget = None
    else:
        shape = dict((SMOKE if a.smoke else SHAPES)[a.shape])
        if a.kv_gb:
            shape["kv_gb"] = a.kv_gb
        for key in ("requests", "run_timeout", "step_timeout"):
            if getattr(a, key):
                shape[key] = getattr(a, key)
        base = {"model": a.model or ("demo" if a.smoke else "llama-3.1-8b-random"),
                "device": a.device or ("cpu" if a.smoke else "cuda"), "seed": a.seed, "shape": shape,
                "shape_name": a.shape, "variants": a.variants, "prob": a.prob, "max_ms": a.max_ms,
                "max_lag": a.max_lag, "engine": a.engine, "fault": a.fault, "first_case": 0, "cases": a.cases,
                "build_timeout": a.build_timeout}
        jobs = [{**base, "mode": m} for m in a.modes.split(",")]
        budget = None if a.cases and a.minutes is None else 60 * (a.minutes or 6.0)
    result = {"meta": {"argv": sys.argv[1:], "versions": versions(), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                                          time.gmtime())},
              "t0": time.time(), "seconds": 0.0, "workers": [], "records": [], "hangs": [], "mismatches": [],
              "diverged": [], "errors": []}
    for i, job in enumerate(jobs):
        share = (budget - (time.time() - result["t0"])) / (len(jobs) - i) if budget else 1e9
        drive(job, share, a.out, result, a.build_timeout)
    st = [r for r in result["records"] if r["variant"]]
    result.update(seconds=time.time() - result["t0"], runs=len(st), reference_runs=len(result["records"]) - len(st),
                  seeds=sorted({r["seed"] for r in st}), rarity=rarity(result),
                  passed=bool(st) and not (result["hangs"] or result["mismatches"] or result["errors"]))
    write_json(result, os.path.join(a.out, "async_stress.json"))
    for r in result["hangs"] + result["mismatches"] + result["errors"] + result["diverged"]:
        print(f"{r.get('verdict', 'error')}: {r.get('mode')} case {r.get('case')} v{r.get('variant')}: "
              f"{r.get('detail', '')[:300]}\n  replay: {r.get('replay', '-')}")
    print("\n" + summary(result))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
