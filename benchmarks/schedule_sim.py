#!/usr/bin/env python3
"""The engine's scheduling and memory at full size, without a GPU: the workload scenarios on the
Llama-3.1-8B shape through the real ``LLMEngine.step`` (scheduler, admission, preemption, seal
batching), the real ``KVCacheManager`` on the meta device (page tables, chunks, placement and
compaction plans, no bytes: ``zipfusion.testing.place_with_sizes``) and no model (every row samples token 0).
Each full page is "compressed" to the size of a page whose blocks are each compressible with
probability ``--fraction`` (the measured 96 % of random-weight Llama KV, or 0.92 for SmolLM2).

What it answers in seconds on a CPU: preemptions, prefill tokens computed vs prompt tokens,
peak and mean batch, pages sealed and left open, compaction bytes -- the numbers issue 20's goals
put on admission and capacity -- and, for shared_prefix and multi_turn, prefix-cache hits and
the host tier's swaps (its books, no bytes: ``zipfusion.testing.AccountingHostTier``, sized as
the engine sizes it on the H200 unless ``--host-gb``). It cannot say anything about GPU time; it does
report the host's seconds in the engine's own code between forwards (scheduling, the seal's host
side, the rest; and, with ``--async-scheduling`` (the engine's default on CUDA), the scheduling done beside
the forward), and a digest of every step's decisions and outputs: a change meant to leave the
decisions alone must leave it as it was. The default is the plain order (the engine's on the CPU;
with outputs of known length both orders make the same decisions: tests/test_schedule_sim.py).

    python3 benchmarks/schedule_sim.py                       # every scenario, both modes
    python3 benchmarks/schedule_sim.py --scenarios mix --modes compressed --admission conservative
    python3 benchmarks/schedule_sim.py --scenarios long_recompute --admission optimistic --seeds 0,1,2,3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

from workloads import DEFAULT_SCENARIOS, SCENARIOS, run_requests, workload  # noqa: E402
from zipfusion.bench.datasets import lognormal as lengths  # noqa: E402
from zipfusion.bench.serve_results import steady_start  # noqa: E402
from zipfusion.config import memory_options  # noqa: E402
from zipfusion.memory.kv_cache import ArenaKVCache  # noqa: E402
from zipfusion.memory.admission import MODES  # noqa: E402
from zipfusion.testing import AccountingHostTier, place_with_sizes  # noqa: E402
from zipfusion.format import PageLayout  # noqa: E402

L, H, D = 32, 8, 128                      # Llama-3.1-8B's KV shape
LAYOUT = PageLayout(H, D)


def requests(name: str, seed: int = 0, num: int | None = None) -> tuple:
    """(scenario, [(prompt tokens, max_tokens)]): workloads.py's scenario and the very lengths
    its worker draws for that seed (prompts, then outputs, from one generator); ``num``: that many
    requests drawn from its distributions instead of its own count."""
    sc = SCENARIOS[name]
    rng = random.Random(seed)
    prompts = (list(sc.prompt) if isinstance(sc.prompt, tuple) and num is None else
               lengths(sc.prompt if not isinstance(sc.prompt, tuple) else sc.prompt[0], sc.prompt_cap,
                       num or sc.requests, rng))
    return sc, list(zip(prompts, lengths(sc.output, sc.output_cap, len(prompts), rng)))


class DrawnSizes:
    """The page store's seal mechanics on a manager on the meta device (no bytes): nothing to
    analyse, so a page's size is drawn when it is placed (every block compressible with
    probability ``fraction``); the rest is the manager's."""

    def __init__(self, manager, fraction: float, seed: int):
        self.accounts, self.fraction = manager, fraction
        self.rng = np.random.default_rng(seed)

    def __getattr__(self, name):
        return getattr(self.accounts, name)

    def analyze_pages(self, ids) -> list[int]:
        return list(ids)

    def place_pages(self, job: list[int], min_capacity: int = 0, reclaim=None, keep=None) -> list[int]:
        keep = set(job if keep is None else keep)
        ids = [p for p in job if p in keep]
        if not ids:
            return []
        nc = self.rng.binomial(LAYOUT.num_blocks, self.fraction, size=(L, len(ids)))
        sizes = LAYOUT.page_bytes(0) - nc * 256
        return place_with_sizes(self.accounts, ids, sizes, min_capacity=min_capacity, reclaim=reclaim)


class SimCache(ArenaKVCache):
    """An ArenaKVCache on the meta device whose pages get drawn sizes when they are compressed."""

    def __init__(self, budget_bytes: int, compress: bool, fraction: float, seed: int, chunk_bytes: int | None = None,
                 **manager_options):
        super().__init__(L, H, D, budget_bytes, "meta", kv_compression=compress, chunk_bytes=chunk_bytes,
                         **manager_options)
        self.manager = DrawnSizes(self.manager, fraction, seed)


