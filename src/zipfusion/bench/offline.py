"""The offline harness of ``zipfusion bench throughput`` / ``latency`` and benchmarks/workloads.py: a
warmed-up engine, every step's numbers, each (workload, mode) in its own worker process.
"""

from __future__ import annotations

import collections
import faulthandler
import hashlib
import importlib
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import NamedTuple

from .process import child_environment
from .stats import percentile

STEP_FIELDS = ("decode_rows", "prefill_tokens", "running", "preempted", "sealed_pages", "seconds", "schedule_s",
               "forward_s", "seal_s", "ahead_s", "recomputed_tokens", "context_tokens", "finish_s")  # a step log's columns


class Step(NamedTuple):
    decode_rows: int
    prefill_tokens: int
    running: int
    preempted: int
    sealed_pages: int
    recomputed_tokens: int
    context_tokens: int
    start: float
    seconds: float
    schedule_s: float
    forward_s: float
    seal_s: float
    ahead_s: float
    finish_s: float


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def greedy(max_tokens: int):
    """Greedy sampling of exactly ``max_tokens`` tokens (``ignore_eos``)."""
    from .. import SamplingParams
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def warm_up(eng, max_len: int) -> None:
    """Build kernels and graphs for every step shape a run will see, outside the numbers, then
    reset the engine's counters."""
    import torch
    vocab, batched = eng.model_config.vocab_size, eng.config.max_num_batched_tokens
    decode = 20 if eng.device.type == "cuda" else 3
    g = torch.Generator().manual_seed(12345)
    rand = lambda n: torch.randint(10, vocab - 10, (n,), generator=g).tolist()  # noqa: E731
    first = eng.add_request(rand(min(1024, max_len // 2)), greedy(2 * decode))
    while len(first.output_ids) < decode:
        eng.step()
    eng.add_request(rand(max(1, min(batched + batched // 8, max_len - 8))), greedy(4))
    while eng.has_work():
        eng.step()
    for n in (40, 300):
        n = min(n, max_len - 4 - len(first.prompt_ids))
        if n > 0:
            eng.add_request(first.prompt_ids + rand(n), greedy(2))
    while eng.has_work():
        eng.step()
    eng.reset_stats()
    if eng.host_tier is not None:
        eng.host_tier.start(wait=True)


def run_requests(eng, prompts, outs, sequential=False, on_step=None, progress_s=20.0, label="", turns=None,
                 max_in_flight=None):
    """Run requests to the end: all at once, ``sequential``, or a closed loop of
    ``max_in_flight``; ``turns[i]`` continues request i's conversation. Returns (requests,
    steps, wall seconds)."""
    steps, reqs, follow = [], [], {}
    observe = lambda res, stats: steps.append(Step(*res[3:], *stats))  # noqa: E731  (the engine's observer)
    eng.add_observer(observe)
    t0 = last = time.perf_counter()
    pending = list(zip(prompts, outs, turns or [[]] * len(prompts)))
    cap = 1 if sequential else max_in_flight
    in_flight = 0
    try:
        while pending or eng.has_work():
            if pending:
                batch = pending[:len(pending) if cap is None else max(0, cap - in_flight)]
                for p, o, more in batch:
                    reqs.append(eng.add_request(p, greedy(o)))
                    follow[reqs[-1].request_id] = (o, more)
                pending = pending[len(batch):]
                in_flight += len(batch)
            res = eng.step()
            in_flight -= len(res.finished)
            for r in res.finished:
                o, more = follow.pop(r.request_id)
                if more:
                    pending.append((r.prompt_ids + r.output_ids + more[0], o, more[1:]))
            if on_step is not None:
                on_step(eng, res)
            if time.perf_counter() - last > progress_s:
                last = time.perf_counter()
                done = sum(r.finish_reason is not None for r in reqs)
                made = sum(len(r.output_ids) for r in reqs)
                eta = (last - t0) * (sum(outs) - made) / made if made else None
                log(f"  {label} {last - t0:.0f} s: {done}/{len(prompts)} requests done, {len(steps)} steps, "
                    f"{res.running} running, {eng.scheduler.num_preemptions} preemptions"
                    + (f"; about {eta:.0f} s left at this rate" if eta is not None else ""))
    finally:
        eng.remove_observer(observe)
    return reqs, steps, time.perf_counter() - t0


def kv_numbers(eng) -> dict:
    """The KV numbers at the busiest step: bytes in use, stored / open size, compressible share."""
    kv = eng.peak_kv_stats or eng.cache.stats()
    fracs = [x["compressible_fraction"] for x in kv.get("layers", [])
             if x["compressible_fraction"] == x["compressible_fraction"]]
    return {"kv_bytes_at_peak": kv.get("bytes_in_use", 0),
            "compressible_fraction": statistics.mean(fracs) if fracs else float("nan"),
            "stored_ratio": kv.get("stored_ratio", 1.0)}


def summarize(eng, reqs, steps, wall: float, base: dict) -> dict:
    """A run's numbers; ``base``: cache.stats() after the warm-up."""
    dec = [x for x in steps if x.prefill_tokens == 0 and x.decode_rows > 0]
    dec_s = sum(x.seconds for x in dec)
    pre = [x for x in steps if x.prefill_tokens > 0]
    peak = max((x.running for x in steps), default=0)
    at_peak = [x.decode_rows / x.seconds for x in dec if x.decode_rows >= 0.9 * peak and x.seconds > 0]
    out_tokens = sum(len(r.output_ids) for r in reqs)
    prompt_tokens = sum(len(r.prompt_ids) for r in reqs)
    ttft = [r.token_times[0] - r.arrival_time for r in reqs if r.token_times]
    itl = [b - a for r in reqs for a, b in zip(r.token_times, r.token_times[1:])]
    now = eng.cache.stats()
    computed = sum(x.prefill_tokens for x in steps)
    nan = float("nan")
    hit = [r.token_times[0] - r.arrival_time for r in reqs if r.token_times and r.num_cached_tokens]
    miss = [r.token_times[0] - r.arrival_time for r in reqs if r.token_times and not r.num_cached_tokens]
    pc = eng.reuse_stats()
    # what preemption cost: recomputed prefill's step seconds and the host tier's transfers (an upper bound)
    recompute_s = sum(x.seconds * x.recomputed_tokens / x.prefill_tokens for x in pre if x.recomputed_tokens)
    swap_s = sum(pc.get(f"swap_{d}_{w}_s", 0.0) for d in ("out", "in") for w in ("host", "device"))
    return {
        "requests": len(reqs), "wall_s": wall, "prompt_tokens": prompt_tokens, "output_tokens": out_tokens,
        "total_tok_s": (prompt_tokens + out_tokens) / wall, "output_tok_s": out_tokens / wall,
        "requests_s": len(reqs) / wall,
        "decode_tok_s": sum(x.decode_rows for x in dec) / dec_s if dec_s else nan,
        "decode_tok_s_at_peak_batch": statistics.median(at_peak) if at_peak else nan,
        "peak_batch": peak, "mean_batch": statistics.mean(x.decode_rows for x in dec) if dec else 0.0,
        "preemptions": eng.scheduler.num_preemptions,
        "prefill_tokens_computed": computed, "recompute_ratio": computed / prompt_tokens if prompt_tokens else nan,
        "prefill_steps_s": sum(x.seconds for x in pre), "decode_steps_s": dec_s,
        "prefill_step_s_p50": statistics.median(x.seconds for x in pre) if pre else nan,
        "seal_s": sum(x.seal_s for x in steps), "schedule_s": sum(x.schedule_s for x in steps),
        "forward_s": sum(x.forward_s for x in steps), "ahead_s": sum(x.ahead_s for x in steps),
        "finish_s": sum(x.finish_s for x in steps),
        "sealed_pages": sum(x.sealed_pages for x in steps),
        "pages_compressed": now.get("pages_compressed", 0) - base.get("pages_compressed", 0),
        "compactions": now.get("compactions", 0) - base.get("compactions", 0),
        "compaction_bytes": now.get("bytes_moved", 0) - base.get("bytes_moved", 0),
        "pages_reclaimed": now.get("pages_reclaimed", 0) - base.get("pages_reclaimed", 0),
        **kv_numbers(eng),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
        "steps": len(steps), "decode_steps": len(dec), "prefill_steps": len(pre),
        "prefix_cache": pc["prefix_cache_enabled"], "prefix_hit_tokens": pc["prefix_cache_hit_tokens"],
        "prefix_hit_rate": pc["prefix_cache_hit_rate"], "prefix_evicted_pages": pc["prefix_cache_evicted_pages"],
        "ttft_hit_p50_s": percentile(hit, 50), "ttft_miss_p50_s": percentile(miss, 50), "hits": len(hit),
        "swapped_in_pages": pc.get("swapped_in_pages", 0), "swapped_out_pages": pc.get("swapped_out_pages", 0),
        "swapped_in_bytes": pc.get("swapped_in_bytes", 0),
        "recomputed_tokens": sum(x.recomputed_tokens for x in steps), "recompute_s": recompute_s,
        "swap_s": swap_s, "preemption_s": recompute_s + swap_s,
        "outputs_sha256": outputs_sha256(reqs),
    }


def weight_numbers(eng) -> dict:
    w = eng.weights
    return {"weights_gb": w.original_bytes / 2**30, "weights_stored_gb": w.stored_bytes / 2**30,
            "weights_ratio": w.ratio, "weights_compressed_tensors": w.compressed}


def outputs_sha256(reqs) -> str:
    """One hash of every request's output ids, in order."""
    return hashlib.sha256(json.dumps([list(r.output_ids) for r in reqs]).encode()).hexdigest()


def step_rows(steps) -> list:
    return [[round(v, 6) if isinstance(v, float) else v for v in (getattr(x, f) for f in STEP_FIELDS)] for x in steps]


def device_name(eng) -> str:
    import torch
    return torch.cuda.get_device_name(eng.device) if eng.device.type == "cuda" else "cpu"


def die_with_parent() -> None:
    """A ``preexec_fn``: SIGTERM the child when its parent dies (Linux), so no worker outlives it."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def run_worker(cmd: list[str], timeout: float, threads: int = 0) -> dict:
    """``cmd`` (a worker) in its own process, stderr shown as it comes: its ``RESULT`` dict, or
    ``{"error": ...}`` when it failed or ran past ``timeout``; ``process_s`` either way."""
    tail = collections.deque(maxlen=80)
    t0 = time.perf_counter()
    env = child_environment(**({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    with tempfile.TemporaryFile("w+") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=die_with_parent)

        def pump():
            for line in p.stderr:
                tail.append(line)
                sys.stderr.write("    " + line)
        th = threading.Thread(target=pump, daemon=True)
        th.start()
        timed_out = False
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        except BaseException:  # SIGTERM or Ctrl-C: leave no worker behind
            p.kill()
            raise
        finally:
            if p.poll() is None:
                p.kill()
            p.wait()
        th.join(5)
        out.seek(0)
        lines = [ln for ln in out.read().splitlines() if ln.startswith("RESULT ")]
    seconds = time.perf_counter() - t0
    if timed_out:
        return {"error": f"timed out after {timeout:g} s; last output: {''.join(tail)[-3000:]}", "process_s": seconds}
    if p.returncode or not lines:
        return {"error": f"worker exit {p.returncode}: {''.join(tail)[-1500:]}", "process_s": seconds}
    return {**json.loads(lines[-1][len("RESULT "):]), "process_s": seconds}


def run_job(kind: str, job: dict, timeout: float, threads: int = 0) -> dict:
    """A ``zipfusion bench`` worker in its own process (thread stacks dumped before its time is up)."""
    cmd = [sys.executable, "-m", __name__, kind, json.dumps(job), str(max(1.0, timeout - 5))]
    return run_worker(cmd, timeout, threads)


def run_modes(kind: str, modes: list[str], job: dict, timeout: float, describe) -> list[dict]:
    """One worker per mode in turn (a mode that cannot run here is skipped with the reason)."""
    from . import FLASHINFER_MODES, flashinfer_skip_reason
    records = []
    for i, mode in enumerate(modes):
        why = flashinfer_skip_reason(job["device"], job.get("deterministic", False)) if mode in FLASHINFER_MODES else None
        if why:
            log(f"[{i + 1}/{len(modes)}] {mode}: skipped ({why})")
            records.append({"mode": mode, "skipped": why})
            continue
        log(f"[{i + 1}/{len(modes)}] {mode}: starting its own process ...")
        rec = {**run_job(kind, {**job, "mode": mode}, timeout), "mode": mode}
        if "error" in rec:
            log(f"  {mode} FAILED after {rec['process_s']:.0f} s: {rec['error'][-400:]}")
        else:
            log(f"  {mode} done in {rec['process_s']:.0f} s: {describe(rec)}")
        records.append(rec)
    return records


def note(rec: dict) -> str:
    """Why a record has no numbers: its skip reason, or the last line of its error."""
    if "skipped" in rec:
        return "skipped: " + rec["skipped"]
    lines = rec.get("error", "").strip().splitlines() or ["?"]
    return "FAILED: " + lines[-1][:160]


def worker_main(argv: list[str]) -> None:
    """``python -m zipfusion.bench.offline KIND JOB SECONDS``."""
    kind, job, seconds = argv
    if kind not in ("throughput", "latency"):
        raise SystemExit(f"unknown worker kind {kind!r}")
    faulthandler.dump_traceback_later(float(seconds))
    module = importlib.import_module(f"{__package__}.{kind}")
    print("RESULT " + json.dumps(module.worker(json.loads(job)), default=float), flush=True)


if __name__ == "__main__":
    worker_main(sys.argv[1:])
