#!/usr/bin/env python3
"""The workload benchmark: the runs of the committed workload results (docs/benchmarks.md), kept to
reproduce them. Users run the same workloads with ``zipfusion bench throughput --dataset NAME``:
each scenario below is one of its datasets (the same prompts for the same seed) at a request count
and KV size, e.g. burst = ``--dataset burst --num-prompts 72 --kv-memory-gb 52``, long = ``--dataset
long32k --num-prompts 16 --kv-memory-gb 24 --max-model-len 33792``, deterministic = ``--dataset
burst --num-prompts 24 --output-len 128 --deterministic``, long_swap = long with ``--engine-args
'{"admission": "optimistic", "kv_host_memory_gb": 48}'``; prefill is ``zipfusion bench latency
--batch-size 1``'s kind of run. What this script adds: several scenarios and modes in one call, the
packed/sync modes, --prefix-cache on,off, --scale, --merge and the prefill MFU.

Each (scenario, mode) runs in its own process: ``LLM(model, kv_compression=..., kv_memory_gb=GB,
max_num_seqs=256, max_num_batched_tokens=8192)``, a warm-up that builds every step shape, then
every request of the scenario submitted at once (random token ids from a seeded generator, the
same in every mode; greedy, ``ignore_eos``) and the engine stepped until done (``LLM.generate``'s
loop, keeping each ``StepResult``). Wall time runs from the first request to the last token.

Scenarios (``SCENARIOS``; prompt + generated tokens per request, KV GiB):
  burst            72 x (8192 + 256), 52 GiB
  mix              600 requests, prompt ~ lognormal (median 1,200, cap 7,000), output ~ lognormal
                   (median 300, cap 2,000), sigma 0.8 both, 12 GiB
  long             16 x (32768 + 512), 24 GiB
  deterministic    24 x (8192 + 128), 16 GiB, LLM(deterministic=True)
  long_generation  64 x (1024 + 8192), 52 GiB
  prefill          (not by default) one prompt alone at a time: 8192, 8192 again, 32768; TTFT and MFU
  shared_prefix    32 groups x 16 requests sharing a 4,096-token system prompt, 256-token questions,
                   256 out, 16 GiB (prefix caching)
  multi_turn       64 conversations x 8 turns: each turn's prompt is the conversation so far (first
                   prompt 1,024 tokens, then 256 new tokens a turn), 256 out a turn, 24 GiB
  long_swap        the long scenario with vLLM's optimistic admission (it preempts): a preempted
                   request's pages go to a 48 GiB host tier and come back; long_recompute: the
                   same without the tier (recomputed)
Prefix caching: --prefix-cache on (default), off, or on,off (each record says ``prefix_cache``).
Modes: compressed, uncompressed, flashinfer (uncompressed KV, attention_backend="flashinfer";
skipped with the reason recorded off CUDA, without FlashInfer, and in deterministic mode);
compressed_packed and uncompressed_packed (packed_decode=True: decode rows behind one shared prefix
travel in pairs through the decode kernel, attention/packing.py); compressed_sync and uncompressed_sync
(async_scheduling=False: each step scheduled after the previous one's tokens are back; the engine's
default schedules the next step while this one computes); none of these pairs is in the default --modes.

    python3 benchmarks/workloads.py --out DIR                        # H200: everything (~35 min)
    python3 benchmarks/workloads.py --scale 0.25 --scenarios burst,mix --out DIR
    python3 benchmarks/workloads.py --smoke --out DIR                # CPU, demo model, tiny (< 60 s)
    python3 benchmarks/workloads.py --merge A/workloads.json B/workloads.json --out DIR
Writes DIR/workloads.json ({"meta", "records"}), workloads.md, workloads.png and steps.json (each
record's step log). --scale multiplies request counts and KV GiB alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import faulthandler
import json
import os
import signal
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from zipfusion.bench import MODES as USER_MODES, flashinfer_skip_reason  # noqa: E402
from zipfusion.bench.datasets import DATASETS, SIGMA, LengthDist, build, random_prompts  # noqa: E402
from zipfusion.bench.offline import (STEP_FIELDS, log, run_requests, run_worker, step_rows,  # noqa: E402
                                     summarize, warm_up)
from zipfusion.bench.report import fmt as _f, pyplot, versions, write_json  # noqa: E402

DEFAULT_MODES = ("compressed", "uncompressed", "flashinfer")
MODES = DEFAULT_MODES + ("compressed_packed", "uncompressed_packed", "compressed_sync", "uncompressed_sync")
BF16_PEAK = 989.4e12          # H100/H200 SXM dense bf16 FLOP/s (datasheet): the prefill MFU denominator
# issue 20's goals, total tok/s compressed / uncompressed (and / FlashInfer)
GOALS = {"burst": 1.03, "mix": 1.12, "long": 1.10, "long_generation": 1.25}


@dataclasses.dataclass(frozen=True)
class Scenario:
    requests: int
    prompt: int | tuple            # tokens per prompt; a tuple: each request's (no scaling)
    output: int                    # generated tokens per request
    kv_gb: float
    prompt_cap: int = 0            # > 0: prompt ~ lognormal(median=prompt, SIGMA) capped here
    output_cap: int = 0            # > 0: output ~ lognormal(median=output, SIGMA) capped here
    deterministic: bool = False
    sequential: bool = False       # one request at a time (prefill), instead of all at once
    shared_prefix: int = 0         # > 0: requests in groups of ``group``, each group's prompts start alike
    group: int = 1
    turns: int = 1                 # > 1: conversations; turn t + 1 = turn t's prompt + answer + ``turn_prompt``
    turn_prompt: int = 0
    admission: str = "estimate"
    host_gb: float | None = None   # kv_host_memory_gb (None: the engine's default)


def scenario(dataset: str, requests: int, kv_gb: float, **more) -> Scenario:
    """A scenario over one of ``zipfusion bench throughput``'s datasets: its lengths and sharing."""
    d = DATASETS[dataset]
    return dataclasses.replace(Scenario(requests, d.prompt, d.output, kv_gb, d.prompt_cap, d.output_cap,
                                        shared_prefix=d.shared_prefix, group=d.group, turns=d.turns,
                                        turn_prompt=d.turn_prompt), **more)


