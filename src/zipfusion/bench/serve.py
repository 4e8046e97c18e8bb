"""``zipfusion bench serve``: the serving benchmark, as ``vllm bench serve``.

Per mode it starts ``zipfusion serve`` in its own process on 127.0.0.1 (``--compare`` runs the
modes one after the other at the same ``--kv-memory-gb``), or uses ``--url`` of a running one.
Then, per request rate, it sends ``--num-prompts`` streaming /v1/completions requests (httpx
async; arrivals a Poisson process at that rate, ``inf``: all at once; ``--max-concurrency N``
caps those in flight: a closed loop at rate inf) of a synthetic dataset (:mod:`.datasets`; greedy,
``ignore_eos``, so every request generates exactly its output length). Per request: TTFT (send
to first token), the gaps between streamed chunks (ITL), TPOT ((last - first token) / (tokens -
1)) and the end-to-end latency; per rate their mean / p50 / p90 / p99, output and total tokens/s,
requests/s and goodput (requests/s meeting ``--goodput``'s SLO), requests that failed (an error)
or were lost (no error, but not all their tokens), the server's /metrics (preemptions, the peak
of running and waiting requests, KV usage, stored ratio and compressible fraction, sampled while
the rate runs) and the server process's memory (RSS, and on CUDA the GPU's) after each rate:
it must stay flat. ``--sweep`` finds the saturation (the request rate sustained with every
request at once), then runs fractions of it up to 2x (``--sweep-points``).

Only loopback (or ``--url``) traffic; every wait has a bound (``--timeout`` per request,
``--startup-timeout`` for the server).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import warnings
import zlib

from ..config import child_environment, visible_gpus
from . import MODES, datasets, flashinfer_skip_reason, report
from .offline import die_with_parent, note
from .stats import goodput, summary

LOG = "zipfusion bench serve"
GIB = 2**30
MIB = 2**20
# sizes a server takes from the bench's own options (the rest: --server-args)
SIZE_FLAGS = ("kv_memory_gb", "max_num_seqs", "max_num_batched_tokens", "max_model_len")
RATIO_KEYS = {"max_rate_within_slo": "max rate in SLO", "max_goodput_req_s": "max goodput",
              "max_output_tok_s": "output tok/s at saturation", "max_requests_s": "req/s at saturation",
              "peak_running": "peak batch"}


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:.3g}"


def parse_rates(text: str) -> list[float]:
    """``1,2,4,inf`` -> [1.0, 2.0, 4.0, inf] (requests/s; inf: every request at once)."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        try:
            rate = float(part)
        except ValueError:
            rate = float("nan")
        if not rate > 0:
            raise ValueError(f"--request-rates takes rates > 0 in requests/s, or inf (e.g. 1,2,4,inf), got {part!r}")
        out.append(rate)
    return out


def parse_fractions(text: str) -> list[float]:
    try:
        out = sorted({float(p) for p in text.split(",") if p.strip()})
    except ValueError:
        out = []
    if not out or not all(0 < f < math.inf for f in out):
        raise ValueError(f"--sweep-points takes fractions of the saturation rate > 0 (e.g. 0.5,1,1.5,2), got {text!r}")
    return out


