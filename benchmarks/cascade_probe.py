#!/usr/bin/env python3
"""Where a cascade decode step (engine/cascade.py) spends its time, op by op, and whether its plan
is sound: a diagnostic for the stall seen on the H200 (docs/benchmarks.md, stop 33: with
``cascade_attention=True`` the shared_prefix workload stops after its first requests finish, the
host waiting at the prefix pieces' launch).

The shared_prefix scenario of benchmarks/workloads.py runs in this process with every
``CascadePlan.run`` wrapped: a device sync before and after each part (the prefix pieces, the
suffixes, the merge, the plain rows), each part's kernel called with ``validate=True`` (page ids,
locations and lengths checked against the cache), and one line per slow cascade step (or per
step with ``--every``) with the plan's shape: rows, groups, pieces, chunks, the largest key end.
A part that hangs leaves its name as the last line printed; the stacks follow (faulthandler) 5 s
before ``--timeout``.

    python3 benchmarks/cascade_probe.py --scale 0.25 --timeout 80          # H200, ~2 min
    python3 benchmarks/cascade_probe.py --smoke                            # CPU, demo model
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "src"))

import workloads  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def instrument(slow_s: float, every: bool) -> dict:
    """Time CascadePlan.run's parts (its ``trace`` hook) and check every paged prefill call's
    pages (validate=True); returns the counters."""
    import torch
    from zipfusion.engine import attention, cascade
    stats = {"steps": 0, "slow": 0, "parts_s": {}}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    real_run = cascade.CascadePlan.run
    real_prefill = attention.AttentionBackend.paged_prefill

    def paged_prefill(self, layer, q, plan, out=None, lse=None):        # pages and lengths checked
        return real_prefill(self, layer, q, plan, out=out, lse=lse, validate=True)

    def shape(p, q) -> str:
        ends = p.prefix.work.kv_end
        return (f"q rows {q.shape[0]}, plain {0 if p.plain is None else p.plain.numel()}, grouped "
                f"{p.grouped.numel()}, prefix rows {p.prefix.rows.numel()} in {len(ends)} pieces "
                f"(max key end {max(ends)}), suffix chunks {len(p.suffix.work.kv_end)} (max key end "
                f"{max(p.suffix.work.kv_end)}), parts {list(p.parts.shape)}, max row index "
                f"{int(p.prefix.rows.max())}")

    def run(self, backend, layer, q):
        if layer == 0:
            stats["steps"] += 1
            if every:
                log(f"  step {stats['steps']}: {shape(self, q)}")
        sync()
        t0 = time.perf_counter()
        marks = []

        def trace(name):                  # after each part: wait for the GPU, note the time
            sync()
            marks.append((name, time.perf_counter()))
            if layer == 0 and every:
                log(f"    {name} done")
        out = real_run(self, backend, layer, q, trace)
        t, prev = {}, t0
        for name, at in marks:
            t[name] = at - prev
            stats["parts_s"][name] = stats["parts_s"].get(name, 0.0) + at - prev
            prev = at
        if prev - t0 > slow_s:
            stats["slow"] += 1
            log(f"  slow cascade layer {layer} of step {stats['steps']} ({prev - t0:.2f} s: "
                + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.items()) + f"): {shape(self, q)}")
        return out

    attention.AttentionBackend.paged_prefill = paged_prefill
    cascade.CascadePlan.run = run
    return stats


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=0.25)
    ap.add_argument("--smoke", action="store_true", help="CPU, demo model, shared prefix of 48 tokens")
    ap.add_argument("--mode", default="compressed_cascade", choices=("compressed_cascade", "uncompressed_cascade"))
    ap.add_argument("--timeout", type=float, default=80.0, help="seconds; stacks are printed 5 s before")
    ap.add_argument("--slow", type=float, default=1.0, help="report a cascade layer slower than this (s)")
    ap.add_argument("--every", action="store_true", help="report every cascade step's plan and parts")
    args = ap.parse_args(argv)
    faulthandler.dump_traceback_later(max(1.0, args.timeout - 5), exit=True)
    wargs = workloads.parse(["--smoke"] if args.smoke else ["--scale", str(args.scale)])
    job = workloads.make_job(wargs, "shared_prefix", args.mode)
    if args.smoke:            # long enough a prefix to cascade over pieces of 2 pages; the kernel backend
        from zipfusion.engine import cascade
        cascade.MIN_SHARED_PAGES, cascade.PIECE_PAGES = 2, 2
        job.update(requests=8, shared_prefix=48, prompt=8, output=4, group=4)
        kw = workloads.engine_kwargs
        workloads.engine_kwargs = lambda m: {**kw(m), "attention_backend": "kernel"}
        workloads.warm_up = lambda eng, max_len: None
    stats = instrument(args.slow, args.every)
    rec = workloads.worker(job)
    print(json.dumps({"wall_s": rec["wall_s"], "requests": rec["requests"], "total_tok_s": rec["total_tok_s"],
                      "cascade_steps": stats["steps"], "slow_layers": stats["slow"],
                      "parts_s": {k: round(v, 4) for k, v in stats["parts_s"].items()}}))


if __name__ == "__main__":
    main()