# each scenario is `zipfusion bench throughput --dataset DATASET --num-prompts REQUESTS --kv-memory-gb
# KV` (plus what ``more`` says: --output-len, --deterministic, --engine-args), but for prefill
SCENARIOS = {
    "burst": scenario("burst", 72, 52.0),
    "mix": scenario("mix", 600, 12.0),
    "long": scenario("long32k", 16, 24.0),
    "deterministic": scenario("burst", 24, 16.0, output=128, deterministic=True),
    "long_generation": scenario("long_generation", 64, 52.0),
    "prefill": Scenario(3, (8192, 8192, 32768), 1, 24.0, sequential=True),
    "shared_prefix": scenario("shared_prefix", 512, 16.0),
    "multi_turn": scenario("multi_turn", 64, 24.0),
    "long_swap": scenario("long32k", 16, 24.0, admission="optimistic", host_gb=48.0),
    "long_recompute": scenario("long32k", 16, 24.0, admission="optimistic", host_gb=0.0),
    # balanced_h100's run: --dataset reasoning --num-prompts 128 --output-len 500 --kv-memory-gb 4
    "reasoning": scenario("reasoning", 128, 4.0, output=500, output_cap=2000),
}
DEFAULT_SCENARIOS = ("burst", "mix", "long", "deterministic", "long_generation")
# --smoke: the demo model on the CPU (3 layers, 2 KV heads x 64: 1.5 KiB of KV per token), each
# scenario shrunk but still binding its KV budget where the full one does
SMOKE_SIZES = {      # requests, prompt, output, KV GiB, and what else shrinks; the rest as above
    "burst": (6, 64, 8, 0.0005),
    "mix": (12, 40, 4, 0.0005, dict(prompt_cap=160, output_cap=12)),
    "long": (2, 300, 6, 0.0007),
    "deterministic": (6, 64, 8, 0.0004),
    "long_generation": (4, 16, 40, 0.0003),
    "prefill": (3, (128, 128, 512), 1, 0.002),
    "shared_prefix": (12, 16, 6, 0.002, dict(shared_prefix=96, group=4)),
    "multi_turn": (4, 40, 6, 0.002, dict(turns=3, turn_prompt=20)),
    "long_swap": (6, 200, 60, 0.0012, dict(host_gb=0.05)),
    "long_recompute": (6, 200, 60, 0.0012),
    "reasoning": (8, 20, 40, 0.0003, dict(prompt_cap=60, output_cap=120)),
}
SMOKE = {name: dataclasses.replace(SCENARIOS[name], requests=r, prompt=p, output=o, kv_gb=kv,
                                   **(more[0] if more else {}))
         for name, (r, p, o, kv, *more) in SMOKE_SIZES.items()}