# ---------------------------------------------------------------------------------- the server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_memory(pid: int | None) -> dict:
    """A process's resident memory now and at its peak (MiB, Linux /proc), None elsewhere."""
    out = {"rss_mib": None, "rss_peak_mib": None}
    if pid is None:
        return out
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out["rss_mib" if key == "VmRSS" else "rss_peak_mib"] = int(value.split()[0]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def gpu_memory(pid: int | None, device: str) -> dict:
    """GPU memory (MiB, nvidia-smi) the server process holds, and the device's in use; {} off CUDA."""
    if not str(device).startswith("cuda"):
        return {}
    out = {"gpu_process_mib": None, "gpu_used_mib": None}
    index = str(device).partition(":")[2] or "0"
    visible = visible_gpus()
    if visible and visible[0].isdigit():
        index = visible[min(int(index), len(visible) - 1)]
    try:
        run = lambda *q: subprocess.run(["nvidia-smi", *q, "--format=csv,noheader,nounits"],  # noqa: E731
                                        capture_output=True, text=True, timeout=20).stdout
        for line in run("--query-compute-apps=pid,used_memory").splitlines():
            p, _, mib = line.partition(",")
            if p.strip() == str(pid):
                out["gpu_process_mib"] = float(mib)
        used = run("--query-gpu=memory.used", "-i", index).split()
        out["gpu_used_mib"] = float(used[0]) if used else None
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    return out


class Server:
    """A ``zipfusion serve`` process this benchmark started (or, ``proc`` None, one at ``url``)."""

    def __init__(self, url: str, proc: subprocess.Popen | None = None, log_path: str | None = None,
                 cmd: list[str] | None = None, device: str = "cpu"):
        self.url, self.proc, self.log_path, self.cmd, self.device = url, proc, log_path, cmd, device

    @classmethod
    def start(cls, model: str, device: str, flags: list[str], startup_timeout: float) -> "Server":
        import httpx
        port = free_port()
        cmd = [sys.executable, "-m", "zipfusion", "serve", "--model", model, "--device", device, "--host",
               "127.0.0.1", "--port", str(port), "--log-level", "warning", *flags]
        env = child_environment()
        fd, log_path = tempfile.mkstemp(prefix=f"zipfusion_bench_serve_{port}_", suffix=".log")
        with os.fdopen(fd, "w") as log_file:
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent)
        server = cls(f"http://127.0.0.1:{port}", proc, log_path, cmd, device)
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {proc.returncode} before it answered: "
                                   f"{server.log_tail()} (log: {log_path})")
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"the server did not answer /health within --startup-timeout "
                                   f"{startup_timeout:g} s (log: {log_path})")
            try:
                if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                    return server
            except httpx.HTTPError:
                pass
            time.sleep(0.25)

    def log_tail(self, lines: int = 3) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return " | ".join(line.strip() for line in f.read().splitlines()[-lines:] if line.strip())
        except (OSError, TypeError):
            return ""

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def memory(self) -> dict:
        return {**process_memory(self.pid), **gpu_memory(self.pid, self.device)}

    def settled_memory(self, seconds: float = 30.0) -> dict:
        """The memory once the process's RSS stops moving (a GPU server pins its host tier in the
        background after start-up): three readings half a second apart within 16 MiB, at most ``seconds``."""
        readings = []
        deadline = time.monotonic() + seconds
        while self.pid is not None and time.monotonic() < deadline:
            readings.append(process_memory(self.pid)["rss_mib"] or 0.0)
            if len(readings) >= 3 and max(readings[-3:]) - min(readings[-3:]) <= 16:
                break
            time.sleep(0.5)
        return self.memory()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def info(self) -> dict:
        return {"url": self.url, "command": " ".join(self.cmd) if self.cmd else None, "log": self.log_path}


def parse_metrics(text: str) -> dict:
    """The server's Prometheus text -> {name: value} (series of one name summed over labels but
    ``zipfusion:kv_compressible_fraction``, averaged over layers that stored pages)."""
    out, fracs = {}, []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (ValueError, IndexError):
            continue
        if name == "zipfusion:kv_compressible_fraction":
            if value == value:
                fracs.append(value)
        else:
            out[name] = out.get(name, 0.0) + value
    if fracs:
        out["zipfusion:kv_compressible_fraction"] = sum(fracs) / len(fracs)
    return out


async def scrape(client, url: str) -> dict:
    import httpx
    try:
        r = await client.get(url + "/metrics", timeout=30)
        return parse_metrics(r.text) if r.status_code == 200 else {}
    except httpx.HTTPError:
        return {}


class Sampler:
    """/metrics every ``interval`` seconds while a rate runs: the peaks of running and waiting
    requests and of KV usage, and the KV's stored ratio and compressible fraction at the sample
    with the most pages in use."""

    def __init__(self):
        self.samples = 0
        self.peak = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
        self.busiest = {}

    def add(self, m: dict) -> None:
        if not m:
            return
        self.samples += 1
        for key, name in (("running", "zipfusion:num_requests_running"), ("waiting", "zipfusion:num_requests_waiting"),
                          ("kv_usage", "zipfusion:kv_cache_usage_perc")):
            self.peak[key] = max(self.peak[key], m.get(name, 0.0))
        if m.get("zipfusion:kv_pages_in_use", 0.0) >= self.busiest.get("zipfusion:kv_pages_in_use", 0.0):
            self.busiest = m

    async def run(self, client, url: str, interval: float) -> None:
        while True:
            self.add(await scrape(client, url))
            await asyncio.sleep(interval)

    def numbers(self) -> dict:
        b = self.busiest
        return {"metric_samples": self.samples, "peak_running": self.peak["running"],
                "peak_waiting": self.peak["waiting"], "peak_kv_usage": self.peak["kv_usage"],
                "stored_ratio": b.get("zipfusion:kv_stored_ratio"),
                "compressible_fraction": b.get("zipfusion:kv_compressible_fraction")}


COUNTERS = {"preemptions": "zipfusion:num_preemptions_total", "generation_tokens": "zipfusion:generation_tokens_total",
            "prompt_tokens": "zipfusion:prompt_tokens_total", "prefix_cache_queries": "zipfusion:prefix_cache_queries_total",
            "prefix_cache_hits": "zipfusion:prefix_cache_hits_total", "rejected": "zipfusion:requests_rejected_total"}


def counter_deltas(before: dict, after: dict) -> dict:
    return {k: after.get(name, 0.0) - before.get(name, 0.0) for k, name in COUNTERS.items()}


