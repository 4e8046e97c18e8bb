"""``zipfusion bench steps``: decode steps at equal rows from a run's step log (``bench throughput``'s
OUT_steps.json): per mode and decode-row count, the steps without prefill, their wall time p50 / p90
/ p99 (ms), the seal's mean host time (ms) and the rows' mean context (tokens; NaN where the log has
none). A compressed step set against an uncompressed one at the same rows and contexts."""

from __future__ import annotations

import json
import math

import numpy as np


def decode_steps(steps: dict) -> dict:
    """{(mode, rows): (wall ms, seal ms, context a row) lists} of the steps without prefill."""
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
                c.append(r[ctx] / rows if ctx is not None else math.nan)
    return out


def table(steps: dict) -> str:
    """The markdown table, by rows then mode."""
    lines = ["| rows | run | steps | p50 | p90 | p99 | seal mean | context a row |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (key, rows), (t, s, c) in sorted(decode_steps(steps).items(), key=lambda x: (x[0][1], x[0][0])):
        p50, p90, p99 = np.percentile(t, [50, 90, 99])
        lines.append(f"| {rows} | {key} | {len(t)} | {p50:.2f} | {p90:.2f} | {p99:.2f} | {np.mean(s):.3f} | "
                     f"{np.mean(c):.0f} |")
    return "\n".join(lines)


def run(path: str) -> int:
    try:
        with open(path) as f:
            steps = json.load(f)
        text = table(steps)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    except (KeyError, TypeError, AttributeError):
        raise ValueError(f"{path} is not a step log (bench throughput's OUT_steps.json: "
                         "{mode: {'fields': [...], 'rows': [[...], ...]}})") from None
    print(text)
    return 0