# ============================================================================ the harness
def workload(job: dict, vocab: int) -> tuple[list[list[int]], list[int], list[list[list[int]]]]:
    """The job's prompts (token ids), output lengths and each request's later turns: the dataset
    ``zipfusion bench throughput`` draws for the same lengths and seed (prefill: the lengths given)."""
    if isinstance(job["prompt"], list):
        n = len(job["prompt"])
        return random_prompts(job["prompt"], vocab, job["seed"]), [job["output"]] * n, [[]] * n
    dist = LengthDist(job["prompt"], job["output"], job["prompt_cap"], job["output_cap"], job.get("shared_prefix", 0),
                      job.get("group", 1), job.get("turns", 1), job.get("turn_prompt", 0))
    ds = build(dist, job.get("scenario", ""), job["requests"], seed=job["seed"], vocab=vocab)
    return ds.prompts, ds.output_lens, ds.turns


def model_flops(cfg, tokens: int, context: float) -> float:
    """Forward FLOPs of ``tokens`` tokens attending over ``context`` keys each on average:
    2 x (non-embedding parameters + lm head) per token, plus 4·L·Hq·D per (query, key) pair."""
    h, i, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    per_layer = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * i
    return 2 * tokens * L * per_layer + 4 * L * cfg.num_attention_heads * cfg.head_dim * tokens * context


def engine_kwargs(mode: str) -> dict:
    if mode in USER_MODES:                      # zipfusion bench's modes
        return dict(USER_MODES[mode][0])
    return {"compressed_packed": dict(kv_compression=True, packed_decode=True),
            "uncompressed_packed": dict(kv_compression=False, packed_decode=True),
            "compressed_sync": dict(kv_compression=True, async_scheduling=False),
            "uncompressed_sync": dict(kv_compression=False, async_scheduling=False)}[mode]


def llm_options(job: dict, kv_gb: float, max_len: int) -> dict:
    """The LLM options a job sets from its scenario, mode and flags (--engine-args may add others,
    not these)."""
    return dict(kv_memory_gb=kv_gb, max_num_seqs=job["max_num_seqs"], max_num_batched_tokens=job["batched_tokens"],
                max_model_len=max_len, device=job["device"], deterministic=job["deterministic"],
                enable_prefix_caching=job["prefix_cache"], admission=job.get("admission", "estimate"),
                **engine_kwargs(job["mode"]),
                **({"kv_host_memory_gb": job["host_gb"]} if job.get("host_gb") is not None else {}))


def kv_floor_gb(model: str, max_len: int) -> float:
    """KV GiB that one request of ``max_len`` tokens needs (open pages, plus the arena's reserve):
    a --scale below it would refuse to start."""
    from zipfusion.models import model_config
    c = model_config(model)
    return 1.1 * max_len * c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 2 / 2**30 + 0.25


