#!/usr/bin/env python3
"""torch CPU threads vs speed: the demo model and SmolLM2-135M (GGUF), greedy, on the CPU.

For each model and each thread count (alternating, ``--repeats`` rounds) it times a 32-token
generation of "The capital of France is" and a 900-token prefill, and records the 1-minute load
average at each measurement (other processes on the box change the answer: with every core busy,
torch's spinning OpenMP threads fight them for the cores). Result: ``OUT.json``.

    python benchmarks/cpu_threads.py     # the committed result: benchmarks/results/cpu_threads/cpu_threads.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default=None, help="comma-separated (default: 1 and every core)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--models", default="demo,smollm2")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_threads" / "cpu_threads"))
    args = ap.parse_args(argv)
    import torch

    import zipfusion
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    counts = [int(t) for t in args.threads.split(",")] if args.threads else sorted({1, cores})
    rows = []
    for name in args.models.split(","):
        model = name
        if name == "smollm2":
            from zipfusion.analysis.checkpoints import smollm2_gguf
            model = str(smollm2_gguf())
        llm = zipfusion.LLM(model, device="cpu", kv_memory_gb=0.05, max_model_len=1024)
        sp = zipfusion.SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        long_prompt = list(range(5, 905))
        for _ in range(args.repeats):
            for threads in counts:
                torch.set_num_threads(threads)
                llm.generate([[5, 6]], zipfusion.SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
                t0 = time.perf_counter()
                llm.generate(["The capital of France is"], sp, use_tqdm=False)
                decode = time.perf_counter() - t0
                t0 = time.perf_counter()
                llm.generate([long_prompt], zipfusion.SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
                prefill = time.perf_counter() - t0
                row = {"model": name, "threads": threads, "generate_32_tokens_s": round(decode, 3),
                       "prefill_900_tokens_s": round(prefill, 3), "load_avg_1min": round(os.getloadavg()[0], 2)}
                rows.append(row)
                print(row, flush=True)
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(["python", "benchmarks/cpu_threads.py", *(argv or sys.argv[1:])]),
           "cores": cores, "torch_default_threads": cores, "rows": rows}
    Path(args.out + ".json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