# ---------------------------------------------------------------------------------- the client
async def send(client, url: str, prompt, max_tokens: int, model: str | None, timeout: float) -> dict:
    """One streaming completion; the record of its times (perf_counter seconds) and tokens."""
    import httpx
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    rec = {"ok": False, "error": None, "expected_output_tokens": max_tokens, "chunks": [], "tokens": 0}
    rec["sent"] = time.perf_counter()
    done = False
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:300].decode(errors='replace')}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                now = time.perf_counter()
                event = json.loads(line[6:])
                if "error" in event:
                    rec["error"] = str(event["error"].get("message", event["error"]))
                    return rec
                if event.get("usage"):
                    rec["output_tokens"] = event["usage"]["completion_tokens"]
                    rec["prompt_tokens"] = event["usage"]["prompt_tokens"]
                    rec["cached_tokens"] = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                n = sum(len(c.get("token_ids") or ()) or bool(c.get("text")) for c in event.get("choices", []))
                if n:
                    rec["chunks"].append(now)
                    rec["tokens"] += n
        rec["done"] = time.perf_counter()
    except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"
        return rec
    tokens = rec.get("output_tokens", rec["tokens"])
    rec["ok"] = done and bool(rec["chunks"]) and tokens >= max_tokens
    return finish_record(rec)


def finish_record(rec: dict) -> dict:
    """TTFT, TPOT, ITL and end-to-end latency (seconds) of a request from its chunk times."""
    chunks = rec["chunks"]
    if chunks:
        tokens = rec.get("output_tokens", rec["tokens"])
        rec["ttft_s"] = chunks[0] - rec["sent"]
        rec["itl_s"] = [b - a for a, b in zip(chunks, chunks[1:])]
        rec["tpot_s"] = (chunks[-1] - chunks[0]) / (tokens - 1) if tokens > 1 else None
        rec["e2el_s"] = rec.get("done", chunks[-1]) - rec["sent"]
    return rec


async def run_rate(url: str, ds: datasets.Dataset, rate: float, *, model: str | None, timeout: float,
                   max_concurrency: int | None = None, seed: int = 0, metrics_interval: float = 2.0,
                   progress_s: float = 10.0, label: str = "") -> tuple[list[dict], float, Sampler]:
    """Every request of ``ds``: arrivals a Poisson process at ``rate`` (inf: all at once), at most
    ``max_concurrency`` in flight. Returns (records in order, seconds from the first send to the
    last answer, the /metrics sampler)."""
    import httpx
    rng = random.Random(seed)
    n = len(ds)
    conns = min(n, max_concurrency or n)
    limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    sampler = Sampler()
    recs: list[dict | None] = [None] * n
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout, connect=30)) as client, \
            httpx.AsyncClient(timeout=30) as side:
        async def one(i: int) -> dict:
            """A request bounded by ``timeout`` seconds in all; whatever goes wrong is its error."""
            t0 = time.perf_counter()
            try:
                return await asyncio.wait_for(send(client, url, ds.prompts[i], ds.output_lens[i], model, timeout),
                                              timeout)
            except asyncio.TimeoutError:
                why = f"no answer within --timeout {timeout:g} s"
            except Exception as exc:                     # noqa: BLE001 - counted as failed, never lost
                why = f"{type(exc).__name__}: {exc}"
            return {"ok": False, "error": why, "sent": t0, "chunks": [], "tokens": 0}

        async def go(i: int) -> None:
            if sem is None:
                recs[i] = await one(i)
                return
            async with sem:
                recs[i] = await one(i)

        start = time.perf_counter()
        sent = [0]

        async def progress() -> None:
            while True:
                await asyncio.sleep(progress_s)
                done = [r for r in recs if r is not None]
                log(f"  {label} {time.perf_counter() - start:.0f} s: {sent[0]}/{n} sent, {len(done)} answered, "
                    f"{sum(not r['ok'] for r in done)} failed or cut short; server: "
                    f"{sampler.peak['running']:.0f} running at the peak")

        background = [asyncio.create_task(sampler.run(side, url, metrics_interval)), asyncio.create_task(progress())]
        tasks = []
        at = start
        try:
            for i in range(n):
                if not math.isinf(rate):
                    at += rng.expovariate(rate)
                    await asyncio.sleep(max(0.0, at - time.perf_counter()))
                tasks.append(asyncio.create_task(go(i)))
                sent[0] += 1
            await asyncio.gather(*tasks)
        finally:
            for t in background + tasks:
                t.cancel()
            await asyncio.gather(*background, *tasks, return_exceptions=True)
        end = time.perf_counter()
        sampler.add(await scrape(side, url))
    return [r if r is not None else {"ok": False, "error": "never sent"} for r in recs], end - start, sampler


