#!/usr/bin/env python3
"""The engine under load, the way a user runs it: ``LLM.generate`` / ``LLMEngine`` with many
requests and a KV budget that binds; compressed vs uncompressed, each in its own process.

Scenarios:
* ``burst``: N prompts of P random token ids at once, greedy, max_tokens M, ignore_eos (issue
  10: 72 x 8192 + 256 at 52 GiB on the Llama-3.1-8B shape).
* ``poisson``: a request mix (prompt 512..P tokens, outputs 32..2M) arriving as a Poisson
  process; the engine is stepped and requests are added when their time comes.
* ``prefill``: one prompt of P tokens alone, then one of 4P (TTFT, prefill MFU).

Per mode and scenario: decode tok/s (pure decode steps: tokens / their time; and at the peak
batch), total tok/s (generated tokens / wall time), TTFT, ITL p50/p99, peak and mean batch,
preemptions, compactions, bytes moved, compaction GPU time, compressible fraction of stored
pages, prefill MFU (model FLOPs of steps with >= P/2 prefill tokens / their time / bf16 peak).

    python3 benchmarks/load.py --out DIR                         # H200: the issue's scenarios
    python3 benchmarks/load.py --smoke --out DIR                 # CPU: demo model, tiny sizes
Writes DIR/load.json ({"records": [...]}, one record per mode and scenario), load.md, load.png.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

BF16_PEAK = 989.4e12          # H100/H200 SXM dense bf16 FLOP/s (datasheet), the MFU denominator
MODES = ("compressed", "uncompressed")


def log(*a):
    print(*a, flush=True)


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


# ------------------------------------------------------------------------------ one process
def model_flops(cfg, tokens: int, context: float) -> float:
    """Forward FLOPs of ``tokens`` tokens attending over ``context`` keys each on average:
    2 x (non-embedding parameters + lm head) per token, plus 4·L·Hq·D per (query, key) pair."""
    h, i, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    per_layer = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * i
    dense = 2 * tokens * L * per_layer
    attn = 4 * L * cfg.num_attention_heads * cfg.head_dim * tokens * context
    return dense + attn


def summarize(eng, reqs, wall: float, scenario: str, mode: str, prompt_len: int) -> dict:
    import torch
    steps = eng.step_log                       # engine.llm_engine.StepResult
    dec = [(x.decode_rows, x.seconds) for x in steps if x.prefill_tokens == 0 and x.decode_rows > 0]
    peak = max((x.running for x in steps), default=0)
    at_peak = [n / s for n, s in dec if n >= 0.9 * peak]
    gen = sum(len(r.output_ids) for r in reqs)
    ttft = [r.token_times[0] - r.arrival_time for r in reqs if r.token_times]
    itl = [b - a for r in reqs for a, b in zip(r.token_times, r.token_times[1:])]
    cfg = eng.model_config
    big = [(x.seconds, x.decode_rows, x.prefill_tokens) for x in steps if x.prefill_tokens >= prompt_len // 2]
    flops = sum(model_flops(cfg, p, prompt_len / 2) + model_flops(cfg, n, prompt_len) for s, n, p in big)
    stats = eng.peak_kv_stats or eng.cache.stats()          # at the peak: the end holds no pages
    fracs = [layer["compressible_fraction"] for layer in stats.get("layers", [])
             if layer["compressible_fraction"] == layer["compressible_fraction"]]
    mgr = getattr(eng.cache, "manager", None)
    dec_time = sum(s for _, s in dec)
    return {
        "scenario": scenario, "mode": mode, "requests": len(reqs),
        "decode_tok_s": sum(n for n, _ in dec) / dec_time if dec_time else float("nan"),
        "decode_tok_s_at_peak_batch": statistics.median(at_peak) if at_peak else float("nan"),
        "total_tok_s": gen / wall, "wall_s": wall, "generated_tokens": gen,
        "prompt_tokens": sum(len(r.prompt_ids) for r in reqs),
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99),
        "peak_batch": peak, "mean_batch": statistics.mean(n for n, _ in dec) if dec else 0.0,
        "preemptions": eng.scheduler.num_preemptions,
        "compactions": mgr.compactions if mgr else 0, "pages_moved": mgr.pages_moved if mgr else 0,
        "bytes_moved": mgr.bytes_moved if mgr else 0,
        "compaction_s": mgr.compaction_seconds() if mgr else 0.0,
        "compaction_share_of_decode": (mgr.compaction_seconds() / dec_time) if mgr and dec_time else 0.0,
        "compressible_fraction": statistics.mean(fracs) if fracs else float("nan"),
        "stored_ratio": stats.get("stored_ratio", 1.0),
        "prefill_mfu": flops / sum(s for s, _, _ in big) / BF16_PEAK if big else float("nan"),
        "steps": len(steps), "decode_steps": len(dec), "prefill_steps": len(steps) - len(dec),
        "time_in": {"schedule_s": sum(x.schedule_s for x in steps), "forward_s": sum(x.forward_s for x in steps),
                    "seal_s": sum(x.seal_s for x in steps),
                    "decode_steps_s": dec_time, "prefill_steps_s": sum(x.seconds for x in steps) - dec_time},
        "step_log": step_rows(steps),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }


STEP_FIELDS = ("decode_rows", "prefill_tokens", "running", "seconds", "schedule_s", "forward_s", "seal_s",
               "sealed_pages")


def step(eng):
    """One engine step, its StepResult kept in ``eng.step_log`` (this benchmark's list)."""
    res = eng.step()
    eng.step_log.append(res)
    return res


def step_rows(steps) -> list:
    return [[round(getattr(x, f), 5) if isinstance(getattr(x, f), float) else getattr(x, f) for f in STEP_FIELDS]
            for x in steps]


def warm_up(eng, rand, sp, prompt: int) -> None:
    """Outside the numbers: kernel builds for every step shape a run will see. A request decodes
    over its sealed pages alone, then beside a prompt's prefill chunks (mixed steps); then the
    engine's counters and step log start afresh."""
    eng.step_log = []
    first = eng.add_request(rand(min(1024, prompt)), sp(24))
    while len(first.output_ids) < 12:
        step(eng)
    eng.add_request(rand(min(1024, prompt)), sp(4))
    while eng.has_work():
        step(eng)
    eng.scheduler.num_preemptions = 0
    eng.step_log, eng.peak_kv_stats = [], None


def worker(args) -> dict:
    import torch

    from zipfusion import LLM, SamplingParams
    kw = dict(kv_compression=args.mode == "compressed", kv_memory_gb=args.kv_gb, deterministic=args.deterministic,
              max_num_batched_tokens=args.batched_tokens, device=args.device,
              max_model_len=max(args.prompt * 4 + args.max_tokens * 2 + 16, 1024) if args.scenario == "prefill"
              else args.prompt + 2 * args.max_tokens + 16)
    if args.model == "demo":
        kw["max_model_len"] = min(kw["max_model_len"], 1024)
    llm = LLM(args.model, **kw)
    eng = llm.engine
    V = eng.model_config.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    rand = lambda n: torch.randint(10, V - 10, (n,), generator=g).tolist()  # noqa: E731
    sp = lambda m: SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)  # noqa: E731
    warm_up(eng, rand, sp, args.prompt)
    t0 = time.perf_counter()
    if args.scenario == "burst":
        reqs = [eng.add_request(rand(args.prompt), sp(args.max_tokens)) for _ in range(args.requests)]
        while eng.has_work():
            step(eng)
    elif args.scenario == "poisson":
        import random
        rng = random.Random(args.seed)
        t, arrivals = 0.0, []
        for _ in range(args.requests):
            t += rng.expovariate(args.rate)
            arrivals.append((t, rand(rng.randint(min(512, args.prompt), args.prompt)),
                             rng.randint(min(32, args.max_tokens), 2 * args.max_tokens)))
        reqs, i = [], 0
        while i < len(arrivals) or eng.has_work():
            now = time.perf_counter() - t0
            while i < len(arrivals) and arrivals[i][0] <= now:
                r = eng.add_request(arrivals[i][1], sp(arrivals[i][2]))
                r.arrival_time = t0 + arrivals[i][0]
                reqs.append(r)
                i += 1
            if eng.has_work():
                step(eng)
            else:
                time.sleep(max(0.0, min(0.01, arrivals[i][0] - now)))
    else:             # prefill: TTFT of one prompt alone (the first one warms up), then a 4x longer one
        out = {}
        for name, n in (("first", args.prompt), ("steady", args.prompt), ("long", 4 * args.prompt)):
            eng.step_log = []
            r = eng.add_request(rand(n), sp(1))
            while eng.has_work():
                step(eng)
            secs = r.token_times[0] - r.arrival_time
            out[name] = {"tokens": n, "ttft_s": secs, "mfu": model_flops(eng.model_config, n, n / 2) / secs / BF16_PEAK,
                         "steps": step_rows(eng.step_log)}
            log(f"  prefill {name} {n} tokens: TTFT {secs:.3f} s, MFU {out[name]['mfu']:.2f}, steps {out[name]['steps']}")
        return {"scenario": "prefill", "mode": args.mode, "requests": 3, "prefill": out,
                "prefill_mfu": out["steady"]["mfu"], "ttft_s": out["steady"]["ttft_s"],
                "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    wall = time.perf_counter() - t0
    rec = summarize(eng, reqs, wall, args.scenario, args.mode, args.prompt)
    rec["deterministic"] = args.deterministic
    rec["outputs_sha256"] = hashlib.sha256(json.dumps([r.output_ids for r in reqs]).encode()).hexdigest()
    return rec


# ------------------------------------------------------------------------------ driver
def run_mode(args, scenario: str, mode: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--scenario", scenario, "--mode", mode,
           "--model", args.model, "--device", args.device, "--requests", str(args.requests),
           "--prompt", str(args.prompt), "--max-tokens", str(args.max_tokens), "--kv-gb", str(args.kv_gb),
           "--batched-tokens", str(args.batched_tokens), "--rate", str(args.rate), "--seed", str(args.seed)]
    cmd += ["--deterministic"] if args.deterministic else []
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    sys.stderr.write(p.stderr[-3000:] if p.returncode else "")
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        raise RuntimeError(f"{scenario}/{mode} failed (exit {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    rec = json.loads(lines[-1][len("RESULT "):])
    rec["process_s"] = time.perf_counter() - t0
    return rec


def ratios(records: list[dict]) -> dict:
    out = {}
    by = {(r["scenario"], r["mode"]): r for r in records}
    for scen in {r["scenario"] for r in records}:
        c, u = by.get((scen, "compressed")), by.get((scen, "uncompressed"))
        if c and u:
            out[scen] = {k: c[k] / u[k] for k in ("decode_tok_s", "decode_tok_s_at_peak_batch", "total_tok_s",
                                                   "peak_batch") if k in c and u.get(k)}
    return out


def table(records: list[dict]) -> str:
    cols = [("scenario", "{}"), ("mode", "{}"), ("requests", "{}"), ("decode_tok_s", "{:.0f}"),
            ("decode_tok_s_at_peak_batch", "{:.0f}"), ("total_tok_s", "{:.0f}"), ("ttft_p50_s", "{:.2f}"),
            ("itl_p50_s", "{:.4f}"), ("itl_p99_s", "{:.3f}"), ("peak_batch", "{}"), ("mean_batch", "{:.1f}"),
            ("preemptions", "{}"), ("compactions", "{}"), ("bytes_moved", "{:.3g}"),
            ("compaction_share_of_decode", "{:.2%}"), ("compressible_fraction", "{:.1%}"),
            ("prefill_mfu", "{:.2f}")]
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in records:
        lines.append("| " + " | ".join(fmt.format(r[c]) if c in r else "" for c, fmt in cols) + " |")
    return "\n".join(lines)


def plot(records: list[dict], path: str) -> None:
    from common import pyplot
    plt = pyplot()
    if plt is None:
        return
    rs = [r for r in records if r["scenario"] != "prefill"]
    keys = [("decode_tok_s", "decode tok/s"), ("total_tok_s", "total tok/s"), ("peak_batch", "peak batch")]
    scen = sorted({r["scenario"] for r in rs})
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2))
    for ax, (k, title) in zip(axes, keys):
        for j, mode in enumerate(MODES):
            vals = [next((r[k] for r in rs if r["scenario"] == s and r["mode"] == mode), 0) for s in scen]
            ax.bar([i + 0.4 * j for i in range(len(scen))], vals, width=0.4, label=mode)
        ax.set_xticks([i + 0.2 for i in range(len(scen))], scen)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--smoke", action="store_true", help="CPU: demo model, tiny sizes")
    ap.add_argument("--scenarios", default="burst,poisson,prefill")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--scenario", default="burst")
    ap.add_argument("--mode", default="compressed", choices=MODES)
    ap.add_argument("--model", default="llama-3.1-8b-random")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--requests", type=int, default=72)
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--kv-gb", type=float, default=52.0)
    ap.add_argument("--batched-tokens", type=int, default=8192)
    ap.add_argument("--rate", type=float, default=2.0, help="poisson: requests per second")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deterministic", action="store_true", help="LLM(deterministic=True) in every mode")
    args = ap.parse_args()
    if args.smoke:                      # tiny sizes, wherever the command line left the default
        smoke = dict(model="demo", device="cpu", requests=24, prompt=96, max_tokens=24, kv_gb=0.004,
                     batched_tokens=256, rate=50.0)
        for k, v in smoke.items():
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return
    os.makedirs(args.out, exist_ok=True)
    records = []
    for scen in args.scenarios.split(","):
        for mode in MODES:
            log(f"{scen} / {mode} ...")
            rec = run_mode(args, scen, mode)
            records.append(rec)
            log("  " + json.dumps({k: v for k, v in rec.items() if not isinstance(v, (dict, list))}))
    import torch
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "command": "python3 benchmarks/load.py " + " ".join(sys.argv[1:]),
            "model": args.model, "kv_memory_gb": args.kv_gb, "prompt": args.prompt, "max_tokens": args.max_tokens,
            "requests": args.requests, "max_num_batched_tokens": args.batched_tokens, "poisson_rate": args.rate,
            "deterministic": args.deterministic}
    result = {"meta": meta, "records": records, "ratios": ratios(records)}
    for scen in {r["scenario"] for r in records if "outputs_sha256" in r}:
        hashes = {r["outputs_sha256"] for r in records if r["scenario"] == scen}
        result.setdefault("identical_outputs_across_modes", {})[scen] = len(hashes) == 1
    name = "load_deterministic" if args.deterministic else "load"
    from common import write_json
    write_json(result, os.path.join(args.out, f"{name}.json"))
    md = (table(records) + "\n\ncompressed / uncompressed: " + json.dumps(result["ratios"])
          + "\nidentical outputs across modes: " + json.dumps(result.get("identical_outputs_across_modes")) + "\n")
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write(md)
    plot(records, os.path.join(args.out, f"{name}.png"))
    log(md)


if __name__ == "__main__":
    main()
