"""``zipfusion bench latency``: one batch of B requests with L-token prompts and O output tokens,
each mode in its own process: the prefill time (until every request has its first token), then
the decode time per token (the rest / (O - 1)) and the whole batch's, over ``--num-iters`` batches
after ``--num-iters-warmup`` (fresh random prompts each: no prefix-cache hit)."""

from __future__ import annotations

import time

from . import datasets, report
from .offline import greedy, kv_numbers, log, note, run_modes, warm_up, weight_numbers
from .stats import summary
from .throughput import build_engine

RATIO_KEYS = {"prefill_s_p50": "prefill s", "decode_s_per_token_p50": "decode s/token", "e2e_s_p50": "batch s"}
COLUMNS = [("mode", "mode", "{}"), ("batch_size", "batch", "{}"), ("input_len", "prompt", "{}"),
           ("output_len", "output", "{}"), ("prefill_s_p50", "prefill s p50", "{:.4f}"),
           ("decode_ms_per_token_p50", "decode ms/token p50", "{:.2f}"),
           ("decode_ms_per_token_p99", "p99", "{:.2f}"), ("e2e_s_p50", "batch s p50", "{:.3f}"),
           ("preemptions", "preempt", "{}"), ("stored_ratio", "stored ratio", "{:.3f}")]


def one_batch(eng, prompts: list[list[int]], output_len: int) -> dict:
    """Runs one batch to the end; its prefill, decode and whole times."""
    t0 = time.perf_counter()
    reqs = [eng.add_request(p, greedy(output_len)) for p in prompts]
    prefilled = None
    steps = 0
    while eng.has_work():
        eng.step()
        steps += 1
        if prefilled is None and all(r.token_times for r in reqs):
            prefilled = time.perf_counter()
    end = time.perf_counter()
    return {"prefill_s": prefilled - t0, "decode_s": end - prefilled, "e2e_s": end - t0, "steps": steps,
            "decode_s_per_token": (end - prefilled) / (output_len - 1) if output_len > 1 else float("nan"),
            "output_tokens": sum(len(r.output_ids) for r in reqs)}


def worker(job: dict) -> dict:
    llm, build_s = build_engine(job)
    eng = llm.engine
    B = job["batch_size"]
    L, O = datasets.fit(job["input_len"], job["output_len"], eng.max_model_len)
    warm_up(eng, eng.max_model_len)
    vocab = eng.model_config.vocab_size
    runs = []
    total = job["num_iters_warmup"] + job["num_iters"]
    for it in range(total):
        r = one_batch(eng, datasets.random_prompts([L] * B, vocab, job["seed"] + it), O)
        kind = "warm-up" if it < job["num_iters_warmup"] else "measured"
        log(f"  [{job['mode']}] batch {it + 1}/{total} ({kind}): prefill {r['prefill_s']:.4f} s, "
            f"{1e3 * r['decode_s_per_token']:.2f} ms/token, {r['e2e_s']:.3f} s")
        if it >= job["num_iters_warmup"]:
            runs.append(r)
    rec = {"mode": job["mode"], "batch_size": B, "input_len": L, "output_len": O, "iterations": runs,
           "preemptions": eng.scheduler.num_preemptions, **kv_numbers(eng),
           "kv_memory_gb": eng.kv_memory_gb, **weight_numbers(eng), "max_model_len": eng.max_model_len,
           "build_s": build_s}
    for key in ("prefill_s", "decode_s_per_token", "e2e_s"):
        rec[key] = summary(r[key] for r in runs)
        rec[f"{key}_p50"], rec[f"{key}_p99"] = rec[key]["p50"], rec[key]["p99"]
    rec["decode_ms_per_token_p50"] = 1e3 * rec["decode_s_per_token_p50"]
    rec["decode_ms_per_token_p99"] = 1e3 * rec["decode_s_per_token_p99"]
    return rec


def plot(result: dict, path: str) -> bool:
    c = result["config"]
    return report.mode_bars([r for r in result["records"] if "prefill_s" in r],
                            [("prefill_s_p50", "prefill (s), p50", "{:.3g}"),
                             ("decode_ms_per_token_p50", "decode per token (ms), p50", "{:.3g}"),
                             ("e2e_s_p50", "whole batch (s), p50", "{:.3g}")],
                            f"zipfusion bench latency: {c['model']} on {result['meta']['device_name']}, batch "
                            f"{c['batch_size']} x ({c['input_len']} + {c['output_len']}) tokens", path)


def run(args, modes: list[str], device: str, engine: dict) -> int:
    for flag, v, low in (("--batch-size", args.batch_size, 1), ("--input-len", args.input_len, 1),
                         ("--output-len", args.output_len, 1), ("--num-iters", args.num_iters, 1),
                         ("--num-iters-warmup", args.num_iters_warmup, 0)):
        if v < low:
            raise ValueError(f"{flag} must be >= {low}, got {v}")
    job = {"model": args.model, "device": device, "kv_memory_gb": args.kv_memory_gb,
           "max_num_seqs": max(args.max_num_seqs or 0, args.batch_size),
           "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": args.max_model_len,
           "deterministic": args.deterministic, "engine": engine, "cpu_threads": args.cpu_threads,
           "batch_size": args.batch_size, "input_len": args.input_len, "output_len": args.output_len,
           "num_iters": args.num_iters, "num_iters_warmup": args.num_iters_warmup, "seed": args.seed}
    meta = report.run_meta("latency", args.argv, device)
    log(f"zipfusion bench latency: {args.model} on {meta['device_name']}, batch {args.batch_size} x "
        f"({args.input_len} + {args.output_len}) tokens, modes {', '.join(modes)}")
    records = run_modes("latency", modes, job, args.timeout, lambda r: (
        f"prefill {r['prefill_s_p50']:.4f} s, {r['decode_ms_per_token_p50']:.2f} ms/token, batch {r['e2e_s_p50']:.3f} s"))
    ran = {r["mode"]: r for r in records if "prefill_s" in r}
    result = {"meta": meta, "config": job, "records": records,
              "ratios": report.ratios(ran, tuple(RATIO_KEYS), modes[0])}
    print(report.save(result, args.out, plot))
    print(report.text_table([r if "prefill_s" in r else {"mode": r["mode"], "note": note(r)} for r in records],
                            COLUMNS))
    if result["ratios"]:
        print("time ratios (below 1: the first mode is faster)")
        print(report.ratio_table(result["ratios"], RATIO_KEYS))
    return 1 if any("error" in r for r in records) else 0
