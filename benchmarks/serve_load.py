#!/usr/bin/env python3
"""Serving load test: concurrent streaming clients with Poisson arrivals against ``zipfusion serve``.

Starts ``python -m zipfusion serve`` as a subprocess on 127.0.0.1 (or uses ``--url`` of a running
server), then for each request rate sends ``--num-requests`` streaming /v1/completions requests
(httpx async, arrival gaps drawn from an exponential distribution: a Poisson process) with
random token-id prompts of ``--prompt-len`` tokens and exactly ``--max-tokens`` output tokens
(``ignore_eos``; ``return_token_ids``, so that each token is a chunk even without a tokenizer). Per
request it records the time to first token (TTFT: send to first streamed token), the gaps between
streamed chunks (ITL; one chunk per generated token), the time per output token
after the first (TPOT) and the end-to-end latency; per rate it reports their p50 / p99 / mean,
output tokens/s and requests/s, plus the server's own counters from /metrics (preemptions,
KV compression ratio). Results: ``OUT.json`` and, with matplotlib, ``OUT.png``.

    python benchmarks/serve_load.py                                   # CPU, demo model (the committed result)
    python benchmarks/serve_load.py --model llama-3.1-8b-random --device cuda --rates 4,8,16,32 \\
        --num-requests 256 --prompt-len 1024 --max-tokens 256 --out benchmarks/results/serve_load_h200

``--shared-prefix N --group G``: requests in groups of G start with one N-token prefix of their
group (a system prompt: the prefix cache's case); the cached prompt tokens the server reports
(``usage.prompt_tokens_details.cached_tokens``) and its prefix-cache counters are recorded.

Options this script does not know are passed to ``zipfusion serve`` (e.g. ``--kv-memory-gb 60``,
``--max-num-seqs 128``, ``--no-kv-compression``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"p50": None, "p99": None, "mean": None, "n": 0}
    s = sorted(xs)

    def q(p):
        return s[min(len(s) - 1, max(0, round(p * (len(s) - 1))))]
    return {"p50": q(0.5), "p99": q(0.99), "mean": statistics.fmean(s), "n": len(s)}


async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, model: str | None,
                      timeout: float) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    rec = {"ok": False, "chunks": []}
    t0 = time.perf_counter()
    rec["sent"] = t0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                event = json.loads(line[6:])
                if "error" in event:
                    rec["error"] = event["error"].get("message")
                    return rec
                if event.get("usage"):
                    rec["completion_tokens"] = event["usage"]["completion_tokens"]
                    rec["cached_tokens"] = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                if any(c.get("text") or c.get("token_ids") for c in event.get("choices", [])):
                    rec["chunks"].append(now)
        rec["done"] = time.perf_counter()
        rec["ok"] = bool(rec["chunks"])
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"
    return rec


async def run_rate(url: str, rate: float, n: int, prompt_len: int, max_tokens: int, vocab: tuple[int, int],
                   seed: int, model: str | None, timeout: float, max_concurrency: int | None,
                   shared_prefix: int = 0, group: int = 1) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(*vocab) for _ in range(prompt_len)] for _ in range(n)]
    if shared_prefix:                            # groups of requests behind one system prompt each
        prefixes = [[rng.randrange(*vocab) for _ in range(shared_prefix)] for _ in range(-(-n // group))]
        prompts = [prefixes[i // group] + p for i, p in enumerate(prompts)]
    gaps = [rng.expovariate(rate) if rate > 0 else 0.0 for _ in range(n)]
    limits = httpx.Limits(max_connections=max(n, 1), max_keepalive_connections=max(n, 1))
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        async def go(p):
            if sem is None:
                return await one_request(client, url, p, max_tokens, model, timeout)
            async with sem:
                return await one_request(client, url, p, max_tokens, model, timeout)

        tasks = []
        start = time.perf_counter()
        for p, gap in zip(prompts, gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(go(p)))
        busy = await asyncio.to_thread(scrape, url)          # the KV while the last arrivals run
        recs = await asyncio.gather(*tasks)
    end = time.perf_counter()
    ok = [r for r in recs if r["ok"]]
    ttft = [r["chunks"][0] - r["sent"] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
    tpot = [(r["chunks"][-1] - r["chunks"][0]) / (r.get("completion_tokens", len(r["chunks"])) - 1)
            for r in ok if r.get("completion_tokens", len(r["chunks"])) > 1]
    e2e = [r["done"] - r["sent"] for r in ok]
    out_tokens = sum(r.get("completion_tokens", len(r["chunks"])) for r in ok)
    errors = [r.get("error") for r in recs if not r["ok"]]
    return {"rate_req_s": rate, "num_requests": n, "completed": len(ok), "failed": len(errors),
            "errors": errors[:5], "duration_s": end - start, "output_tokens": out_tokens,
            "output_tok_s": out_tokens / (end - start), "requests_s": len(ok) / (end - start),
            "ttft_s": percentiles(ttft), "itl_s": percentiles(itl), "tpot_s": percentiles(tpot),
            "e2e_s": percentiles(e2e), "at_last_arrival": busy,
            "prompt_tokens": sum(len(p) for p in prompts), "cached_tokens": sum(r.get("cached_tokens", 0) for r in ok)}


def scrape(url: str) -> dict:
    """A few of the server's own numbers from /metrics; the compressible fraction is the mean over
    layers of the stored pages' (NaN: no page stored)."""
    out, fracs = {}, []
    try:
        text = httpx.get(url + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return out
    wanted = ("zipfusion:num_preemptions_total", "zipfusion:generation_tokens_total", "zipfusion:prompt_tokens_total",
              "zipfusion:kv_stored_ratio", "zipfusion:kv_arena_bytes", "zipfusion:time_to_first_token_seconds_sum",
              "zipfusion:time_to_first_token_seconds_count", "zipfusion:kv_cache_usage_perc",
              "zipfusion:num_requests_running", "zipfusion:num_requests_waiting",
              "zipfusion:prefix_cache_queries_total", "zipfusion:prefix_cache_hits_total")
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            out[name] = float(line.rsplit(" ", 1)[1])
        elif name == "zipfusion:kv_compressible_fraction":
            fracs.append(float(line.rsplit(" ", 1)[1]))
    fracs = [f for f in fracs if f == f]
    if fracs:
        out["zipfusion:kv_compressible_fraction"] = statistics.fmean(fracs)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, extra: list[str]) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    cmd = [sys.executable, "-m", "zipfusion", "serve", "--model", args.model, "--device", args.device,
           "--port", str(port), "--log-level", "warning", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log_path = Path(tempfile.gettempdir()) / f"zipfusion_serve_load_{port}.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_timeout
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}: see {log_path}")
        if time.monotonic() > deadline:
            proc.terminate()
            raise SystemExit(f"the server did not answer /health in {args.startup_timeout} s: see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log_path
        except httpx.HTTPError:
            pass
        time.sleep(0.25)


def plot(result: dict, path: str) -> bool:
    from common import pyplot
    plt = pyplot()
    if plt is None:
        return False
    rows = result["results"]
    rates = [r["rate_req_s"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("ttft_s", "TTFT"), ("itl_s", "ITL")):
        for p, style in (("p50", "-o"), ("p99", "--o")):
            ax1.plot(rates, [1e3 * (r[key][p] or float("nan")) for r in rows], style, label=f"{label} {p}")
    ax1.set_xlabel("request rate (req/s, Poisson)")
    ax1.set_ylabel("ms")
    ax1.set_yscale("log")
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax2.plot(rates, [r["output_tok_s"] for r in rows], "-o")
    ax2.set_xlabel("request rate (req/s, Poisson)")
    ax2.set_ylabel("output tokens/s")
    ax2.grid(alpha=0.3)
    fig.suptitle(f"zipfusion serve, {result['model']} on {result['device_name']}: {result['prompt_len']} prompt + "
                 f"{result['max_tokens']} output tokens per request")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="demo")
    p.add_argument("--device", default="cpu")
    p.add_argument("--url", default=None, help="use this running server instead of starting one")
    p.add_argument("--served-model", default=None, help="the 'model' field to send (default: none)")
    p.add_argument("--rates", default="1,2,4", help="request rates to run, req/s, comma-separated (inf: all at once)")
    p.add_argument("--num-requests", type=int, default=32, help="requests per rate")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--shared-prefix", type=int, default=0, help="tokens of a prefix each group of requests shares")
    p.add_argument("--group", type=int, default=16, help="requests per shared prefix")
    p.add_argument("--vocab", default="10,2000", help="prompt token ids are drawn from [lo, hi)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (default: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600, help="seconds per request")
    p.add_argument("--startup-timeout", type=float, default=900, help="seconds for the server to load the model")
    p.add_argument("--warmup", type=int, default=2, help="requests sent (and not measured) before the first rate")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serve_load_cpu"),
                   help="writes OUT.json and OUT.png")
    args, extra = p.parse_known_args(argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    rates = [float(r) for r in args.rates.split(",")]
    vocab = tuple(int(v) for v in args.vocab.split(","))
    proc = None
    if args.url:
        url, log_path = args.url.rstrip("/"), None
    else:
        proc, url, log_path = start_server(args, extra)
    try:
        if args.warmup:
            asyncio.run(run_rate(url, float("inf"), args.warmup, args.prompt_len, args.max_tokens, vocab,
                                 args.seed + 999, args.served_model, args.timeout, None))
        before = scrape(url)
        results = []
        for i, rate in enumerate(rates):
            r = asyncio.run(run_rate(url, rate if rate != float("inf") else 0.0, args.num_requests, args.prompt_len,
                                     args.max_tokens, vocab, args.seed + i, args.served_model, args.timeout,
                                     args.max_concurrency, args.shared_prefix, args.group))
            r["rate_req_s"] = rate
            results.append(r)
            print(f"rate {rate:g} req/s: {r['completed']}/{r['num_requests']} ok, "
                  f"TTFT p50 {1e3 * (r['ttft_s']['p50'] or 0):.0f} ms p99 {1e3 * (r['ttft_s']['p99'] or 0):.0f} ms, "
                  f"ITL p50 {1e3 * (r['itl_s']['p50'] or 0):.1f} ms p99 {1e3 * (r['itl_s']['p99'] or 0):.1f} ms, "
                  f"{r['output_tok_s']:.1f} output tok/s, {r['cached_tokens']} of {r['prompt_tokens']} prompt tokens "
                  "cached", flush=True)
        after = scrape(url)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    device_name = platform.processor() or platform.machine()
    if args.device.startswith("cuda"):
        try:
            import torch
            device_name = torch.cuda.get_device_name()
        except Exception:
            pass
    result = {"command": "python benchmarks/serve_load.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "model": args.model, "device": args.device, "device_name": device_name, "cpus": os.cpu_count(),
              "server_args": extra, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
              "shared_prefix": args.shared_prefix, "group": args.group,
              "results": results,
              "server_metrics": {k: after.get(k, 0) - before.get(k, 0) if k.endswith(("_total", "_sum", "_count"))
                                 else after.get(k) for k in after},
              "notes": "TTFT: send -> first streamed token; ITL: gaps between streamed chunks (one per token: return_token_ids); "
                       "TPOT: (last - first token) / (tokens - 1); percentiles over all requests of a rate; "
                       "at_last_arrival: /metrics when the rate's last request was sent"}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out.with_suffix('.json')}" + (f" and {out.with_suffix('.png')}" if plot(result, str(
        out.with_suffix(".png"))) else "") + (f" (server log: {log_path})" if log_path else ""))
    return 0 if all(r["failed"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