def worker(job: dict) -> dict:
    import torch
    from zipfusion import LLM
    out = job["output_cap"] or job["output"]
    max_len = max(job["prompt"] if isinstance(job["prompt"], list) else [job["prompt_cap"] or job["prompt"]]) \
        + job.get("shared_prefix", 0) + (job.get("turns", 1) - 1) * (out + job.get("turn_prompt", 0)) + out + 16
    kv_gb = job["kv_gb"]
    if job["model"] != "demo" and kv_gb < kv_floor_gb(job["model"], max_len):
        job["kv_gb_scaled"], kv_gb = kv_gb, round(kv_floor_gb(job["model"], max_len), 2)
        log(f"  KV {job['kv_gb_scaled']:.2f} GiB holds no {max_len}-token request: {kv_gb} GiB")
    t0 = time.perf_counter()
    llm = LLM(job["model"], **llm_options(job, kv_gb, max_len),
              **job.get("engine", {}))                  # --engine-args: any other LLM option
    eng = llm.engine
    vocab = eng.model_config.vocab_size
    prompts, outs, turns = workload(job, vocab)
    build_s = time.perf_counter() - t0
    warm_up(eng, max_len)                        # (the host tier's pinned buffer too, before the clock starts)
    warm_s = time.perf_counter() - t0 - build_s
    base = eng.cache.stats()
    label = f"[{job['scenario']}/{job['mode']}]"
    reqs, steps, wall = run_requests(eng, prompts, outs, job["sequential"], label=label, turns=turns)
    new = sum(map(len, prompts)) + sum(len(m) for t in turns for m in t)    # tokens no earlier turn had
    rec = {"scenario": job["scenario"], "mode": job["mode"], **summarize(eng, reqs, steps, wall, base),
           "new_prompt_tokens": new,
           "kv_memory_gb": kv_gb, "host_tier_gb": eng.host_tier.budget / 2**30 if eng.host_tier else 0.0,
           "max_model_len": max_len, "build_s": build_s, "warm_up_s": warm_s,
           "device": torch.cuda.get_device_name() if eng.device.type == "cuda" else "cpu",
           "job": job, "step_fields": list(STEP_FIELDS), "step_log": step_rows(steps)}
    if job["sequential"]:               # prefill: each prompt alone; TTFT and model FLOP utilization
        rec["prefill"] = [{"tokens": len(r.prompt_ids), "ttft_s": r.token_times[0] - r.arrival_time,
                           "mfu": model_flops(eng.model_config, len(r.prompt_ids), len(r.prompt_ids) / 2)
                           / (r.token_times[0] - r.arrival_time) / BF16_PEAK} for r in reqs]
    return rec


# ============================================================================ the driver
def skip_reason(mode: str, scen: Scenario, device: str) -> str | None:
    return flashinfer_skip_reason(device, scen.deterministic) if mode == "flashinfer" else None


def make_job(args, name: str, mode: str, prefix_cache: bool = True) -> dict:
    scen = (SMOKE if args.smoke else SCENARIOS)[name]
    explicit = isinstance(scen.prompt, tuple)
    return {"scenario": name, "mode": mode, "model": args.model, "device": args.device, "seed": args.seed,
            "requests": scen.requests if explicit else max(1, round(scen.requests * args.scale)),
            "prompt": list(scen.prompt) if explicit else scen.prompt, "prompt_cap": scen.prompt_cap,
            "output": scen.output, "output_cap": scen.output_cap, "kv_gb": scen.kv_gb * args.scale,
            "deterministic": scen.deterministic, "sequential": scen.sequential, "scale": args.scale,
            "shared_prefix": scen.shared_prefix, "group": scen.group, "turns": scen.turns,
            "turn_prompt": scen.turn_prompt, "prefix_cache": prefix_cache, "admission": scen.admission,
            "host_gb": scen.host_gb,
            "max_num_seqs": args.max_num_seqs, "batched_tokens": args.batched_tokens,
            "engine": json.loads(args.engine_args)}


def run_job(job: dict, timeout: float, threads: int = 0) -> dict:
    """One (scenario, mode) in its own process (zipfusion.bench.offline.run_worker: its stderr
    shown as it comes, where it was kept if it runs out of time). ``threads``: the worker's CPU
    threads (0: torch's default)."""
    # the worker prints where each thread is 5 s before its time is up (faulthandler)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(job), str(max(1.0, timeout - 5))]
    rec = run_worker(cmd, timeout, threads)
    if "error" not in rec:
        return rec
    return {"scenario": job["scenario"], "mode": job["mode"], "requests": job["requests"],
            "prefix_cache": job["prefix_cache"], **rec}


def label(r: dict) -> str:
    """A record's scenario, marked when it ran without the prefix cache (records from before the
    cache existed carry no ``prefix_cache``)."""
    return r["scenario"] + ("/no-cache" if r.get("prefix_cache") is False else "")