H200_HOST_GB = 30.0      # the engine's default host tier on the H200 runs: a quarter of its free host memory


def simulate(name: str, mode: str, fraction: float, admission: str, seed: int = 0,
             max_num_batched_tokens: int = 8192, chunk_pages: int | None = None, reserve_chunks: int | None = None,
             async_scheduling: bool = False,
             host_gb: float | None = None, num_requests: int | None = None,
             max_in_flight: int | None = None, kv_gb: float | None = None) -> dict:
    """One scenario through the real scheduler. Requests share no prefix, except in the scenarios
    made of shared system prompts or conversations (shared_prefix, multi_turn): their very token
    ids from workloads.py, turns sent as answers finish, the prefix cache on. ``host_gb``: the
    host tier (an ``AccountingHostTier``: its books, no bytes); None: the scenario's, else the
    engine's default on the H200 runs, min(2 x the KV memory, H200_HOST_GB). ``num_requests``:
    that many drawn from the scenario's lengths; ``max_in_flight``: a closed loop (the next
    request sent as one finishes), whose steady state -- from the send of the first quarter's
    last request to the last send -- is reported: mean running requests and KV bytes in use.
    ``kv_gb``: KV memory instead of the scenario's."""
    import torch
    from zipfusion import LLMEngine
    from zipfusion.engine.scheduler import Scheduler
    sc, reqs = requests(name, seed, num_requests)
    gb = sc.kv_gb if kv_gb is None else kv_gb
    eng = LLMEngine("demo", device="cpu", kv_memory_gb=0.01, max_model_len=256)
    V = eng.model_config.vocab_size
    if sc.shared_prefix or sc.turns > 1:
        job = {"seed": seed, "requests": sc.requests, "prompt": sc.prompt, "prompt_cap": sc.prompt_cap,
               "output": sc.output, "output_cap": sc.output_cap, "shared_prefix": sc.shared_prefix,
               "group": sc.group, "turns": sc.turns, "turn_prompt": sc.turn_prompt}
        prompts, outs, turns = workload(job, V)
    else:                                             # distinct prompts: no shared prefix
        prompts, outs, turns = [[10 + i] * p for i, (p, _) in enumerate(reqs)], [o for _, o in reqs], None
    longest = max(len(p) + (sc.turns - 1) * (o + sc.turn_prompt) + o for p, o in zip(prompts, outs)) + 16
    options = memory_options(admission) if reserve_chunks is None else {"reserve_chunks": reserve_chunks}
    eng.cache = SimCache(int(gb * 2**30), mode == "compressed", fraction, seed,
                         chunk_pages and chunk_pages * LAYOUT.open_page_bytes, **options)
    eng.max_model_len = longest
    if host_gb is None:
        host_gb = sc.host_gb if sc.host_gb is not None else min(2 * gb, H200_HOST_GB)
    tier = AccountingHostTier(eng.cache.manager.accounts, int(host_gb * 2**30)) if host_gb else None
    eng.scheduler = Scheduler(eng.cache, 256, max_num_batched_tokens, longest, admission=admission, host_tier=tier)
    eng.runner.run = lambda out: torch.zeros(len(out.decode) + sum(c.completes for c in out.prefill), V)
    eng.async_scheduling = async_scheduling         # as the engine does with async_scheduling=True
    t0 = time.perf_counter()
    arena, loop, done = eng.cache.stats()["arena_bytes"], [], [0]  # per step: (requests sent, running, shares)
    page_bytes = eng.cache.num_layers * LAYOUT.open_page_bytes   # an open page in every layer

    def on_step(e, res):
        done[0] += len(res.finished)
        sent = done[0] + len(e.scheduler.running) + len(e.scheduler.waiting)
        loop.append((sent, res.running, arena_shares(e, arena, page_bytes)))
    on_step = on_step if max_in_flight else None
    rs, results, _ = run_requests(eng, prompts, outs, turns=turns, progress_s=1e9, max_in_flight=max_in_flight,
                                  on_step=on_step)
    steps = [(res.decode_rows, res.prefill_tokens, res.running) for res in results]
    # the decisions themselves, to check that a change to the host code changed none of them
    digest = hashlib.sha256(repr((steps, [r.output_ids for r in rs])).encode()).hexdigest()[:16]
    m = eng.cache.manager
    peak = max(s[2] for s in steps)
    stats = eng.peak_kv_stats or {}
    return {"scenario": name, "mode": mode, "seed": seed, "admission": admission, "async_scheduling": async_scheduling,
            "fraction": fraction, "kv_gb": gb,
            "chunk_bytes": eng.cache.manager.chunk_bytes,
            "reserve_chunks": eng.cache.manager.reserve, "requests": len(rs), "preemptions": eng.scheduler.num_preemptions,
            "prompt_tokens": sum(len(r.prompt_ids) for r in rs),
            "new_prompt_tokens": sum(map(len, prompts)) + sum(len(x) for t in (turns or []) for x in t),
            "prefix_hit_tokens": eng.scheduler.prefix.stats.hit_tokens, "host_gb": host_gb,
            "swapped_in_pages": tier.stats.pages_in if tier else 0, "swapped_out_pages": tier.stats.pages_out if tier else 0,
            "prefill_tokens_computed": sum(s[1] for s in steps),
            "peak_batch": peak, "mean_batch": float(np.mean([s[0] for s in steps if s[1] == 0] or [0])),
            "steps": len(steps), "pages_compressed": m.pages_compressed, "compaction_bytes": m.bytes_moved,
            "pages_handed_to_seal": sum(res.sealed_pages for res in results),    # retries of pages left open count again
            "seal_placements": sum(res.sealed_pages > 0 for res in results),     # each ~1 ms of an H100's host
            "stored_ratio_at_peak": stats.get("stored_ratio"), "schedule_sha256": digest,
            # host seconds of the engine's own code (the runner here is a stand-in): what a GPU run pays between steps
            "host_schedule_s": sum(res.schedule_s for res in results), "host_seal_s": sum(res.seal_s for res in results),
            "host_other_s": sum(res.forward_s + res.finish_s for res in results),
            "host_ahead_s": sum(res.ahead_s for res in results),       # scheduled while a forward would run
            "sim_seconds": time.perf_counter() - t0, "max_in_flight": max_in_flight, **steady(loop, len(prompts), max_in_flight)}


