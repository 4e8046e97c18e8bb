#!/usr/bin/env python3
"""Where the host's time goes in one workload run (benchmarks/workloads.py's worker, same
scenario, mode and scale), without a profiler's overhead: each chosen scheduler, memory-manager
and runner function is wrapped with a wall clock (inclusive; a GPU wait inside it counts, which
is the point: the GPU idles while the host does this work between steps).

    python3 benchmarks/host_timers.py mix compressed 0.5            # H200: ~2 min
    python3 benchmarks/host_timers.py mix compressed 1 --smoke      # CPU, demo model
Prints calls, seconds and ms per call, slowest first; with $OUT set, writes
$OUT/timers_SCENARIO_MODE.json (the run's record without its step log, and the timers).
"""
from __future__ import annotations

import collections
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workloads  # noqa: E402
from zipfusion.engine import llm_engine, runner, scheduler  # noqa: E402
from zipfusion.memory import codec, host_tier, manager, page_table, prefix_cache  # noqa: E402

TIMED = {
    scheduler.Scheduler: ("schedule", "_schedule_prefill", "_schedule_decode", "_admit", "_room", "start_seal",
                          "finish_seal", "collect_full_pages", "_running_needs", "finish", "_reclaim", "_swap_in"),
    manager.KVCacheManager: ("alloc_pages", "_make_room_for_groups", "_compact_layer", "_repack", "_repack_plan",
                             "analyze_pages", "seal_analyzed", "_analyze", "_compress_batch", "_wave", "_affordable", "free_pages",
                             "_make_room_for_packing", "capacity_new_pages"),
    page_table.PageTable: ("sync", "sync_layer", "check"),
    host_tier.HostTier: ("put", "take", "drop"),
    prefix_cache.PrefixCache: ("make_room", "evict_pages", "match", "release", "insert"),
    llm_engine.LLMEngine: ("_note_kv_stats", "_launch_sample", "_finish_sample", "step"),
    runner.ModelRunner: ("run", "decode", "decode_inputs"),
    manager: ("move_ranges",),
    codec: ("analyze",),
}
TIMES: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])


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
    for owner, names in TIMED.items():
        for name in names:
            timed(owner, name)
    args = workloads.parse(["--scenarios", scen, "--modes", mode, "--scale", str(scale)] + sys.argv[4:])
    rec = workloads.worker(workloads.make_job(args, scen, mode))
    print(f"== {scen}/{mode} x{scale}: wall {rec['wall_s']:.1f} s, total {rec['total_tok_s']:,.0f} tok/s, "
          f"prefill steps {rec['prefill_steps_s']:.1f} s, seal {rec['seal_s']:.2f} s, schedule "
          f"{rec['schedule_s']:.2f} s (the timers below include the warm-up's calls)")
    for label, (n, s) in sorted(TIMES.items(), key=lambda kv: -kv[1][1]):
        print(f"{label:45s} {n:8d} {s:8.3f} s {1e3 * s / max(n, 1):8.3f} ms")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"timers_{scen}_{mode}.json"), "w") as f:
            json.dump({"record": {k: v for k, v in rec.items() if k != "step_log"}, "timers": dict(TIMES)}, f,
                      default=float)


if __name__ == "__main__":
    main()
