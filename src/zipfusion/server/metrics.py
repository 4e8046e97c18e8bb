"""Prometheus metrics of a serving engine, named as vLLM's with a ``zipfusion:`` prefix (or
vLLM's own with ``--metrics-prefix vllm``). Request and token metrics are fed after every step;
the KV numbers (``zipfusion:kv_<field>``) are read when /metrics is scraped.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# the memory manager's numbers, exported as zipfusion:kv_<name>: what each is
KV_GAUGES = {"arena_bytes": "Bytes of GPU memory the KV cache holds (its arena)",
             "pool_chunks": "Arena chunks free for new pages",
             "pending_chunks": "Arena chunks waiting to be freed once the GPU is done with them",
             "open_pages": "KV pages stored open (uncompressed, being filled or not compressible)",
             "stored_pages": "KV pages stored compressed",
             "capacity_new_pages": "Open pages that still fit in the free KV memory",
             "stored_ratio": "Compressed pages' bytes over their open size (1.0: no saving)",
             "pages_in_use": "KV pages allocated, prefix-cache pages included",
             "bytes_in_use": "Bytes of the arena the allocated pages take",
             "open_bytes_equivalent": "Bytes the allocated pages would take uncompressed",
             "prefix_cache_pages": "KV pages the prefix cache names",
             "prefix_cache_evictable_pages": "Prefix-cache pages no request holds (freed first when memory is needed)",
             "host_tier_bytes": "Bytes of host memory holding pages evicted from the GPU",
             "host_tier_pages": "Pages held in host memory"}
KV_COUNTERS = {"pages_compressed": "KV pages compressed since start",
               "pages_moved": "KV pages moved by compaction since start",
               "compactions": "Compactions of the KV arena since start",
               "swapped_out_pages": "KV pages copied to host memory since start",
               "swapped_in_pages": "KV pages brought back from host memory since start",
               "recomputed_tokens": "Prefill tokens computed again after a preemption, since start"}
PREFIXES = ("zipfusion", "vllm")

# vLLM's buckets
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
FINISH_REASONS = ("stop", "length", "abort")


class _KVCollector:
    """The KV numbers of the last scrape, as gauges and counters with their HELP text."""

    def __init__(self, prefix: str, label: dict):
        self.prefix, self.label, self.stats = prefix, label, {}

    def collect(self):
        names, values = list(self.label), list(self.label.values())
        for table, kind in ((KV_GAUGES, GaugeMetricFamily), (KV_COUNTERS, CounterMetricFamily)):
            for f, doc in table.items():
                value = self.stats.get(f)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    family = kind(f"{self.prefix}:kv_{f}", doc, labels=names)
                    family.add_metric(values, value)
                    yield family


class Metrics:
    def __init__(self, model_name: str, prefix: str = "zipfusion"):
        if prefix not in PREFIXES:
            raise ValueError(f"metrics prefix must be one of {', '.join(PREFIXES)}, got {prefix!r}")
        disable_created_metrics()            # as vLLM: no *_created series
        self.registry = r = CollectorRegistry()
        p = prefix
        label = {"model_name": model_name}
        names = ["model_name"]

        def counter(name, doc, extra=()):
            c = Counter(name, doc, names + list(extra), registry=r)
            return c if extra else c.labels(**label)

        def gauge(name, doc):
            return Gauge(name, doc, names, registry=r).labels(**label)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(**label)

        self.label = label
        self.prompt_tokens = counter(f"{p}:prompt_tokens", "Prompt tokens of the requests that got their first token")
        self.generation_tokens = counter(f"{p}:generation_tokens", "Tokens generated (counted every step)")
        self.success = counter(f"{p}:request_success", "Finished requests by finish reason (abort included)",
                               ["finished_reason"])
        for reason in FINISH_REASONS:
            self.success.labels(finished_reason=reason, **label)
        self.rejected = counter(f"{p}:requests_rejected", "Requests refused before reaching the engine (4xx)")
        self.preemptions = counter(f"{p}:num_preemptions", "Preemptions (a running request sent back to wait)")
        self.running = gauge(f"{p}:num_requests_running", "Requests in the running batch")
        self.waiting = gauge(f"{p}:num_requests_waiting", "Requests waiting for admission")
        self.ttft = histogram(f"{p}:time_to_first_token_seconds", "Seconds from a request's arrival to its first token", TTFT_BUCKETS)
        self.itl = histogram(f"{p}:inter_token_latency_seconds", "Seconds between two output tokens of a request", ITL_BUCKETS)
        self.e2e = histogram(f"{p}:e2e_request_latency_seconds", "Seconds from a request's arrival to its end (finish or abort)", E2E_BUCKETS)
        self.request_prompt = histogram(f"{p}:request_prompt_tokens", "Prompt tokens per finished request",
                                        TOKEN_BUCKETS)
        self.request_generation = histogram(f"{p}:request_generation_tokens",
                                            "Generated tokens per finished request", TOKEN_BUCKETS)
        self.kv = _KVCollector(p, label)
        r.register(self.kv)
        self.kv_usage = gauge(f"{p}:kv_cache_usage_perc", "Share of the KV memory held by requests (0..1; "
                                                           "evictable prefix-cache pages not counted)")
        self.kv_cached = gauge(f"{p}:kv_cache_cached_perc", "Share of the KV memory held by evictable "
                                                             "prefix-cache pages (0..1; reused on a hit, freed first)")
        self.layer_fraction = Gauge(f"{p}:kv_compressible_fraction", "Share of the stored pages' blocks that compress, per layer",
                                    names + ["layer"], registry=r)
        self.prefix_queries = counter(f"{p}:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter(f"{p}:prefix_cache_hits", "Of them, tokens found cached (not computed)")
        self._preemptions_seen = 0
        self._prefix_seen = (0, 0)

    def on_tokens(self, req, sent: int, new: int) -> None:
        """``new`` tokens after the ``sent`` already counted."""
        if not new:
            return
        self.generation_tokens.inc(new)
        times = req.token_times
        if sent == 0:
            self.prompt_tokens.inc(len(req.prompt_ids))
            if times:
                self.ttft.observe(times[0] - req.arrival_time)
        for k in range(max(sent, 1), min(sent + new, len(times))):
            self.itl.observe(times[k] - times[k - 1])

    def on_finished(self, req) -> None:
        self.success.labels(finished_reason=req.finish_reason or "abort", **self.label).inc()
        self.e2e.observe(time.perf_counter() - req.arrival_time)
        self.request_prompt.observe(len(req.prompt_ids))
        self.request_generation.observe(len(req.output_ids))

    def on_step(self, engine) -> None:
        sched = engine.scheduler
        self.running.set(len(sched.running))
        self.waiting.set(len(sched.waiting))
        total = getattr(sched, "num_preemptions", 0)
        if total > self._preemptions_seen:
            self.preemptions.inc(total - self._preemptions_seen)
            self._preemptions_seen = total
        prefix = getattr(sched, "prefix", None)
        if prefix is not None:
            seen, now = self._prefix_seen, (prefix.stats.queried_tokens, prefix.stats.hit_tokens)
            self.prefix_queries.inc(now[0] - seen[0])
            self.prefix_hits.inc(now[1] - seen[1])
            self._prefix_seen = now

    def set_kv(self, stats: dict) -> None:
        self.kv.stats = stats
        used, arena = stats.get("bytes_in_use"), stats.get("arena_bytes")
        pages, idle = stats.get("pages_in_use") or 0, stats.get("prefix_cache_evictable_pages") or 0
        if isinstance(used, (int, float)) and isinstance(arena, (int, float)) and arena:
            cached = used * min(idle, pages) / pages if pages else 0.0  # at the average page's size
            self.kv_usage.set((used - cached) / arena)
            self.kv_cached.set(cached / arena)
        for i, layer in enumerate(stats.get("layers") or []):
            frac = layer.get("compressible_fraction") if isinstance(layer, dict) else None
            if isinstance(frac, float) and frac == frac:
                self.layer_fraction.labels(layer=str(i), **self.label).set(frac)

    def render(self) -> bytes:
        return generate_latest(self.registry)