def arena_shares(e, arena: int, page_bytes: int) -> dict:
    """Where the arena is at the end of a step, as shares of it: KV held (``in_use``: open pages in
    full, stored pages at their size; ``open``: the open pages alone), the new pages that still fit
    (``free``: free open slots and chunks, those compaction is sure to free included), the
    compression reserve, and the rest (``unusable``: holes in packed chunks compaction cannot be
    sure to free, chunk tails, the next-fit bound's slack); ``promised``: what admission keeps for
    the running requests' future pages, inside ``free``."""
    s, cache = e.cache.stats(), e.cache
    free = cache.capacity_new_pages(keep_reserve=True) * page_bytes / arena
    reserve = cache.capacity_new_pages(keep_reserve=False) * page_bytes / arena - free
    use = s["bytes_in_use"] / arena
    layers = s.get("layers") or []
    opened = sum(x["open_bytes"] for x in layers) / arena if layers else use
    promised = e.scheduler.admission.promised_pages(e.scheduler._running_needs()) * page_bytes / arena
    return {"in_use": use, "open": opened, "free": free, "reserve": reserve,
            "unusable": max(0.0, 1.0 - use - free - reserve), "promised": promised}


def steady(loop: list[tuple], n: int, max_in_flight: int | None) -> dict:
    """A closed loop's steady state: the steps from ``zipfusion bench serve``'s steady start
    (``steady_start``) to the last send (ramp and tail left out): mean running requests and the
    mean of each of :func:`arena_shares` (``steady_arena``)."""
    w = [(run, shares) for sent, run, shares in loop if steady_start(n, max_in_flight) <= sent < n]
    if not w:
        return {}
    run = np.array([r for r, _ in w])
    use = np.array([sh["in_use"] for _, sh in w])
    return {"steady_steps": len(w), "steady_mean_running": float(run.mean()),
            "steady_kv_in_use": float(use.mean()), "steady_kv_in_use_p90": float(np.percentile(use, 90)),
            "steady_arena": {k: float(np.mean([sh[k] for _, sh in w])) for k in w[0][1]}}


COMPARED = (("prefill_tokens_computed", "prefill tokens computed", -1), ("peak_batch", "peak batch", 1),
            ("preemptions", "preemptions", -1), ("pages_handed_to_seal", "pages handed to the seal", -1),
            ("compaction_bytes", "compaction bytes", -1),
            ("host_schedule_s", "host seconds scheduling", -1),
            ("host_seal_s", "host seconds sealing", -1))     # (key, title, +1: more is better, -1: less)


