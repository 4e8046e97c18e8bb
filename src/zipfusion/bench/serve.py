"""``zipfusion bench serve``, as ``vllm bench serve``: per mode a server, streaming requests at each
rate, latencies, throughput, goodput, /metrics and memory; ``--sweep`` finds the saturation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
import zlib

from ..extras import require
from . import FLASHINFER_MODES, datasets, flashinfer_skip_reason, report
from .client import run_rate
from .offline import log
from .serve_results import finish, mode_summary, rate_label, rate_row
from .server_process import SIZE_FLAGS, Server, counter_deltas, memory_check, one_scrape, server_flags

LOG = "zipfusion bench serve"
GROWTH_LINE = "GPU memory reserved by torch grew"


def parse_rates(text: str) -> list[float]:
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


def rate_seed(base: int, rate: float) -> int:
    """The token seed of a rate: the same prompts at a rate in every mode, others at another rate."""
    return base + zlib.crc32(rate_label(rate).encode())


class Run:
    """One mode's server and its rates."""

    def __init__(self, args, mode: str, dist: datasets.LengthDist, slo: dict, server: Server):
        self.args, self.mode, self.dist, self.slo, self.server = args, mode, dist, slo, server
        self.rows: list[dict] = []
        self.max_len, self.model, self.sizes = None, None, {}
        self.after_rate = lambda: None

    def connect(self) -> None:
        first = served_model(self.server.url, self.args.api_key)
        self.model, self.max_len = first["id"], first.get("max_model_len")
        self.sizes = {k: first.get(k) for k in ("kv_memory_gb", "weights_bytes", "weights_stored_bytes")}

    def count_tokens(self, text: str) -> int:
        import httpx
        r = httpx.post(self.server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30,
                       headers=auth_headers(self.args.api_key))
        r.raise_for_status()
        return r.json()["count"]

    def dataset(self, n: int, id_seed: int) -> datasets.Dataset:
        a = self.args
        if a.dataset_path:
            return datasets.sharegpt(a.dataset_path, n, seed=a.seed, count=self.count_tokens, max_len=self.max_len)
        return datasets.build(self.dist, a.dataset, n, seed=a.seed, id_seed=id_seed, vocab=a.vocab_size,
                              max_len=self.max_len, range_ratio=a.range_ratio, text=a.prompt_format == "text")

    def send_options(self) -> dict:
        return {"model": self.model, "timeout": self.args.timeout, "endpoint": self.args.endpoint,
                "api_key": self.args.api_key, "metrics_interval": self.args.metrics_interval,
                "progress_s": self.args.progress_s}

    def warm_up(self) -> None:
        """A few requests outside the numbers: all must succeed."""
        a = self.args
        if a.warmup < 1:
            return
        ds = self.dataset(a.warmup, a.seed + 999_983)
        ds.output_lens = [min(o, 16) for o in ds.output_lens]
        recs, _, _ = asyncio.run(run_rate(self.server.url, ds, math.inf, label=f"[{self.mode} warm-up]",
                                          **self.send_options()))
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
            self.server.url, ds, rate, max_concurrency=a.max_concurrency, seed=rate_seed(a.seed, rate), label=label,
            **self.send_options()))
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
            + (f", peak batch {row['server']['peak_running']:.0f}" if row["server"].get("metric_samples")
               else ", peak batch not sampled") + f", {row['server']['preemptions']:.0f} preemptions")
        self.after_rate()
        return row


def sweep_rates(saturation: float, fractions: list[float], grid: list[float]) -> list[float]:
    """The rates to run after the saturation probe: the first mode's grid plus this mode's own
    fractions past its end."""
    own = [f * saturation for f in fractions]
    if not grid:
        return sorted(float(f"{r:.3g}") for r in own)
    return sorted(set(grid) | {float(f"{r:.3g}") for r in own if r > max(grid) * 1.05})


def redact_key(argv: list[str] | None) -> list[str] | None:
    """The command line as recorded, an --api-key's value left out."""
    if argv is None:
        return None
    out = list(argv)
    for i, a in enumerate(out):
        if a == "--api-key" and i + 1 < len(out):
            out[i + 1] = "***"
        elif a.startswith("--api-key="):
            out[i] = "--api-key=***"
    return out


