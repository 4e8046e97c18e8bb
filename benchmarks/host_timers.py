#!/usr/bin/env python3
"""Where the host's time goes in one workload run (benchmarks/workloads.py's worker, same
scenario, mode and scale), without a profiler's overhead: each chosen scheduler, memory-manager
and runner function is wrapped with a wall clock (inclusive; a GPU wait inside it counts, which
is the point: the GPU idles while the host does this work between steps).

    python3 benchmarks/host_timers.py mix compressed 0.5            # H200: ~2 min
    python3 benchmarks/host_timers.py mix compressed 1 --smoke      # CPU, demo model
    python3 benchmarks/host_timers.py long compressed 0.25 --sync-points   # H200
Prints calls, seconds and ms per call, slowest first; with $OUT set, writes
$OUT/timers_SCENARIO_MODE.json (the run's record without its step log, and the timers).

``--sync-points`` (CUDA): also turns on torch's sync debug mode and counts, by call site in
zipfusion, every operation that made the host wait for the GPU (a blocking copy, ``.item()``,
``.tolist()`` of a device tensor, a stream sync) during engine steps: the places that keep the
host from running ahead of the forward. Event waits (``copy.HostArray``) are not counted.
"""
from __future__ import annotations

import collections
import functools
import json
import os
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workloads  # noqa: E402
from zipfusion.engine import llm_engine, runner, scheduler  # noqa: E402
from zipfusion.memory import codec, compaction, host_tier, manager, page_store, page_table, prefix_cache  # noqa: E402

TIMED = {
    scheduler.Scheduler: ("schedule", "_schedule_prefill", "_schedule_decode", "_admit", "_running_needs", "finish",
                          "postprocess", "_fill_streams", "_promised", "after_forward", "seal_now"),
    page_store.PageStore: ("after_forward", "make_room", "alloc", "bring_back", "swap_in", "start_seal", "place",
                           "_collect", "_reclaim", "_unqueue"),
    manager.KVCacheManager: ("alloc_pages", "analyze_pages", "place_pages", "_compress_batch", "_wave",
                             "_affordable", "free_pages", "capacity_new_pages"),
    compaction: ("make_room_for_groups", "make_room_for_packing", "compact_layer", "repack", "repack_plan"),
    page_table.PageTable: ("sync", "sync_layer", "check"),
    host_tier.HostTier: ("put", "take", "drop"),
    prefix_cache.PrefixCache: ("make_room", "evict_pages", "match", "release", "insert"),
    llm_engine.LLMEngine: ("_note_kv_stats", "_launch_sample", "_finish_sample", "step"),
    runner.ModelRunner: ("run", "decode", "decode_inputs"),
    manager: ("move_ranges",),
    codec: ("analyze",),
}
TIMES: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
SYNCS: collections.Counter = collections.Counter()


def count_syncs(message, category, filename, lineno, file=None, line=None) -> None:
    """warnings.showwarning while --sync-points: the zipfusion frames that led to a sync, counted
    when inside an engine step."""
    stack = [f for f in traceback.extract_stack()[:-1] if "zipfusion" in f.filename or "benchmarks" in f.filename]
    if not any(f.name == "step" and f.filename.endswith("llm_engine.py") for f in stack):
        return
    site = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(stack[-5:]))
    SYNCS[site] += 1


def timed(owner, name: str) -> None:
    fn = getattr(owner, name)
    label = f"{getattr(owner, '__name__', owner)}.{name}".replace("zipfusion.memory.", "")

    @functools.wraps(fn)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            entry = TIMES[label]
            entry[0] += 1
            entry[1] += time.perf_counter() - t
    setattr(owner, name, wrapper)


def main() -> None:
    if len(sys.argv) < 4:
        raise SystemExit(__doc__)
    scen, mode, scale = sys.argv[1], sys.argv[2], float(sys.argv[3])
    rest = [a for a in sys.argv[4:] if a != "--sync-points"]
    if len(rest) < len(sys.argv[4:]):
        import torch
        torch.cuda.set_sync_debug_mode("warn")
        warnings.simplefilter("always")
        warnings.showwarning = count_syncs
    for owner, names in TIMED.items():
        for name in names:
            timed(owner, name)
    args = workloads.parse(["--scenarios", scen, "--modes", mode, "--scale", str(scale)] + rest)
    rec = workloads.worker(workloads.make_job(args, scen, mode))
    print(f"== {scen}/{mode} x{scale}: wall {rec['wall_s']:.1f} s, total {rec['total_tok_s']:,.0f} tok/s, "
          f"prefill steps {rec['prefill_steps_s']:.1f} s, seal {rec['seal_s']:.2f} s, schedule "
          f"{rec['schedule_s']:.2f} s (the timers below include the warm-up's calls)")
    for label, (n, s) in sorted(TIMES.items(), key=lambda kv: -kv[1][1]):
        print(f"{label:45s} {n:8d} {s:8.3f} s {1e3 * s / max(n, 1):8.3f} ms")
    if SYNCS:
        print("host waits for the GPU inside engine steps (count, innermost zipfusion frame first):")
        for site, n in SYNCS.most_common(25):
            print(f"{n:8d}  {site}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"timers_{scen}_{mode}.json"), "w") as f:
            json.dump({"record": {k: v for k, v in rec.items() if k != "step_log"}, "timers": dict(TIMES), "syncs": dict(SYNCS)}, f,
                      default=float)


if __name__ == "__main__":
    main()