def ratios(records: list[dict]) -> dict:
    """Per scenario: compressed / uncompressed and compressed / flashinfer of the throughput keys;
    where a mode ran with and without the prefix cache, cache on / off too."""
    keys = ("total_tok_s", "output_tok_s", "decode_tok_s", "decode_tok_s_at_peak_batch", "peak_batch")
    by = {(label(r), r["mode"]): r for r in records if "error" not in r and "skipped" not in r}
    out = {}

    def put(scen, name, a, b):
        out.setdefault(scen, {})[name] = {k: a[k] / b[k] if b.get(k) else float("nan") for k in keys}
        if a.get("run") != b.get("run"):                # merged from different calls: not side by side
            out[scen][name]["runs"] = [a.get("run"), b.get("run")]
    for scen in dict.fromkeys(label(r) for r in records):
        c = by.get((scen, "compressed"))
        for base in ("uncompressed", "flashinfer"):
            if c and by.get((scen, base)):
                put(scen, f"compressed/{base}", c, by[(scen, base)])
        for a, b in (("compressed_packed", "uncompressed_packed"),
                     ("compressed_packed", "compressed"), ("uncompressed_packed", "uncompressed"),
                     ("compressed_packed", "flashinfer"), ("compressed_sync", "uncompressed_sync"),
                     ("compressed", "compressed_sync"), ("uncompressed", "uncompressed_sync")):
            if by.get((scen, a)) and by.get((scen, b)):
                put(scen, f"{a}/{b}", by[(scen, a)], by[(scen, b)])
        for mode in MODES:
            off = by.get((scen + "/no-cache", mode))
            if by.get((scen, mode)) and off:
                put(scen, f"{mode}: cache on/off", by[(scen, mode)], off)
    return out


def preemption_cost(records: list[dict]) -> dict:
    """Per mode that ran both long_swap and long_recompute: the seconds preemption cost in each
    (``preemption_s``: recompute's share of prefill steps, plus the host tier's transfers) and
    swap / recompute (issue 22's goal: <= 0.05)."""
    by = {(r["scenario"], r["mode"]): r for r in records if "error" not in r and "skipped" not in r}
    out = {}
    for mode in MODES:
        swap, recompute = by.get(("long_swap", mode)), by.get(("long_recompute", mode))
        if swap and recompute and "preemption_s" in swap and recompute.get("preemption_s"):
            out[mode] = {"swap_s": swap["preemption_s"], "recompute_s": recompute["preemption_s"],
                         "swap/recompute": swap["preemption_s"] / recompute["preemption_s"]}
    return out


def identical_outputs(records: list[dict]) -> dict:
    """Per scenario run in two or more modes (or with and without the cache): one output hash?"""
    hashes = {}
    for r in records:
        if "outputs_sha256" in r:
            hashes.setdefault(r["scenario"], []).append(r["outputs_sha256"])
    return {s: len(set(h)) == 1 for s, h in hashes.items() if len(h) > 1}


COLUMNS = [("scenario", "{}"), ("mode", "{}"), ("requests", "{}"), ("wall_s", "{:.1f}"), ("total_tok_s", "{:,.0f}"),
           ("output_tok_s", "{:,.0f}"), ("decode_tok_s", "{:,.0f}"), ("decode_tok_s_at_peak_batch", "{:,.0f}"),
           ("peak_batch", "{}"), ("mean_batch", "{:.1f}"), ("preemptions", "{}"), ("prefill_tokens_computed", "{:,}"),
           ("prompt_tokens", "{:,}"), ("prefill_steps_s", "{:.1f}"), ("seal_s", "{:.2f}"),
           ("compaction_bytes", "{:.3g}"), ("compressible_fraction", "{:.1%}"), ("stored_ratio", "{:.3f}"),
           ("prefix_hit_tokens", "{:,}"), ("new_prompt_tokens", "{:,}"), ("ttft_hit_p50_s", "{:.3f}"),
           ("ttft_miss_p50_s", "{:.3f}")]


def table(records: list[dict], cols=COLUMNS) -> str:
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in records:
        if "error" in r or "skipped" in r:
            why = r.get("skipped") or "error: " + r["error"].splitlines()[0][:120]
            lines.append(f"| {label(r)} | {r['mode']} | {why} |" + " |" * (len(cols) - 3))
            continue
        lines.append("| " + " | ".join(_f(label(r) if c == "scenario" else r.get(c), fmt) for c, fmt in cols) + " |")
    return "\n".join(lines)


