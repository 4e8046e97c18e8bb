"""Where the host's time goes in a workload run, without a profiler's overhead: wall time of
chosen engine/memory functions (inclusive, host clock: any GPU wait inside counts), one run.
    python3 scripts/gpu/host_timers.py mix compressed 0.5
"""
import collections, functools, json, os, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import workloads
from zipfusion.engine import scheduler as S, llm_engine as E, runner as R
from zipfusion.memory import manager as M, page_table as PT, host_tier as HT, prefix_cache as PC, codec as C

T = collections.defaultdict(lambda: [0, 0.0])

def wrap(owner, name, label=None):
    f = getattr(owner, name)
    label = label or f"{getattr(owner, '__name__', owner)}.{name}"
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            e = T[label]; e[0] += 1; e[1] += time.perf_counter() - t
    setattr(owner, name, g)

for n in ("schedule", "_schedule_prefill", "_schedule_decode", "_admit", "_room", "seal_full_pages",
          "_running_needs", "finish", "_reclaim", "_swap_in"):
    wrap(S.Scheduler, n)
for n in ("alloc_pages", "_make_room_for_groups", "_compact_layer", "_repack", "_repack_plan", "seal_pages",
          "_analyze", "_compress_batch", "_wave", "_affordable", "free_pages", "_make_room_for_packing",
          "capacity_new_pages"):
    wrap(M.KVCacheManager, n)
wrap(M, "move_ranges", "manager.move_ranges")
wrap(C, "analyze", "codec.analyze")
for n in ("sync", "sync_layer", "check"):
    wrap(PT.PageTable, n)
for n in ("put", "take", "drop"):
    wrap(HT.HostTier, n)
for n in ("make_room", "evict_pages", "match", "release", "insert"):
    if hasattr(PC.PrefixCache, n):
        wrap(PC.PrefixCache, n)
for n in ("_note_kv_stats", "_sample", "step"):
    wrap(E.LLMEngine, n)
for n in ("run", "decode", "decode_inputs"):
    wrap(R.ModelRunner, n)

scen, mode, scale = sys.argv[1], sys.argv[2], float(sys.argv[3])
args = workloads.parse(["--scenarios", scen, "--modes", mode, "--scale", str(scale)] + sys.argv[4:])
job = workloads.make_job(args, scen, mode)
t0 = time.perf_counter()
rec = workloads.worker(job)
print(f"== {scen}/{mode} x{scale}: wall {rec['wall_s']:.1f} s, total {rec['total_tok_s']:,.0f} tok/s, "
      f"prefill steps {rec['prefill_steps_s']:.1f} s, seal {rec['seal_s']:.2f} s, schedule {rec['schedule_s']:.2f} s "
      f"(includes warm-up calls below)")
for k, (n, s) in sorted(T.items(), key=lambda kv: -kv[1][1]):
    print(f"{k:45s} {n:8d} {s:8.3f} s {1e3 * s / max(n, 1):8.3f} ms")
out = os.environ.get("OUT")
if out:
    json.dump({"record": {k: v for k, v in rec.items() if k != "step_log"}, "timers": dict(T)},
              open(os.path.join(out, f"timers_{scen}_{mode}.json"), "w"), default=float)
