#!/usr/bin/env python3
"""Decode steps at equal rows from a steps.json (benchmarks/workloads.py's, or `zipfusion bench
throughput`'s OUT_steps.json): for each mode
and decode-row count, the steps without prefill, their wall time p50 / p90 / p99 (ms) and the
seal's mean host time (ms), and the rows' mean context (tokens; logs that record it). Compare a
compressed step with an uncompressed one at the same rows and contexts.

    python3 benchmarks/step_stats.py benchmarks/results/workloads_h100/async_long/long/steps.json
"""

import json
import sys

import numpy as np


def decode_steps(steps: dict) -> dict:
    """{(mode, rows): (wall ms, seal ms, mean context a row (NaN where not recorded)) arrays} of the
    steps without prefill."""
    out = {}
    for key, rec in steps.items():
        i = rec["fields"].index
        ctx = i("context_tokens") if "context_tokens" in rec["fields"] else None
        for r in rec["rows"]:
            rows = r[i("decode_rows")]
            if r[i("prefill_tokens")] == 0 and rows > 0:
                t, s, c = out.setdefault((key, rows), ([], [], []))
                t.append(1e3 * r[i("seconds")])
                s.append(1e3 * r[i("seal_s")])
                c.append(r[ctx] / rows if ctx is not None else float("nan"))
    return {k: tuple(np.array(a) for a in v) for k, v in out.items()}


def main(path: str) -> None:
    print("| rows | run | steps | p50 | p90 | p99 | seal mean | context a row |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for (key, rows), (t, s, c) in sorted(decode_steps(json.load(open(path))).items(), key=lambda x: (x[0][1], x[0][0])):
        p50, p90, p99 = np.percentile(t, [50, 90, 99])
        print(f"| {rows} | {key} | {t.size} | {p50:.2f} | {p90:.2f} | {p99:.2f} | {s.mean():.3f} | {c.mean():.0f} |")


if __name__ == "__main__":
    main(sys.argv[1])
