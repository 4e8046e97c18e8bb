#!/usr/bin/env python3
"""Summarize torch.profiler Chrome traces of engine steps (`zipfusion bench throughput
--profile-steps`, one trace per mode) into numbers that can be compared across modes:

* device time and launches of every kernel (and copy), and their grids;
* host time in the CUDA runtime calls (graph launches, event waits) and in pinned-memory staging
  (`aten::pin_memory`);
* per step, the host time between the wait for a step's tokens (`cudaEventSynchronize` longer
  than 0.5 ms) and the next `cudaGraphLaunch`: the gap in which the GPU has nothing queued.

    python3 benchmarks/trace_summary.py OUT.json trace_compressed.trace.json.gz trace_uncompressed.trace.json.gz
"""

import collections
import gzip
import json
import sys

import numpy as np


def summarize(path: str) -> dict:
    events = json.load(gzip.open(path) if path.endswith(".gz") else open(path))["traceEvents"]
    device = collections.defaultdict(lambda: {"calls": 0, "ms": 0.0, "grids": collections.Counter()})
    runtime = collections.defaultdict(lambda: {"calls": 0, "ms": 0.0})
    pin = {"calls": 0, "ms": 0.0}
    for e in events:
        cat = e.get("cat")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            d = device[e["name"][:100]]
            d["calls"] += 1
            d["ms"] += e["dur"] / 1e3
            if "grid" in e.get("args", {}):
                d["grids"][str(e["args"]["grid"])] += 1
        elif cat in ("cuda_runtime", "cuda_driver"):
            r = runtime[e["name"]]
            r["calls"] += 1
            r["ms"] += e["dur"] / 1e3
        elif cat == "cpu_op" and e["name"] == "aten::pin_memory":
            pin["calls"] += 1
            pin["ms"] += e["dur"] / 1e3
    calls = sorted((e for e in events if e.get("cat") == "cuda_runtime"
                    and e["name"] in ("cudaEventSynchronize", "cudaGraphLaunch")), key=lambda e: e["ts"])
    gaps, wait_end = [], None
    for e in calls:
        if e["name"] == "cudaEventSynchronize" and e["dur"] > 500:
            wait_end = e["ts"] + e["dur"]
        elif e["name"] == "cudaGraphLaunch" and wait_end is not None:
            gaps.append((e["ts"] - wait_end) / 1e3)
            wait_end = None
    kernels = sorted(device.items(), key=lambda kv: -kv[1]["ms"])
    busy = sum(d["ms"] for d in device.values())
    return {"device_busy_ms": busy,
            "device": [{"name": k, "calls": d["calls"], "ms": round(d["ms"], 3),
                        "mean_us": round(1e3 * d["ms"] / d["calls"], 2), "grids": dict(d["grids"].most_common(6))}
                       for k, d in kernels[:40]],
            "runtime": {k: {"calls": r["calls"], "ms": round(r["ms"], 3)} for k, r in
                        sorted(runtime.items(), key=lambda kv: -kv[1]["ms"])[:12]},
            "pin_memory": {"calls": pin["calls"], "ms": round(pin["ms"], 3)},
            "tokens_to_graph_launch_ms": {"steps": len(gaps), "p50": float(np.median(gaps)) if gaps else None,
                                          "mean": float(np.mean(gaps)) if gaps else None}}


def main(out: str, paths: list[str]) -> None:
    res = {p.rsplit("/", 1)[-1]: summarize(p) for p in paths}
    json.dump(res, open(out, "w"), indent=1)
    for name, r in res.items():
        g = r["tokens_to_graph_launch_ms"]
        print(f"== {name}: device busy {r['device_busy_ms']:.1f} ms; pin_memory {r['pin_memory']['calls']} calls "
              f"{r['pin_memory']['ms']:.1f} ms; tokens -> graph launch p50 {g['p50']} ms over {g['steps']} steps")
        for d in r["device"][:6]:
            print(f"   {d['ms']:9.1f} ms {d['calls']:6d} x {d['mean_us']:7.1f} us  {d['name'][:70]}")
        for k, v in list(r["runtime"].items())[:3]:
            print(f"   host {v['ms']:9.1f} ms {v['calls']:6d}  {k}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
