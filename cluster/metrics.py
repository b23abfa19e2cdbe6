"""Prometheus metrics of the server (``GET /metrics``), vLLM-style names under ``syncless:``.

Gauges are read from the engine thread's latest snapshot at scrape time;
latency histograms are fed by the asyncio side as deltas arrive.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class _Throughput:
    """Tokens per second over a sliding window of engine snapshots."""

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self.samples: deque[tuple[float, int, int]] = deque()

    def add(self, t: float, prompt: int, generation: int) -> None:
        self.samples.append((t, prompt, generation))
        while len(self.samples) > 2 and self.samples[0][0] < t - self.window_s:
            self.samples.popleft()

    def rates(self, now: float) -> tuple[float, float]:
        if len(self.samples) < 2:
            return 0.0, 0.0
        t0, p0, g0 = self.samples[0]
        t1, p1, g1 = self.samples[-1]
        span = max(now - t0, t1 - t0, 1e-6)
        if now - t1 > self.window_s:  # idle for a whole window
            return 0.0, 0.0
        return (p1 - p0) / span, (g1 - g0) / span


class _EngineCollector:
    def __init__(self, metrics: "ServerMetrics"):
        self.m = metrics

    def collect(self):
        snap = self.m.snapshot
        labels = ["model_name"]
        name = [self.m.model_name]

        def gauge(metric, doc, value):
            g = GaugeMetricFamily(metric, doc, labels=labels)
            g.add_metric(name, float(value))
            return g

        def counter(metric, doc, value):
            c = CounterMetricFamily(metric, doc, labels=labels)
            c.add_metric(name, float(value))
            return c

        yield gauge("syncless:num_requests_running", "Sequences running on the workers.", snap.get("running", 0))
        yield gauge("syncless:num_requests_waiting", "Sequences waiting to be scheduled.", snap.get("waiting", 0))
        yield gauge("syncless:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).",
                    snap.get("kv_usage", 0.0))
        yield gauge("syncless:kv_cache_blocks_free", "Free KV-cache blocks.", snap.get("num_free_blocks", 0))
        yield gauge("syncless:kv_cache_blocks_total", "KV-cache blocks.", snap.get("num_blocks", 0))
        yield gauge("syncless:num_requests_in_flight", "Requests the server is streaming.",
                    self.m.in_flight())
        yield gauge("syncless:engine_healthy", "1 while the engine accepts requests.", self.m.healthy())
        p_rate, g_rate = self.m.throughput.rates(time.monotonic())
        yield gauge("syncless:prompt_tokens_per_second", "Prompt tokens admitted per second (10 s window).",
                    p_rate)
        yield gauge("syncless:generation_tokens_per_second", "Tokens generated per second (10 s window).",
                    g_rate)
        yield counter("syncless:prompt_tokens", "Prompt tokens admitted.", snap.get("prompt_tokens", 0))
        yield counter("syncless:generation_tokens", "Tokens generated.", snap.get("generation_tokens", 0))
        yield counter("syncless:num_preemptions", "Preemptions (by recompute).", snap.get("num_preemptions", 0))
        yield counter("syncless:engine_steps", "Engine steps submitted.", snap.get("steps", 0))
        pc = snap.get("prefix_cache") or {}  # Scheduler.prefix_cache_stats(), in tokens
        yield counter("syncless:prefix_cache_queries", "Prefix cache queries: tokens of placed requests looked up.",
                      pc.get("queries", 0))
        yield counter("syncless:prefix_cache_hits", "Prefix cache hits: looked-up tokens found cached.",
                      pc.get("hits", 0))
        yield gauge("syncless:prefix_cache_hit_rate", "Prefix cache hits / queries since the engine started.",
                    pc.get("hit_rate", 0.0))
        yield gauge("syncless:prefix_cache_blocks", "KV blocks holding cached prefix content.",
                    pc.get("num_cached_blocks", 0))
        yield counter("syncless:prefix_cache_evictions", "Cached KV blocks evicted for new allocations.",
                      pc.get("evictions", 0))


class ServerMetrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.snapshot: dict[str, Any] = {}
        self.in_flight = lambda: 0
        self.healthy = lambda: 1
        self.throughput = _Throughput()
        self.registry = CollectorRegistry(auto_describe=True)
        lab = ["model_name"]
        self.ttft = Histogram("syncless:time_to_first_token_seconds", "Time to first token.", lab,
                              buckets=_TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram("syncless:inter_token_latency_seconds", "Time between consecutive tokens.", lab,
                             buckets=_ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("syncless:e2e_request_latency_seconds", "Request latency, arrival to finish.", lab,
                             buckets=_E2E_BUCKETS, registry=self.registry).labels(model_name)
        self._finished = Counter("syncless:request_success", "Finished requests by finish reason.",
                                 lab + ["finished_reason"], registry=self.registry)
        self._http = Counter("syncless:api_requests", "API requests by endpoint and status code.",
                             lab + ["endpoint", "status"], registry=self.registry)
        self.registry.register(_EngineCollector(self))

    def bind(self, engine) -> None:
        self.in_flight = lambda: engine.num_in_flight
        self.healthy = lambda: 1 if engine.healthy else 0

    # fed by the AsyncEngine (event-loop thread)
    def observe_ttft(self, s: float) -> None:
        self.ttft.observe(s)

    def observe_itl(self, s: float) -> None:
        self.itl.observe(s)

    def observe_finished(self, out, latency_s: float) -> None:
        self.e2e.observe(latency_s)
        for o in out.outputs:
            self._finished.labels(self.model_name, o.finish_reason or "unknown").inc()

    def update_engine(self, snap: dict[str, Any]) -> None:
        self.snapshot = snap
        self.throughput.add(snap.get("time", time.monotonic()), snap.get("prompt_tokens", 0),
                            snap.get("generation_tokens", 0))

    def count_request(self, endpoint: str, status: int) -> None:
        self._http.labels(self.model_name, endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
