#!/usr/bin/env python3
"""A small request's latency while hostile or careless requests run against ``zipfusion serve``.

Starts ``python -m zipfusion serve`` as a subprocess on 127.0.0.1 with the serving defaults
(or the options given after ``--``), then for each scenario of issue 24 runs the hostile
request(s) in a loop in a background thread while the main thread sends ``--samples`` small
requests one after another (8 prompt tokens, 4 output tokens) and times each. It also streams one
long request while the longest possible prompts prefill, and records that stream's inter-token
latency (ITL): how long running streams freeze while a prompt is prefilled. Every loop is
bounded (a count and a deadline), every HTTP call has a timeout, and the server is stopped at
the end; nothing leaves 127.0.0.1.

    python benchmarks/server_hostile.py                          # CPU, demo model (the committed result)
    python benchmarks/server_hostile.py --model ~/.cache/zipfusion/wheels/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --scenarios stream_itl --prompt-tokens 2000 --out benchmarks/results/server_hostile_cpu/smollm2_chunk256 \\
        -- --max-num-batched-tokens 256

Result: ``OUT.json`` (every latency, and p50 / p99 / max per scenario).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from zipfusion.bench.server_process import Server  # noqa: E402  (zipfusion bench serve's server process)
from zipfusion.bench.stats import summary as percentiles  # noqa: E402  (mean, p50/p90/p99, max, n)

SMALL = {"prompt": list(range(10, 18)), "max_tokens": 4, "temperature": 0, "ignore_eos": True}
T = 120.0            # the bound on any one HTTP call


def hostile_requests(max_model_len: int, prompt_tokens: int | None, fan_out: int) -> dict:
    """name -> list of (content bytes or json body); each scenario sends these in turn."""
    long_ids = list(range(5, 5 + (prompt_tokens or max_model_len - 2)))
    j = lambda body: json.dumps(body).encode()          # noqa: E731
    return {
        "amplification_refused": [j({"prompt": [[1, 2, 3]] * 500, "n": 128, "max_tokens": 1})],
        "largest_fan_out_accepted": [j({"prompt": [[1, 2, 3]] * (fan_out // 8), "n": 8, "max_tokens": 16,
                                        "ignore_eos": True})],
        "longest_prompt": [j({"prompt": long_ids, "max_tokens": 1})],
        "prompt_5MB_text": [j({"prompt": "In the beginning God created the heaven and the earth. " * 91000,
                              "max_tokens": 1})],
        "body_9MiB": [b'{"prompt": "' + b"x" * (9 * 2**20) + b'"}'],
        "bad_values": [b'{"prompt": "\\ud800abc"}', b'{"prompt": "x", "temperature": NaN}',
                       b'{"prompt": "x", "temperature": Infinity}', b'{"prompt": "x", "stream": "yes"}',
                       b'{"prompt": "x", "max_tokens": "5"}', j({"prompt": "x", "seed": 2**64}),
                       j({"prompt": "x", "min_tokens": 9, "max_tokens": 2}), b'{"prompt": "x", "tem',
                       b'{"prompt": "\xff\xfe"}'],
    }


def small_latencies(url: str, samples: int, deadline: float) -> list[float]:
    out = []
    with httpx.Client(timeout=T) as c:
        for _ in range(samples):
            if time.monotonic() > deadline:
                break
            t0 = time.perf_counter()
            r = c.post(url + "/v1/completions", json=SMALL)
            out.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
            time.sleep(0.02)
    return out


def run_scenario(url: str, bodies: list[bytes], samples: int, max_seconds: float) -> dict:
    stop, statuses, seconds = threading.Event(), {}, []

    def hostile():
        with httpx.Client(timeout=T) as c:
            for _ in range(10000):                      # bounded: the stop event ends it first
                for body in bodies:
                    if stop.is_set():
                        return
                    t0 = time.perf_counter()
                    try:
                        r = c.post(url + "/v1/completions", content=body,
                                   headers={"content-type": "application/json"})
                        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                    except httpx.HTTPError as exc:      # a 413 closes the connection: expected
                        statuses[type(exc).__name__] = statuses.get(type(exc).__name__, 0) + 1
                    seconds.append(time.perf_counter() - t0)

    thread = threading.Thread(target=hostile, daemon=True)
    thread.start()
    time.sleep(0.2)                                      # the hostile request is in flight
    lat = small_latencies(url, samples, time.monotonic() + max_seconds)
    stop.set()
    thread.join(T)
    return {"small_request_s": percentiles(lat), "small_request_all_s": [round(x, 4) for x in lat],
            "hostile_statuses": {str(k): v for k, v in statuses.items()},
            "hostile_request_s": percentiles(seconds)}


def stream_itl(url: str, long_body: bytes | None, max_tokens: int, max_seconds: float) -> dict:
    """One stream of ``max_tokens``; while it runs, ``long_body`` (the longest prompt) is sent
    again and again. The gaps between its chunks (one per token, return_token_ids)."""
    stop, prefills = threading.Event(), []

    def prefill_loop():
        with httpx.Client(timeout=T) as c:
            for _ in range(1000):
                if stop.is_set():
                    return
                t0 = time.perf_counter()
                c.post(url + "/v1/completions", content=long_body, headers={"content-type": "application/json"})
                prefills.append(time.perf_counter() - t0)

    body = {"prompt": list(range(10, 18)), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    gaps, thread = [], None
    deadline = time.monotonic() + max_seconds
    with httpx.Client(timeout=T) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        last = None
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
            if long_body is not None and thread is None and len(gaps) >= 3:
                thread = threading.Thread(target=prefill_loop, daemon=True)
                thread.start()
            if time.monotonic() > deadline:
                break
    stop.set()
    if thread is not None:
        thread.join(T)
    return {"itl_s": percentiles(gaps), "tokens": len(gaps) + 1, "prefill_requests": len(prefills),
            "prefill_request_s": percentiles(prefills)}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--samples", type=int, default=20, help="small requests per scenario (default: 20)")
    ap.add_argument("--max-seconds", type=float, default=60.0, help="bound on each scenario (default: 60)")
    ap.add_argument("--stream-tokens", type=int, default=96, help="tokens of the timed stream (default: 96)")
    ap.add_argument("--prompt-tokens", type=int, default=None,
                    help="the long prompt's length (default: max_model_len - 2)")
    ap.add_argument("--fan-out", type=int, default=64,
                    help="prompts x n of the largest accepted fan-out (default: 64, the server's default limit "
                         "at --max-num-seqs 256)")
    ap.add_argument("--scenarios", default="all", help="comma-separated names, 'stream_itl', or all")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/server_hostile_cpu/server_hostile"))
    args = ap.parse_args(argv)
    server = Server.start(args.model, args.device, extra, args.startup_timeout)
    url = server.url
    try:
        info = httpx.get(url + "/v1/models", timeout=T).json()["data"][0]
        bodies = hostile_requests(info["max_model_len"], args.prompt_tokens, args.fan_out)
        wanted = set(bodies) | {"stream_itl"} if args.scenarios == "all" else set(args.scenarios.split(","))
        result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "command": " ".join([Path(sys.executable).name, "benchmarks/server_hostile.py", *sys.argv[1:]]),
                  "host": platform.node(), "cpus": os.cpu_count(), "load_avg_before": os.getloadavg(),
                  "model": info["id"], "max_model_len": info["max_model_len"], "serve_options": extra,
                  "small_request": SMALL, "scenarios": {}}
        small_idle = small_latencies(url, args.samples, time.monotonic() + args.max_seconds)
        result["idle_small_request_s"] = percentiles(small_idle)
        print(f"idle: small request p50 {result['idle_small_request_s']['p50']:.3f} s", flush=True)
        for name, reqs in bodies.items():
            if name not in wanted:
                continue
            res = run_scenario(url, reqs, args.samples, args.max_seconds)
            result["scenarios"][name] = res
            s = res["small_request_s"]
            print(f"{name}: small request p50 {s['p50']:.3f} p99 {s['p99']:.3f} max {s['max']:.3f} s; "
                  f"hostile {res['hostile_statuses']}", flush=True)
        if "stream_itl" in wanted:
            for label, body in (("alone", None), ("while_longest_prompts_prefill", bodies["longest_prompt"][0])):
                res = stream_itl(url, body, args.stream_tokens, args.max_seconds)
                result["scenarios"][f"stream_itl_{label}"] = res
                i = res["itl_s"]
                print(f"stream ITL {label}: p50 {i['p50']:.3f} p99 {i['p99']:.3f} max {i['max']:.3f} s "
                      f"({res['prefill_requests']} prefills)", flush=True)
        assert httpx.get(url + "/health", timeout=T).status_code == 200          # still serving
        result["load_avg_after"] = os.getloadavg()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}.json")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