def report(result: dict) -> str:
    m, recs = result["meta"], result["records"]
    md = [f"## Workloads ({m['model']}, {m['device']}; {m['date']})", "",
          f"Command: `{m['command']}`"
          + (f" (scale {m['scale']:g}: request counts and KV GiB)" if m["scale"] != 1 else ""),
          f"torch {m['torch']}, triton {m['triton']}, flashinfer {m['flashinfer']}; max_num_seqs {m['max_num_seqs']}, "
          f"max_num_batched_tokens {m['batched_tokens']}. total tok/s = (prompt + output tokens) / wall; "
          "output tok/s = output tokens / wall; decode = pure decode steps (at peak: those with >= 0.9 x the "
          "peak batch, median).", "", table(recs), "", "| scenario | ratio | total tok/s | output tok/s | "
          "decode tok/s | at peak | peak batch | goal (total) |", "|---|---|---|---|---|---|---|---|"]
    for scen, rs in result["ratios"].items():
        for name, r in rs.items():
            goal = GOALS.get(scen)
            apart = f" (runs of {' and '.join(map(str, r['runs']))})" if r.get("runs") else ""
            md.append(f"| {scen} | {name}{apart} | " + " | ".join(_f(r[k], "{:.3f}x") for k in
                      ("total_tok_s", "output_tok_s", "decode_tok_s", "decode_tok_s_at_peak_batch", "peak_batch"))
                      + f" | {'>= %.2fx' % goal if goal else ''} |")
    md += ["", "Identical outputs across modes (SHA-256 of all output ids): "
           + ", ".join(f"{s}: {v}" for s, v in result["identical_outputs"].items())]
    for mode, c in result.get("preemption_cost", {}).items():
        md.append(f"Preemption cost, {mode}: {c['swap_s']:.2f} s with the host tier (long_swap), "
                  f"{c['recompute_s']:.2f} s recomputing (long_recompute): {c['swap/recompute']:.3f} (goal <= 0.05)")
    pre = [r for r in recs if r.get("prefill")]
    for r in pre:
        md.append(f"Prefill alone, {r['mode']}: " + "; ".join(f"{p['tokens']} tokens TTFT {p['ttft_s']:.3f} s, "
                                                           f"MFU {p['mfu']:.2f}" for p in r["prefill"]))
    return "\n".join(md) + "\n"