def rate_row(recs: list[dict], duration: float, rate: float, slo: dict[str, float],
             max_concurrency: int | None = None) -> dict:
    """The numbers of one rate from its request records (latencies in ms, as vLLM reports them)."""
    ok = [r for r in recs if r["ok"]]
    failed = [r for r in recs if r.get("error")]
    lost = [r for r in recs if not r["ok"] and not r.get("error")]
    out_tokens = sum(r.get("output_tokens", r.get("tokens", 0)) for r in ok)
    in_tokens = sum(r.get("prompt_tokens", 0) for r in ok)
    ms = lambda xs: {k: (v * 1e3 if v is not None and k != "n" else v)  # noqa: E731
                     for k, v in summary(xs).items()}
    row = {"request_rate": "inf" if math.isinf(rate) else rate, "max_concurrency": max_concurrency,
           "num_requests": len(recs), "completed": len(ok), "failed": len(failed), "lost": len(lost),
           "errors": sorted({str(r["error"])[:300] for r in failed})[:5], "duration_s": duration,
           "requests_s": len(ok) / duration, "output_tok_s": out_tokens / duration,
           "total_tok_s": (in_tokens + out_tokens) / duration, "input_tokens": in_tokens, "output_tokens": out_tokens,
           "cached_tokens": sum(r.get("cached_tokens", 0) for r in ok),
           "ttft_ms": ms(r["ttft_s"] for r in ok), "tpot_ms": ms(r["tpot_s"] for r in ok if r["tpot_s"] is not None),
           "itl_ms": ms(x for r in ok for x in r["itl_s"]), "e2el_ms": ms(r["e2el_s"] for r in ok)}
    if slo:
        row.update(goodput(recs, slo, duration))
    return row


def within_slo(row: dict, attainment: float) -> bool:
    """A rate is sustained within the SLO when no request failed or was lost and at least
    ``attainment`` of its requests met the SLO."""
    return row["failed"] == row["lost"] == 0 and row.get("slo_attainment", 0.0) >= attainment


def mode_summary(rows: list[dict], slo: dict, attainment: float) -> dict:
    """What the comparison takes from one mode's rates. ``max_rate_within_slo``: the highest
    Poisson rate that, with every lower rate run, was sustained within the SLO (0: not even the
    lowest; None: no SLO given)."""
    best = 0.0
    for r in sorted((r for r in rows if r["request_rate"] != "inf"), key=lambda r: r["request_rate"]):
        if not within_slo(r, attainment):
            break
        best = r["request_rate"]
    return {"max_rate_within_slo": best if slo else None,
            "max_goodput_req_s": max((r["goodput_req_s"] for r in rows), default=None) if slo else None,
            "max_output_tok_s": max(r["output_tok_s"] for r in rows),
            "max_requests_s": max(r["requests_s"] for r in rows),
            "peak_running": max(r["server"].get("peak_running") or 0 for r in rows),
            "preemptions": sum(r["server"].get("preemptions", 0) for r in rows),
            "failed": sum(r["failed"] for r in rows), "lost": sum(r["lost"] for r in rows)}


FLAT_MIB = 256.0       # growth of the server's RSS or GPU memory over the rates that still counts as flat


def memory_check(before: dict, after: dict, after_first: dict | None = None) -> dict:
    """The server's memory over the run: ``growth_mib`` from after the warm-up to the end, and
    ``growth_after_first_rate_mib`` from after the first rate (kernels built for its step shapes
    and allocator pools grown by then are not a leak). Flat when no number grew by more than
    FLAT_MIB after the first rate (after the warm-up, with one rate)."""
    def growth(a, b):
        return {k: b[k] - a[k] for k in ("rss_mib", "gpu_process_mib", "gpu_used_mib")
                if a.get(k) is not None and b.get(k) is not None}
    total = growth(before, after)
    judged = growth(after_first, after) if after_first else total
    return {"after_warm_up": before, "end": after, "growth_mib": total,
            "growth_after_first_rate_mib": judged if after_first else None,
            "flat": all(v <= FLAT_MIB for v in judged.values()) if judged else None}


# ---------------------------------------------------------------------------------- the driver
def server_flags(args, mode: str) -> list[str]:
    flags = []
    for name in SIZE_FLAGS:
        v = getattr(args, name)
        if v is not None:
            flags += ["--" + name.replace("_", "-"), str(v)]
    return flags + MODES[mode][1] + shlex.split(args.server_args or "")


def rate_seed(base: int, rate: float) -> int:
    """The token seed of a rate: the same prompts at the same rate in every mode, other prompts at
    another rate (the prefix cache would hold a rate's prompts for the next)."""
    return base + zlib.crc32(rate_label(rate).encode())