def auth_headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def served_model(url: str, api_key: str | None) -> dict:
    """The first model a server lists (a clear error for a missing or wrong key)."""
    import httpx
    r = httpx.get(url + "/v1/models", timeout=30, headers=auth_headers(api_key))
    if r.status_code == 401:
        raise ValueError(f"{url} wants an API key: pass --api-key KEY (or set $OPENAI_API_KEY)"
                         + (" (the one given was refused)" if api_key else ""))
    r.raise_for_status()
    return r.json()["data"][0]


def server_mode(model: dict) -> str:
    """The bench mode a running server is in, from its /v1/models."""
    dtype = model.get("kv_cache_dtype", "auto")
    if dtype.startswith("fp8"):
        return "fp8_lossless" if "lossless" in dtype else "fp8"
    if model.get("weight_compression") and model.get("kv_compression", True):
        return "weights"
    return "compressed" if model.get("kv_compression", True) else "uncompressed"


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
    mem["server_log"] = server.log_lines(GROWTH_LINE)[-20:]
    if mem["flat"] is False:
        log(f"[{mode}] WARNING: the server's memory grew over the run: {mem['growth_mib']} MiB")
        for line in mem["server_log"][-5:]:
            log(f"[{mode}]   server: {line}")
    return {"server": {**server.info(), "model": run.model, "max_model_len": run.max_len, **run.sizes,
                       "kv_memory_gb_asked": args.kv_memory_gb},
            "saturation_req_s": saturation, "rates": run.rows, "memory": mem,
            "summary": mode_summary(run.rows, slo, args.slo_attainment)}


def run(args, modes: list[str], device: str, slo: dict) -> int:
    if args.merge:
        return merge(args.merge, args.out)
    require(("httpx",), "bench", "zipfusion bench serve")
    if args.url and len(modes) > 1:
        raise ValueError("--url is one running server, so one mode: --compare starts a server per mode "
                         "(leave out --url)")
    if args.endpoint not in ("completions", "chat"):
        raise ValueError(f"--endpoint is completions or chat, got {args.endpoint!r}")
    if args.endpoint == "chat" and args.prompt_format != "text" and not args.dataset_path:
        raise ValueError("--endpoint chat sends text: add --prompt-format text, or give --dataset-path")
    if args.url:  # label the run with what the server reports
        served = served_model(args.url.rstrip("/"), args.api_key)
        modes = [server_mode(served)]
        args.model = served["id"]
        args.kv_memory_gb = served.get("kv_memory_gb", args.kv_memory_gb)
    if not args.url:
        require(("fastapi", "uvicorn", "prometheus_client"), "server", "zipfusion bench serve (its server)")
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
    if args.dataset_path:
        args.dataset = "sharegpt"
    dist = datasets.resolve("chat" if args.dataset_path else args.dataset, args.input_len, args.output_len,
                            args.shared_prefix, args.prefix_group)
    if dist.turns > 1:
        raise ValueError(f"--dataset {args.dataset}: conversations run in zipfusion bench throughput, not serve")
    datasets.build(dist, args.dataset, args.num_prompts, range_ratio=args.range_ratio)  # bad sizes: now
    meta = report.run_meta("serve", redact_key(args.argv), device)
    config = {"model": args.model, "device": device, "url": args.url, "modes": modes, "dataset": args.dataset,
              "length_dist": dataclasses.asdict(dist), "num_prompts": args.num_prompts, "prompt_format": args.prompt_format,
              "request_rates": None if args.sweep else [rate_label(r) for r in args.rates],
              "sweep": args.sweep, "sweep_points": args.sweep_points, "max_concurrency": args.max_concurrency,
              "goodput": slo, "slo_attainment": args.slo_attainment, "kv_memory_gb": args.kv_memory_gb,
              **{k: getattr(args, k) for k in SIZE_FLAGS[1:]}, "server_args": args.server_args, "seed": args.seed,
              "timeout_s": args.timeout, "endpoint": args.endpoint, "dataset_path": args.dataset_path}
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
        """The JSON so far after every rate: a run cut short keeps what it measured."""
        result["modes"][mode] = {**partial, "partial": True}
        report.write_json(result, json_path)

    grid: list[float] = []
    for i, mode in enumerate(modes):
        why = flashinfer_skip_reason(device) if mode in FLASHINFER_MODES and not args.url else None
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
    """Earlier runs' JSON as one comparison (the same workload, KV memory and SLO)."""
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
