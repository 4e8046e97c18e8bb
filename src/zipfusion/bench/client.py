"""The client of ``zipfusion bench serve``: one rate's streaming requests against a server
(Poisson arrivals or a closed loop), each with its chunk times, TTFT, ITL, TPOT and latency,
while the server's /metrics are sampled.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time

from . import datasets
from .offline import log
from .server_process import Sampler, scrape


ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def request_body(prompt, max_tokens: int, endpoint: str) -> dict:
    """The streamed request of one prompt (completions, or chat: the text as a user message)."""
    body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        if not isinstance(prompt, str):
            raise ValueError("--endpoint chat sends text: use --prompt-format text or --dataset-path (ShareGPT)")
        return {**body, "messages": [{"role": "user", "content": prompt}]}
    return {**body, "prompt": prompt, "return_token_ids": True}


def chunk_tokens(event: dict) -> int:
    """Tokens a streamed event carries (chat deltas: one per choice with text, as vLLM counts)."""
    n = 0
    for c in event.get("choices", []):
        text = c.get("text") or (c.get("delta") or {}).get("content")
        n += len(c.get("token_ids") or ()) or bool(text)
    return n


async def send(client, url: str, prompt, max_tokens: int, model: str | None, timeout: float,
               endpoint: str = "completions") -> dict:
    """One streaming completion; the record of its times (perf_counter seconds) and tokens."""
    import httpx
    body = request_body(prompt, max_tokens, endpoint)
    if model:
        body["model"] = model
    rec = {"ok": False, "error": None, "expected_output_tokens": max_tokens, "chunks": [], "chunk_tokens": [],
           "tokens": 0}
    rec["sent"] = time.perf_counter()
    done = False
    try:
        async with client.stream("POST", url + ENDPOINTS[endpoint], json=body, timeout=timeout) as r:
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
                n = chunk_tokens(event)
                if n:
                    rec["chunks"].append(now)
                    rec["chunk_tokens"].append(n)
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
                   progress_s: float = 10.0, label: str = "", endpoint: str = "completions",
                   api_key: str | None = None) -> tuple[list[dict], float, Sampler]:
    """Every request of ``ds`` at ``rate`` (inf: all at once), at most ``max_concurrency`` in
    flight. Returns (records, seconds from the first send to the last answer, the sampler)."""
    import httpx
    rng = random.Random(seed)
    n = len(ds)
    conns = min(n, max_concurrency or n)
    limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    sampler = Sampler()
    recs: list[dict | None] = [None] * n
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout, connect=30), headers=headers) as client, \
            httpx.AsyncClient(timeout=30) as side:
        async def one(i: int) -> dict:
            """A request bounded by ``timeout`` seconds in all; whatever goes wrong is its error."""
            t0 = time.perf_counter()
            try:
                return await asyncio.wait_for(send(client, url, ds.prompts[i], ds.output_lens[i], model, timeout,
                                                   endpoint), timeout)
            except asyncio.TimeoutError:
                why = f"no answer within --timeout {timeout:g} s"
            except Exception as exc:  # noqa: BLE001 - counted as failed, never lost
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