class Run:
    """One mode's server and its rates."""

    def __init__(self, args, mode: str, dist: datasets.LengthDist, slo: dict, server: Server):
        self.args, self.mode, self.dist, self.slo, self.server = args, mode, dist, slo, server
        self.rows: list[dict] = []
        self.max_len, self.model = None, None
        self.after_rate = lambda: None

    def connect(self) -> None:
        import httpx
        r = httpx.get(self.server.url + "/v1/models", timeout=30)
        r.raise_for_status()
        first = r.json()["data"][0]
        self.model, self.max_len = first["id"], first.get("max_model_len")

    def dataset(self, n: int, id_seed: int) -> datasets.Dataset:
        a = self.args
        return datasets.build(self.dist, a.dataset, n, seed=a.seed, id_seed=id_seed, vocab=a.vocab_size,
                              max_len=self.max_len, range_ratio=a.range_ratio, text=a.prompt_format == "text")

    def warm_up(self) -> None:
        """A few requests outside the numbers (kernel builds on first use): all must succeed."""
        a = self.args
        if a.warmup < 1:
            return
        ds = self.dataset(a.warmup, a.seed + 999_983)
        ds.output_lens = [min(o, 16) for o in ds.output_lens]
        recs, _, _ = asyncio.run(run_rate(self.server.url, ds, math.inf, model=self.model, timeout=a.timeout,
                                          metrics_interval=a.metrics_interval, progress_s=a.progress_s,
                                          label=f"[{self.mode} warm-up]"))
        bad = [r for r in recs if not r["ok"]]
        if bad:
            raise RuntimeError(f"{len(bad)} of {len(recs)} warm-up requests failed, e.g. "
                               f"{bad[0].get('error') or 'cut short'}" + (
                                   f" (server log: {self.server.log_path})" if self.server.log_path else ""))

    def rate(self, rate: float) -> dict:
        a = self.args
        ds = self.dataset(a.num_prompts, rate_seed(a.seed, rate))
        label = f"[{self.mode} rate {rate_label(rate)}]"
        log(f"{label} {len(ds)} requests ({ds.summary()['prompt_tokens']['total']:,} prompt tokens, "
            f"{sum(ds.output_lens):,} to generate)" + (f", at most {a.max_concurrency} in flight"
                                                        if a.max_concurrency else ""))
        before = asyncio.run(one_scrape(self.server.url))
        recs, duration, sampler = asyncio.run(run_rate(
            self.server.url, ds, rate, model=self.model, timeout=a.timeout, max_concurrency=a.max_concurrency,
            seed=rate_seed(a.seed, rate), metrics_interval=a.metrics_interval, progress_s=a.progress_s, label=label))
        after = asyncio.run(one_scrape(self.server.url))
        row = rate_row(recs, duration, rate, self.slo, a.max_concurrency)
        row["server"] = {**counter_deltas(before, after), **sampler.numbers()}
        row["memory_after"] = self.server.memory()
        row["dataset"] = ds.summary()
        self.rows.append(row)
        log(f"{label} {row['completed']}/{row['num_requests']} ok ({row['failed']} failed, {row['lost']} lost) in "
            f"{duration:.1f} s: {row['requests_s']:.2f} req/s, {row['output_tok_s']:,.1f} output tok/s, TTFT p50 "
            f"{report.fmt(row['ttft_ms']['p50'], '{:.0f}')} ms p99 {report.fmt(row['ttft_ms']['p99'], '{:.0f}')} ms, "
            f"TPOT p50 {report.fmt(row['tpot_ms']['p50'], '{:.1f}')} ms"
            + (f", goodput {row['goodput_req_s']:.2f} req/s ({row['slo_attainment']:.0%} in SLO)" if self.slo else "")
            + f", peak batch {row['server']['peak_running']:.0f}, {row['server']['preemptions']:.0f} preemptions")
        self.after_rate()
        return row


async def one_scrape(url: str) -> dict:
    import httpx
    async with httpx.AsyncClient(timeout=30) as c:
        return await scrape(c, url)


def sweep_rates(saturation: float, fractions: list[float], grid: list[float]) -> list[float]:
    """The rates to run after the saturation probe: ``grid`` (the first mode's), plus this mode's
    own fractions of its saturation past the grid's end (so every mode goes to 2x its own)."""
    own = [f * saturation for f in fractions]
    if not grid:
        return sorted(float(f"{r:.3g}") for r in own)
    return sorted(set(grid) | {float(f"{r:.3g}") for r in own if r > max(grid) * 1.05})


