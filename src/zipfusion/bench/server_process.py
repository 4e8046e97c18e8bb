"""The ``zipfusion serve`` process a ``zipfusion bench serve`` mode runs against: its flags,
start-up on a free loopback port and shutdown, its memory (RSS, GPU) and whether it stayed flat,
and its /metrics sampled while a rate runs.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time

from . import MODES
from .offline import die_with_parent
from .process import child_environment, visible_gpus

# sizes a server takes from the bench's own options
SIZE_FLAGS = ("kv_memory_gb", "max_num_seqs", "max_num_batched_tokens", "max_model_len")


def server_flags(args, mode: str) -> list[str]:
    flags = []
    for name in SIZE_FLAGS:
        v = getattr(args, name)
        if v is not None:
            flags += ["--" + name.replace("_", "-"), str(v)]
    key = ["--api-key", args.api_key] if getattr(args, "api_key", None) else []
    return flags + MODES[mode][1] + key + shlex.split(args.server_args or "")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        return " | ".join(self.log_lines()[-lines:])

    def log_lines(self, containing: str = "") -> list[str]:
        try:
            with open(self.log_path, errors="replace") as f:
                return [line.strip() for line in f.read().splitlines() if line.strip() and containing in line]
        except (OSError, TypeError):
            return []

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def memory(self) -> dict:
        return {**process_memory(self.pid), **gpu_memory(self.pid, self.device)}

    def settled_memory(self, seconds: float = 30.0) -> dict:
        """The memory once the process's RSS stops moving (at most ``seconds``)."""
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


FLAT_MIB = 256.0  # growth over the rates that still counts as flat


def memory_check(before: dict, after: dict, after_first: dict | None = None) -> dict:
    """The server's memory growth over the run, from after the warm-up and after the first rate
    (kernel builds and allocator pools are no leak); flat within FLAT_MIB."""
    def growth(a, b):
        return {k: b[k] - a[k] for k in ("rss_mib", "gpu_process_mib", "gpu_used_mib")
                if a.get(k) is not None and b.get(k) is not None}
    total = growth(before, after)
    judged = growth(after_first, after) if after_first else total
    return {"after_warm_up": before, "end": after, "growth_mib": total,
            "growth_after_first_rate_mib": judged if after_first else None,
            "flat": all(v <= FLAT_MIB for v in judged.values()) if judged else None}


def parse_metrics(text: str) -> dict:
    """The server's Prometheus text -> {name: value} (series summed over labels)."""
    out, fracs = {}, []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.startswith("vllm:"):
            name = "zipfusion:" + name[5:]
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


async def one_scrape(url: str) -> dict:
    import httpx
    async with httpx.AsyncClient(timeout=30) as c:
        return await scrape(c, url)


class Sampler:
    """/metrics every ``interval`` seconds while a rate runs: peaks and the KV's numbers."""

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