def plot(result: dict, path: str) -> bool:
    plt = pyplot()
    if plt is None or not result["ratios"]:
        return False
    scen = list(result["ratios"])
    keys = [("total_tok_s", "total tok/s (whole run)"),
            ("decode_tok_s_at_peak_batch", "decode tok/s at the peak batch"), ("peak_batch", "peak batch")]
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6))
    for ax, (k, title) in zip(axes, keys):
        for j, base in enumerate(("uncompressed", "flashinfer")):
            vals = [result["ratios"][s].get(f"compressed/{base}", {}).get(k, float("nan")) for s in scen]
            xs = [i + 0.38 * j for i in range(len(scen))]
            ax.bar(xs, [v if v == v else 0 for v in vals], width=0.38, label=f"compressed / {base}")
            for x, v in zip(xs, vals):
                if v == v:
                    ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
        if k == "total_tok_s":
            for i, s in enumerate(scen):
                if s in GOALS:
                    ax.plot([i - 0.2, i + 0.58], [GOALS[s]] * 2, "k:", lw=1)
        ax.axhline(1.0, color="gray", lw=1, ls="--")
        ax.set_xticks([i + 0.19 for i in range(len(scen))], scen, fontsize=7, rotation=15)
        ax.set_title(title, fontsize=9)
    axes[-1].legend(fontsize=7, loc="lower right")
    m = result["meta"]
    fig.suptitle(f"{m['model']} on {m['device']}, scale {m['scale']:g} (dotted: goal)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def write_outputs(result: dict, out: str, steps: dict | None = None) -> str:
    """workloads.json, workloads.md, workloads.png, and steps.json: the records' step logs (taken
    out of the records, plus ``steps`` of earlier runs)."""
    steps = dict(steps or {})
    for r in result["records"]:
        if "step_log" in r:
            steps[f"{label(r)}/{r['mode']}"] = {"fields": r.pop("step_fields"), "rows": r.pop("step_log")}
    result["ratios"], result["identical_outputs"] = ratios(result["records"]), identical_outputs(result["records"])
    result["preemption_cost"] = preemption_cost(result["records"])
    write_json(result, os.path.join(out, "workloads.json"))
    if steps:
        write_json(steps, os.path.join(out, "steps.json"))
    md = report(result)
    with open(os.path.join(out, "workloads.md"), "w") as f:
        f.write(md)
    try:
        plot(result, os.path.join(out, "workloads.png"))
    except Exception as exc:                        # a figure must not lose the numbers
        log(f"no figure: {exc}")
    return md


def short_table(records: list[dict]) -> str:
    cols = [("scenario", "{}"), ("mode", "{}"), ("total_tok_s", "{:,.0f}"), ("output_tok_s", "{:,.0f}"),
            ("decode_tok_s_at_peak_batch", "{:,.0f}"), ("peak_batch", "{}"), ("preemptions", "{}"),
            ("recompute_ratio", "{:.2f}"), ("wall_s", "{:.1f}")]
    rows = [[c for c, _ in cols]] + [
        [label(r), r["mode"], r.get("skipped") and "skipped" or "error"] if ("error" in r or "skipped" in r)
        else [_f(label(r) if c == "scenario" else r.get(c), f) for c, f in cols] for r in records]
    w = [max(len(row[i]) for row in rows if i < len(row)) for i in range(len(cols))]
    return "\n".join("  ".join(x.rjust(w[i]) if i > 1 else x.ljust(w[i]) for i, x in enumerate(row)) for row in rows)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/workloads")
    ap.add_argument("--scenarios", default=",".join(DEFAULT_SCENARIOS), help=f"of {list(SCENARIOS)}")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"of {list(MODES)}")
    ap.add_argument("--prefix-cache", default="on", help="on, off, or on,off (both, each its own process)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies request counts and KV GiB")
    ap.add_argument("--smoke", action="store_true", help="CPU, demo model, tiny sizes (each scenario shrunk)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per (scenario, mode) process")
    ap.add_argument("--model", default="llama-3.1-8b-random")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--batched-tokens", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine-args", default="{}", help='other LLM options as JSON, e.g. \'{"enforce_eager": true}\'')
    ap.add_argument("--jobs", type=int, default=1, help="worker processes at a time (timings need 1; --smoke: 2)")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="combine earlier workloads.json files (the later "
                    "file wins for a (scenario, mode) pair that ran ok) into --out; runs nothing")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:                      # wherever the command line left the default
        for k, v in dict(model="demo", device="cpu", batched_tokens=256, jobs=2).items():
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
    if args.device == "auto":
        import torch
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        extra = json.loads(args.engine_args)
    except json.JSONDecodeError as exc:
        ap.error(f"--engine-args is not JSON ({exc}); e.g. '{{\"enforce_eager\": true}}'")
    if not isinstance(extra, dict):
        ap.error(f"--engine-args must be a JSON object of LLM options, got {args.engine_args}")
    known = SMOKE if args.smoke else SCENARIOS                  # (main names unknown scenarios and modes)
    ours = {k for n in args.scenarios.split(",") if n in known for m in args.modes.split(",") if m in MODES
            for k in llm_options(make_job(args, n, m), 0.0, 0)}
    taken = sorted(set(extra) & ours)
    if taken:
        ap.error(f"--engine-args sets {taken}, which the benchmark sets itself (scenario, --modes or "
                 "another flag); use those instead")
    return args