def run_mode(args, mode: str, dist, slo: dict, device: str, grid: list[float], checkpoint=None) -> dict:
    if args.url:
        server = Server(args.url.rstrip("/"), device=device)
    else:
        log(f"[{mode}] starting zipfusion serve --model {args.model} --device {device} "
            + " ".join(server_flags(args, mode)))
        t0 = time.perf_counter()
        server = Server.start(args.model, device, server_flags(args, mode), args.startup_timeout)
        log(f"[{mode}] server up in {time.perf_counter() - t0:.0f} s at {server.url} (log: {server.log_path})")
    run = Run(args, mode, dist, slo, server)
    if checkpoint is not None:
        run.after_rate = lambda: checkpoint(mode, {"server": server.info(), "rates": run.rows})
    try:
        run.connect()
        run.warm_up()
        start_memory = server.settled_memory()
        saturation = None
        if args.sweep:
            probe = run.rate(math.inf)
            saturation = probe["requests_s"]
            rates = sweep_rates(saturation, args.sweep_points, grid)
            log(f"[{mode}] saturation {saturation:.3g} req/s (every request at once); sweeping "
                + ", ".join(rate_label(r) for r in rates) + " req/s")
        else:
            rates = args.rates
        for rate in rates:
            run.rate(rate)
        end_memory = server.memory()
    finally:
        server.stop()
    mem = memory_check(start_memory, end_memory, run.rows[0]["memory_after"] if len(run.rows) > 1 else None)
    if mem["flat"] is False:
        log(f"[{mode}] WARNING: the server's memory grew over the run: {mem['growth_mib']} MiB")
    return {"server": {**server.info(), "model": run.model, "max_model_len": run.max_len},
            "saturation_req_s": saturation, "rates": run.rows, "memory": mem,
            "summary": mode_summary(run.rows, slo, args.slo_attainment)}


COLUMNS = [("mode", "mode", "{}"), ("rate", "rate", "{}"), ("completed", "ok", "{}"), ("failed", "fail", "{}"),
           ("lost", "lost", "{}"), ("requests_s", "req/s", "{:.2f}"), ("output_tok_s", "out tok/s", "{:,.1f}"),
           ("ttft_p50", "TTFT p50", "{:,.0f}"), ("ttft_p99", "TTFT p99", "{:,.0f}"), ("tpot_p50", "TPOT p50", "{:.1f}"),
           ("tpot_p99", "TPOT p99", "{:.1f}"), ("itl_p50", "ITL p50", "{:.1f}"), ("itl_p99", "ITL p99", "{:.1f}"),
           ("goodput", "goodput", "{:.2f}"), ("peak_running", "peak batch", "{:.0f}"),
           ("preemptions", "preempt", "{:.0f}"), ("rss_mib", "server RSS MiB", "{:,.0f}")]


def table_rows(result: dict) -> list[dict]:
    rows = []
    for mode, m in result["modes"].items():
        if "rates" not in m:
            rows.append({"mode": mode, "note": note(m)})
            continue
        for r in m["rates"]:
            rows.append({"mode": mode, "rate": rate_label(float(r["request_rate"])), **r,
                         **{f"{k}_{p}": r[f"{k}_ms"][p] for k in ("ttft", "tpot", "itl") for p in ("p50", "p99")},
                         "goodput": r.get("goodput_req_s"), "peak_running": r["server"].get("peak_running"),
                         "preemptions": r["server"].get("preemptions"), "rss_mib": r["memory_after"].get("rss_mib")})
    return rows


def comparison(result: dict, modes: list[str]) -> dict:
    """Per mode its summary (a run cut short, e.g. by a time limit, is summarised from the rates it
    finished, marked ``partial``), and the first mode's ratios to the others."""
    c = result["config"]
    per = {}
    for m in modes:
        run = result["modes"].get(m, {})
        if "summary" in run:
            per[m] = run["summary"]
        elif run.get("rates"):
            per[m] = {**mode_summary(run["rates"], c.get("goodput") or {}, c.get("slo_attainment", 0.9)),
                      "partial": True}
    return {"per_mode": per, "ratios": report.ratios(per, tuple(RATIO_KEYS), modes[0])}


