"""Prometheus metrics of a serving engine, named as vLLM's with a ``zipfusion:`` prefix.

Request and token metrics are fed by the engine thread after every step (so
``zipfusion:generation_tokens_total`` moves while requests run); the KV memory numbers
(``zipfusion:kv_<field>``) are read from the cache when /metrics is scraped. Every series has
vLLM's ``model_name`` label.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

# numeric fields of the memory manager's stats, exported as zipfusion:kv_<name>
KV_FIELDS = ("arena_bytes", "pool_chunks", "pending_chunks", "open_pages", "stored_pages",
             "capacity_new_pages", "pages_compressed", "pages_moved", "compactions", "stored_ratio",
             "pages_in_use", "bytes_in_use", "open_bytes_equivalent", "prefix_cache_pages",
             "prefix_cache_evictable_pages", "host_tier_bytes", "host_tier_pages", "swapped_out_pages",
             "swapped_in_pages", "recomputed_tokens")

# vLLM's buckets
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
FINISH_REASONS = ("stop", "length", "abort")


class Metrics:
    def __init__(self, model_name: str):
        disable_created_metrics()            # as vLLM: no *_created series
        self.registry = r = CollectorRegistry()
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
        self.prompt_tokens = counter("zipfusion:prompt_tokens", "Prompt tokens of requests that got their first token")
        self.generation_tokens = counter("zipfusion:generation_tokens", "Tokens generated (counted every step)")
        self.success = counter("zipfusion:request_success", "Finished requests by finish reason (abort included)",
                               ["finished_reason"])
        for reason in FINISH_REASONS:
            self.success.labels(finished_reason=reason, **label)
        self.rejected = counter("zipfusion:requests_rejected", "Requests refused before reaching the engine (4xx)")
        self.preemptions = counter("zipfusion:num_preemptions", "Preemptions (a running request sent back to wait)")
        self.running = gauge("zipfusion:num_requests_running", "Requests in the running batch")
        self.waiting = gauge("zipfusion:num_requests_waiting", "Requests waiting for admission")
        self.ttft = histogram("zipfusion:time_to_first_token_seconds", "Arrival to first token", TTFT_BUCKETS)
        self.itl = histogram("zipfusion:inter_token_latency_seconds", "Time between two output tokens", ITL_BUCKETS)
        self.e2e = histogram("zipfusion:e2e_request_latency_seconds", "Arrival to finish (or abort)", E2E_BUCKETS)
        self.request_prompt = histogram("zipfusion:request_prompt_tokens", "Prompt tokens per finished request",
                                        TOKEN_BUCKETS)
        self.request_generation = histogram("zipfusion:request_generation_tokens",
                                            "Generated tokens per finished request", TOKEN_BUCKETS)
        self.kv = {f: gauge(f"zipfusion:kv_{f}", f"KV memory: {f.replace('_', ' ')}") for f in KV_FIELDS}
        self.kv_usage = gauge("zipfusion:kv_cache_usage_perc", "Share of the KV arena in use (0..1)")
        self.layer_fraction = Gauge("zipfusion:kv_compressible_fraction", "Compressible blocks among stored pages",
                                    names + ["layer"], registry=r)
        self.prefix_queries = counter("zipfusion:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("zipfusion:prefix_cache_hits", "Of them, tokens found cached (not computed)")
        self._preemptions_seen = 0
        self._prefix_seen = (0, 0)

    # -- from the engine thread -------------------------------------------------------------
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

    # -- scrape -----------------------------------------------------------------------------
    def set_kv(self, stats: dict) -> None:
        for f, gauge in self.kv.items():
            value = stats.get(f)
            if isinstance(value, (int, float)):
                gauge.set(value)
        used, arena = stats.get("bytes_in_use"), stats.get("arena_bytes")
        if isinstance(used, (int, float)) and isinstance(arena, (int, float)) and arena:
            self.kv_usage.set(used / arena)
        for i, layer in enumerate(stats.get("layers") or []):
            frac = layer.get("compressible_fraction") if isinstance(layer, dict) else None
            if isinstance(frac, float) and frac == frac:
                self.layer_fraction.labels(layer=str(i), **self.label).set(frac)

    def render(self) -> bytes:
        return generate_latest(self.registry)