def merge(paths: list[str], out: str) -> str:
    """Several runs (e.g. one device call per scenario) as one result; each run's steps.json, where
    it lies beside its workloads.json, comes along."""
    recs, parts, steps = {}, [], {}
    for p in paths:
        res = json.load(open(p))
        parts.append(res["meta"])
        for r in res["records"]:
            r.setdefault("run", res["meta"].get("date"))     # which call: ratios across calls are marked
            key = (label(r), r["mode"])
            if key not in recs or not ("error" in r or "skipped" in r):
                recs[key] = r
        sp = os.path.join(os.path.dirname(p), "steps.json")
        if os.path.exists(sp):
            steps.update(json.load(open(sp)))
    keep = {f"{s}/{m}" for s, m in recs}
    meta = {**parts[-1], "command": "; ".join(m["command"] for m in parts), "parts": parts,
            "scale": max(m["scale"] for m in parts)}
    os.makedirs(out, exist_ok=True)
    return write_outputs({"meta": meta, "records": list(recs.values())}, out,
                         {k: v for k, v in steps.items() if k in keep})


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None):
    if argv is None and "--worker" in sys.argv:        # the worker needs no driver argument parsing
        at = sys.argv.index("--worker")
        job = json.loads(sys.argv[at + 1])
        faulthandler.dump_traceback_later(float(sys.argv[at + 2]))      # where it hangs, if it does
        print("RESULT " + json.dumps(worker(job), default=float), flush=True)
        return
    args = parse(argv)
    signal.signal(signal.SIGTERM, _terminate)           # e.g. timeout(1): the running worker is killed too
    if args.merge:
        print(merge(args.merge, args.out))
        return
    names, modes = [s for s in args.scenarios.split(",") if s], [m for m in args.modes.split(",") if m]
    bad = sorted(set(names) - set(SCENARIOS)) + sorted(set(modes) - set(MODES))
    if bad:
        raise SystemExit(f"unknown scenario or mode {bad}; scenarios {list(SCENARIOS)}, modes {list(MODES)}")
    os.makedirs(args.out, exist_ok=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join([f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("ZIPFUSION_")]
                                + ["python3 benchmarks/workloads.py", *(sys.argv[1:] if argv is None else argv)]),
            "model": args.model, "device": args.device, "scale": args.scale, "smoke": args.smoke,
            "max_num_seqs": args.max_num_seqs, "batched_tokens": args.batched_tokens, "seed": args.seed,
            "lognormal_sigma": SIGMA, "timeout_s": args.timeout, **versions()}
    t0 = time.perf_counter()
    caches = [{"on": True, "off": False}[c] for c in args.prefix_cache.split(",") if c]
    jobs = [(s, m, c) for s in names for c in caches for m in modes]
    records: list[dict | None] = [None] * len(jobs)
    lock = threading.Lock()

    def one(i: int) -> None:
        name, mode, cache = jobs[i]
        why = skip_reason(mode, (SMOKE if args.smoke else SCENARIOS)[name], args.device)
        name_c = label({"scenario": name, "prefix_cache": cache})
        if why:
            log(f"[{i + 1}/{len(jobs)}] {name_c} / {mode}: skipped ({why})")
            rec = records[i] = {"scenario": name, "mode": mode, "prefix_cache": cache, "skipped": why}
        else:
            log(f"[{i + 1}/{len(jobs)}] {name_c} / {mode} (elapsed {time.perf_counter() - t0:.0f} s) ...")
            rec = records[i] = run_job(make_job(args, name, mode, cache), args.timeout,
                                       threads=1 if args.jobs > 1 and args.device == "cpu" else 0)
        rec["run"] = meta["date"]                      # this call's records are side by side
        if "error" in rec:
            log(f"  {name_c} / {mode} FAILED after {rec['process_s']:.0f} s: {rec['error'][-400:]}")
        elif "skipped" not in rec:
            meta["device"] = rec["device"]
            log(f"  {name_c} / {mode} done in {rec['process_s']:.0f} s: wall {rec['wall_s']:.1f} s, total "
                f"{rec['total_tok_s']:,.0f} tok/s, peak batch {rec['peak_batch']}, {rec['preemptions']} preemptions")
        with lock:                  # partial results kept after each process
            meta["seconds"] = time.perf_counter() - t0
            write_outputs({"meta": meta, "records": [dict(r) for r in records if r is not None]}, args.out)

    if args.jobs > 1:               # --smoke: processes side by side (the numbers mean nothing there)
        import concurrent.futures
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(one, range(len(jobs))))
    else:
        for i in range(len(jobs)):
            one(i)
    print(short_table(records))
    print("ratios: " + json.dumps({s: {k: round(v["total_tok_s"], 3) for k, v in rs.items()}
                                   for s, rs in ratios(records).items()}))


if __name__ == "__main__":
    main()