def compare(before: str, after: str, png: str | None) -> None:
    """A change's effect: each record of AFTER (scenario, mode, admission, seed) beside the same
    record of BEFORE, one panel per metric, AFTER / BEFORE as bars (1 = unchanged)."""
    from common import pyplot
    key = lambda r: (r["scenario"], r["mode"], r["admission"], r.get("seed", 0))  # noqa: E731
    old = {key(r): r for r in json.load(open(before))["records"]}
    pairs = [(old[key(r)], r) for r in json.load(open(after))["records"] if key(r) in old]
    labels = [f"{r['scenario']} {r['mode'][:6]} s{r.get('seed', 0)}" for _, r in pairs]
    for (b, a), label in zip(pairs, labels):
        print(label.ljust(34), "  ".join(f"{m} {b[m]:.4g} -> {a[m]:.4g}" for m, _, _ in COMPARED))
    plt = pyplot()
    if plt is None or not png:
        return
    fig, axes = plt.subplots(1, len(COMPARED), figsize=(4 * len(COMPARED), 0.3 * len(pairs) + 1.5), sharey=True)
    for ax, (m, title, better) in zip(axes, COMPARED):
        ratio = [a[m] / b[m] if b[m] >= (0.05 if m.endswith("_s") else 1) else float("nan")   # (ms: noise)
                 for b, a in pairs]
        ax.barh(range(len(pairs)), ratio, color=["tab:red" if (x - 1) * better < -1e-9 else "tab:green" for x in ratio])
        ax.axvline(1, color="k", lw=0.8)
        ax.set_title(f"{title}\n(after / before)", fontsize=9)
    axes[0].set_yticks(range(len(pairs)), labels, fontsize=7)
    axes[0].invert_yaxis()
    fig.suptitle(f"schedule_sim: {os.path.basename(after)} against {os.path.basename(before)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print("wrote", png)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", default=",".join(DEFAULT_SCENARIOS))
    ap.add_argument("--modes", default="compressed,uncompressed")
    ap.add_argument("--admission", default="estimate", choices=MODES)
    ap.add_argument("--fraction", type=float, default=0.96)
    ap.add_argument("--chunk-pages", type=int, default=None,
                    help="arena chunks of this many open pages (default: the manager's choice, 32 at these sizes)")
    ap.add_argument("--reserve-chunks", type=int, default=None,
                    help="compressed mode's reserve of chunks per layer kept for the seal (default: the engine's, "
                         "2, or config.LOOKAHEAD_RESERVE_CHUNKS with --admission lookahead)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="schedule each step while the last one runs, before its tokens are back (the engine's "
                         "default on CUDA; default here: after them, as --no-async-scheduling)")
    ap.add_argument("--host-gb", type=float, default=None,
                    help=f"host tier GiB (default: the scenario's, else min(2 x KV, {H200_HOST_GB:g}); 0: none)")
    ap.add_argument("--num-requests", type=int, default=None,
                    help="requests drawn from each scenario's lengths (default: the scenario's count)")
    ap.add_argument("--max-in-flight", type=int, default=None,
                    help="a closed loop: at most this many requests unfinished, the next sent as one finishes; "
                         "reports its steady state (mean running, KV in use)")
    ap.add_argument("--kv-gb", type=float, default=None, help="KV memory GiB (default: each scenario's)")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds of the lengths and page sizes drawn")
    ap.add_argument("--out", default=None, help="write the records as JSON here")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), default=None,
                    help="no run: plot two such JSON files side by side (--png)")
    ap.add_argument("--png", default=None)
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare, args.png)
    recs = []
    for seed, name, mode in ((int(s), n, m) for s in args.seeds.split(",") for n in args.scenarios.split(",")
                             for m in args.modes.split(",")):
        r = simulate(name, mode, args.fraction, args.admission, seed=seed, chunk_pages=args.chunk_pages,
                     reserve_chunks=args.reserve_chunks,
                     async_scheduling=args.async_scheduling, host_gb=args.host_gb,
                     num_requests=args.num_requests, max_in_flight=args.max_in_flight, kv_gb=args.kv_gb)
        recs.append(r)
        print(f"{name:16s} {mode:13s} seed {seed} preempt {r['preemptions']:4d}/{r['requests']:4d}  prefill "
              f"{r['prefill_tokens_computed'] / r['prompt_tokens']:.3f}x prompt  peak {r['peak_batch']:3d}  "
              f"mean {r['mean_batch']:6.1f}  compaction {r['compaction_bytes'] / 2**30:6.2f} GiB  "
              f"ratio {r['stored_ratio_at_peak']}  {r['schedule_sha256']}  sealing {r['pages_handed_to_seal']} pages "
              f"in {r['seal_placements']} placements  "
              f"swapped in {r['swapped_in_pages']}  "
              f"host: schedule {r['host_schedule_s']:.2f} s seal {r['host_seal_s']:.2f} s rest "
              f"{r['host_other_s']:.2f} s ahead {r['host_ahead_s']:.2f} s  ({r['sim_seconds']:.0f} s)"
              + (f"  steady: running {r['steady_mean_running']:.1f}, arena: "
                 + ", ".join(f"{k} {v:.3f}" for k, v in r["steady_arena"].items())
                 if "steady_mean_running" in r else ""), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"records": recs}, f, indent=1)


if __name__ == "__main__":
    main()