def plot(result: dict, path: str) -> bool:
    """Latency against request rate, every mode on the same axes: TTFT and TPOT (p50 solid, p99
    dashed), output tokens/s and goodput (or requests/s). The all-at-once rate (inf) is drawn at
    the request rate it achieved, as a star."""
    plt = report.pyplot()
    modes = {m: v for m, v in result["modes"].items() if v.get("rates")}
    if plt is None or not modes:
        return False
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    slo = result["config"]["goodput"]
    panels = [(axes[0][0], "ttft_ms", "TTFT (ms)"), (axes[0][1], "tpot_ms", "TPOT (ms)")]
    for i, (mode, m) in enumerate(modes.items()):
        color = f"C{i}"
        rows = sorted(m["rates"], key=lambda r: (r["request_rate"] == "inf", float(r["request_rate"])))
        finite = [r for r in rows if r["request_rate"] != "inf"]
        burst = [r for r in rows if r["request_rate"] == "inf"]
        xs = [r["request_rate"] for r in finite]
        for ax, key, _ in panels:
            for p, style in (("p50", "-o"), ("p99", "--o")):
                ax.plot(xs, [r[key][p] if r[key][p] is not None else math.nan for r in finite], style, color=color,
                        label=f"{mode} {p}", ms=4)
                ax.plot([r["requests_s"] for r in burst], [r[key][p] or math.nan for r in burst], "*", color=color,
                        ms=9)
        axes[1][0].plot(xs, [r["output_tok_s"] for r in finite], "-o", color=color, label=mode, ms=4)
        axes[1][0].plot([r["requests_s"] for r in burst], [r["output_tok_s"] for r in burst], "*", color=color, ms=9)
        key, name = ("goodput_req_s", "goodput (req/s in SLO)") if slo else ("requests_s", "requests/s completed")
        axes[1][1].plot(xs, [r[key] for r in finite], "-o", color=color, label=mode, ms=4)
        axes[1][1].plot([r["requests_s"] for r in burst], [r[key] for r in burst], "*", color=color, ms=9)
        axes[1][1].set_ylabel(name)
    for ax, key, name in panels:
        ax.set_ylabel(name)
        with warnings.catch_warnings():            # one point (one rate): matplotlib widens the limits itself
            warnings.simplefilter("ignore", UserWarning)
            ax.set_yscale("log")
        if key[:4] in slo:
            ax.axhline(slo[key[:4]], color="gray", ls=":", lw=1, label="SLO")
    axes[1][0].set_ylabel("output tokens/s")
    for ax in (a for row in axes for a in row):
        ax.set_xlabel("request rate (req/s, Poisson; *: all at once, at the rate achieved)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    c, m = result["config"], result["meta"]
    fig.suptitle(f"zipfusion bench serve: {c['model']} on {m['device_name']}, {c['dataset']} x {c['num_prompts']} "
                 f"per rate, KV {c['kv_memory_gb'] or 'default'} GiB"
                 + (", SLO " + " ".join(f"{k}:{v:g}" for k, v in slo.items()) + " ms" if slo else ""),
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def check_client() -> None:
    import importlib.util
    if importlib.util.find_spec("httpx") is None:
        raise ImportError("zipfusion bench serve needs httpx, which is not installed; from the zipfusion checkout: "
                          "pip install -e '.[bench]'")


def run(args, modes: list[str], device: str, slo: dict) -> int:
    if args.merge:
        return merge(args.merge, args.out)
    check_client()
    if args.url and len(modes) > 1:
        raise ValueError("--url is one running server, so one mode: --compare starts a server per mode "
                         "(leave out --url), or name the server's mode with --mode")
    if not args.url:
        from .. import cli
        cli._require(("fastapi", "uvicorn", "prometheus_client"), "server", "zipfusion bench serve (its server)")
    if not 0 < args.slo_attainment <= 1:
        raise ValueError(f"--slo-attainment is a share in (0, 1], got {args.slo_attainment}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    for flag, v in (("--timeout", args.timeout), ("--startup-timeout", args.startup_timeout),
                    ("--metrics-interval", args.metrics_interval), ("--progress-s", args.progress_s)):
        if not v > 0:
            raise ValueError(f"{flag} must be > 0, got {v}")
    args.rates = parse_rates(args.request_rates) if not args.sweep else None
    args.sweep_points = parse_fractions(args.sweep_points)
    dist = datasets.resolve(args.dataset, args.input_len, args.output_len, args.shared_prefix, args.prefix_group)
    datasets.build(dist, args.dataset, args.num_prompts, range_ratio=args.range_ratio)      # bad sizes: now
    meta = report.run_meta("serve", args.argv, device)
    config = {"model": args.model, "device": device, "url": args.url, "modes": modes, "dataset": args.dataset,
              "length_dist": dataclasses.asdict(dist), "num_prompts": args.num_prompts, "prompt_format": args.prompt_format,
              "request_rates": None if args.sweep else [rate_label(r) for r in args.rates],
              "sweep": args.sweep, "sweep_points": args.sweep_points, "max_concurrency": args.max_concurrency,
              "goodput": slo, "slo_attainment": args.slo_attainment, "kv_memory_gb": args.kv_memory_gb,
              **{k: getattr(args, k) for k in SIZE_FLAGS[1:]}, "server_args": args.server_args, "seed": args.seed,
              "timeout_s": args.timeout}
    result = {"meta": meta, "config": config, "modes": {},
              "notes": "TTFT: send -> first streamed token; ITL: gaps between streamed chunks; TPOT: (last - first "
                       "token) / (tokens - 1); e2el: send -> last byte; ms. goodput: requests/s meeting every "
                       "--goodput bound; a rate is within the SLO when none failed or was lost and at least "
                       "--slo-attainment of its requests met it. server: /metrics counters over the rate, peaks "
                       "sampled every --metrics-interval s; memory_after: the server process after the rate."}
    log(f"{LOG}: {args.model} on {meta['device_name']}, {args.dataset} x {args.num_prompts} per rate, "
        f"modes {', '.join(modes)}")
    json_path, _ = report.out_paths(args.out)

    def checkpoint(mode: str, partial: dict) -> None:
        """The JSON so far after every rate: a run cut short (a time limit) keeps what it measured."""
        result["modes"][mode] = {**partial, "partial": True}
        report.write_json(result, json_path)

    grid: list[float] = []
    for i, mode in enumerate(modes):
        why = flashinfer_skip_reason(device) if mode == "flashinfer" and not args.url else None
        if why:
            log(f"[{i + 1}/{len(modes)}] {mode}: skipped ({why})")
            result["modes"][mode] = {"skipped": why}
            continue
        log(f"[{i + 1}/{len(modes)}] {mode}")
        try:
            result["modes"][mode] = run_mode(args, mode, dist, slo, device, grid, checkpoint)
        except (RuntimeError, OSError, ValueError) as exc:
            log(f"[{mode}] FAILED: {exc}")
            result["modes"][mode] = {**result["modes"].get(mode, {}), "error": " ".join(str(exc).split())}
        if args.sweep and not grid and result["modes"][mode].get("rates"):
            grid = sorted(float(r["request_rate"]) for r in result["modes"][mode]["rates"][1:])
    return finish(result, args.out)


MATCH = ("model", "dataset", "length_dist", "num_prompts", "prompt_format", "kv_memory_gb", "max_concurrency",
         "goodput", "slo_attainment", "seed")


def merge(paths: list[str], out: str) -> int:
    """Earlier runs' JSON (e.g. one mode per call, where a call has a time limit) as one
    comparison; they must have measured the same workload at the same KV memory and SLO."""
    results = []
    for path in paths:
        try:
            with open(path) as f:
                results.append(json.load(f))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--merge {path}: {exc}") from None
        if "modes" not in results[-1] or "config" not in results[-1]:
            raise ValueError(f"--merge {path}: not a zipfusion bench serve result")
    first = results[0]["config"]
    for path, r in zip(paths[1:], results[1:]):
        differ = [k for k in MATCH if r["config"].get(k) != first.get(k)]
        if differ:
            raise ValueError(f"--merge: {path} measured another workload than {paths[0]} ({', '.join(differ)} "
                             "differ); merge runs of one workload at one KV memory and SLO")
    modes = {}
    for r in results:
        modes.update({m: v for m, v in r["modes"].items() if m not in modes or "rates" in v})
    order = sorted(modes, key=lambda m: (m != "compressed", list(modes).index(m)))
    meta = {**results[-1]["meta"], "command": "; ".join(r["meta"]["command"] for r in results),
            "parts": [r["meta"] for r in results]}
    result = {"meta": meta, "config": {**results[0]["config"], "modes": order, "merged_from": list(paths)},
              "modes": {m: modes[m] for m in order}, "notes": results[0].get("notes")}
    return finish(result, out)


def finish(result: dict, out: str) -> int:
    """The comparison, JSON + PNG, then the tables (the comparison last); 1 when a request
    failed or was lost, or a mode failed."""
    slo, attainment = result["config"]["goodput"], result["config"]["slo_attainment"]
    result["comparison"] = comparison(result, result["config"]["modes"])
    failed = sum(m["summary"]["failed"] + m["summary"]["lost"] for m in result["modes"].values() if "summary" in m)
    print(report.save(result, out, plot))
    print(report.text_table(table_rows(result), COLUMNS))
    for mode, m in result["modes"].items():
        if "memory" in m:
            mem = m["memory"]
            later = mem["growth_after_first_rate_mib"]
            print(f"{mode}: server memory from after the warm-up to the end: "
                  + (", ".join(f"{k} {v:+,.0f}" for k, v in mem["growth_mib"].items()) or "not measured")
                  + (" MiB; after the first rate: " + ", ".join(f"{k} {v:+,.0f}" for k, v in later.items())
                     if later else "") + f" MiB ({'flat' if mem['flat'] else 'NOT FLAT' if mem['flat'] is False else '?'}"
                  + f", tolerance {FLAT_MIB:.0f} MiB)")
    per = result["comparison"]["per_mode"]
    if slo:
        print(f"SLO {' '.join(f'{k}:{v:g}' for k, v in slo.items())} ms, >= {attainment:.0%} of requests: "
              + "; ".join(f"{m} sustains {report.fmt(s['max_rate_within_slo'], '{:.3g}')} req/s" for m, s in per.items()))
    if result["comparison"]["ratios"]:
        print(report.ratio_table(result["comparison"]["ratios"],
                                 RATIO_KEYS if slo else {k: v for k, v in RATIO_KEYS.items() if "slo" not in k
                                                         and "goodput" not in k}))
    if failed:
        print(f"{failed} request(s) failed or were lost")
    return 1 if failed or any("error" in m for m in result["modes"].values()) else 0
