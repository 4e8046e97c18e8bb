"""Prometheus metrics of a serving engine: requests, tokens, latency, and the KV memory numbers."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# numeric fields of the memory manager's stats, exported as zipfusion_kv_<name>
KV_FIELDS = ("arena_bytes", "pool_chunks", "pending_chunks", "open_pages", "stored_pages",
             "capacity_new_pages", "pages_compressed", "pages_moved", "compactions", "stored_ratio",
             "pages_in_use", "bytes_in_use", "open_bytes_equivalent")


class Metrics:
    def __init__(self, engine):
        self.engine = engine
        self.registry = r = CollectorRegistry()
        self.requests = Counter("zipfusion_requests", "Requests accepted", registry=r)
        self.rejected = Counter("zipfusion_requests_rejected", "Requests refused as invalid", registry=r)
        self.generated = Counter("zipfusion_generation_tokens", "Tokens generated", registry=r)
        self.prompt = Counter("zipfusion_prompt_tokens", "Prompt tokens processed", registry=r)
        self.latency = Histogram("zipfusion_request_latency_seconds", "Request latency", registry=r,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.running = Gauge("zipfusion_running_requests", "Requests in the running batch", registry=r)
        self.waiting = Gauge("zipfusion_waiting_requests", "Requests waiting for admission", registry=r)
        self.preemptions = Gauge("zipfusion_preemptions", "Requests preempted so far", registry=r)
        self.kv = {f: Gauge(f"zipfusion_kv_{f}", f"KV memory: {f.replace('_', ' ')}", registry=r)
                   for f in KV_FIELDS}
        self.layer_fraction = Gauge("zipfusion_kv_compressible_fraction",
                                    "Compressible blocks among stored pages", ["layer"], registry=r)

    def finished(self, request, started: float) -> None:
        self.generated.inc(len(request.output_ids))
        self.prompt.inc(len(request.prompt_ids))
        self.latency.observe(time.perf_counter() - started)

    def render(self) -> bytes:
        sched = self.engine.scheduler
        self.running.set(len(sched.running))
        self.waiting.set(len(sched.waiting))
        self.preemptions.set(getattr(sched, "num_preemptions", 0))
        stats = self.engine.cache.stats()
        for f, gauge in self.kv.items():
            value = stats.get(f)
            if isinstance(value, (int, float)):
                gauge.set(value)
        for i, layer in enumerate(stats.get("layers") or []):
            frac = layer.get("compressible_fraction") if isinstance(layer, dict) else None
            if isinstance(frac, float) and frac == frac:
                self.layer_fraction.labels(layer=str(i)).set(frac)
        return generate_latest(self.registry)
