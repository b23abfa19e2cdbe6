"""Prometheus metrics of the server (``GET /metrics``), vLLM-style names under ``syncless:``,
and the server's log of them (``StatsLogger``: periodic engine statistics; one line per
finished request).

Gauges are read from the engine thread's latest snapshot at scrape time;
latency histograms are fed by the asyncio side as deltas arrive.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
logger = logging.getLogger("cluster.stats")

_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
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
    def __init__(self, metrics: ServerMetrics):
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
        yield gauge(
            "syncless:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", snap.get("kv_usage", 0.0)
        )
        yield gauge("syncless:kv_cache_blocks_free", "Free KV-cache blocks.", snap.get("num_free_blocks", 0))
        yield gauge("syncless:kv_cache_blocks_total", "KV-cache blocks.", snap.get("num_blocks", 0))
        yield gauge("syncless:num_requests_in_flight", "Requests the server is streaming.", self.m.in_flight())
        yield gauge("syncless:engine_healthy", "1 while the engine accepts requests.", self.m.healthy())
        p_rate, g_rate = self.m.throughput.rates(time.monotonic())
        yield gauge("syncless:prompt_tokens_per_second", "Prompt tokens admitted per second (10 s window).", p_rate)
        yield gauge("syncless:generation_tokens_per_second", "Tokens generated per second (10 s window).", g_rate)
        yield counter("syncless:prompt_tokens", "Prompt tokens admitted.", snap.get("prompt_tokens", 0))
        yield counter("syncless:generation_tokens", "Tokens generated.", snap.get("generation_tokens", 0))
        yield counter("syncless:num_preemptions", "Preemptions (by recompute).", snap.get("num_preemptions", 0))
        yield counter("syncless:engine_steps", "Engine steps submitted.", snap.get("steps", 0))
        pc = snap.get("prefix_cache") or {}  # Scheduler.prefix_cache_stats(), in tokens
        yield counter(
            "syncless:prefix_cache_queries",
            "Prefix cache queries: tokens of placed requests looked up.",
            pc.get("queries", 0),
        )
        yield counter(
            "syncless:prefix_cache_hits", "Prefix cache hits: looked-up tokens found cached.", pc.get("hits", 0)
        )
        yield gauge(
            "syncless:prefix_cache_hit_rate",
            "Prefix cache hits / queries since the engine started.",
            pc.get("hit_rate", 0.0),
        )
        yield gauge(
            "syncless:prefix_cache_blocks", "KV blocks holding cached prefix content.", pc.get("num_cached_blocks", 0)
        )
        yield counter(
            "syncless:prefix_cache_evictions", "Cached KV blocks evicted for new allocations.", pc.get("evictions", 0)
        )
        replicas = self.m.replicas()
        if replicas:  # data parallelism: the same numbers per replica (cluster.dp_engine)
            yield from replica_families(self.m.model_name, replicas)


def replica_families(model_name: str, replicas: list[dict[str, Any]]):
    """Per-replica families with a ``replica`` label; ``syncless:replica_up`` says which serve
    (``DataParallelEngine.replica_states()``)."""
    labels = ["model_name", "replica"]
    specs = [  # (metric, doc, kind, value of one replica's state)
        (
            "syncless:replica_up",
            "1 while the replica serves, 0 while it is down or restarting.",
            "g",
            lambda r: 1 if r["up"] else 0,
        ),
        (
            "syncless:replica_restarts",
            "Restarts of the replica (its actor or its workers).",
            "c",
            lambda r: r["actor_restarts"] + r["worker_restarts"],
        ),
        (
            "syncless:replica_num_requests_in_flight",
            "Requests the front end is streaming from the replica.",
            "g",
            lambda r: r["in_flight"],
        ),
        (
            "syncless:replica_num_requests_running",
            "Sequences running on the replica.",
            "g",
            lambda r: r["load"]["running"],
        ),
        (
            "syncless:replica_num_requests_waiting",
            "Sequences waiting on the replica.",
            "g",
            lambda r: r["load"]["waiting"],
        ),
        (
            "syncless:replica_kv_cache_usage_perc",
            "Fraction of the replica's KV-cache blocks in use.",
            "g",
            lambda r: r["load"]["kv_usage"],
        ),
        (
            "syncless:replica_generation_tokens",
            "Tokens the replica generated (since its last restart).",
            "c",
            lambda r: r["load"]["generation_tokens"],
        ),
        (
            "syncless:replica_prompt_tokens",
            "Prompt tokens the replica admitted (since its last restart).",
            "c",
            lambda r: r["load"]["prompt_tokens"],
        ),
        (
            "syncless:replica_prefix_cache_hits",
            "Prompt tokens found in the replica's prefix cache.",
            "c",
            lambda r: (r["load"].get("prefix_cache") or {}).get("hits", 0),
        ),
    ]
    for metric, doc, kind, value in specs:
        fam = (GaugeMetricFamily if kind == "g" else CounterMetricFamily)(metric, doc, labels=labels)
        for r in replicas:
            fam.add_metric([model_name, str(r["replica"])], float(value(r)))
        yield fam


class ServerMetrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.snapshot: dict[str, Any] = {}
        self.in_flight = lambda: 0
        self.healthy = lambda: 1
        self.replicas = list  # per-replica states under data parallelism
        self.throughput = _Throughput()
        self.log_requests = False  # one log line per finished request
        self.registry = CollectorRegistry(auto_describe=True)
        lab = ["model_name"]
        self.ttft = Histogram(
            "syncless:time_to_first_token_seconds",
            "Time to first token.",
            lab,
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.itl = Histogram(
            "syncless:inter_token_latency_seconds",
            "Time between consecutive tokens.",
            lab,
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.e2e = Histogram(
            "syncless:e2e_request_latency_seconds",
            "Request latency, arrival to finish.",
            lab,
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self._finished = Counter(
            "syncless:request_success",
            "Finished requests by finish reason.",
            lab + ["finished_reason"],
            registry=self.registry,
        )
        self._http = Counter(
            "syncless:api_requests",
            "API requests by endpoint and status code.",
            lab + ["endpoint", "status"],
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(self))

    def bind(self, engine) -> None:
        self.in_flight = lambda: engine.num_in_flight
        self.healthy = lambda: 1 if engine.healthy else 0
        self.replicas = getattr(engine, "replica_states", self.replicas)

    # fed by the AsyncEngine (event-loop thread)
    def observe_ttft(self, s: float) -> None:
        self.ttft.observe(s)

    def observe_itl(self, s: float) -> None:
        self.itl.observe(s)

    def observe_finished(self, out, latency_s: float) -> None:
        self.e2e.observe(latency_s)
        for o in out.outputs:
            self._finished.labels(self.model_name, o.finish_reason or "unknown").inc()
        if self.log_requests:
            n_out = sum(len(o.token_ids) for o in out.outputs)
            reasons = ",".join(sorted({o.finish_reason or "unknown" for o in out.outputs}))
            logger.info(
                "finished request %s: %d prompt tokens, %d output tokens, finish %s, %.3f s",
                out.request_id,
                len(out.prompt_token_ids or ()),
                n_out,
                reasons,
                latency_s,
            )

    def update_engine(self, snap: dict[str, Any]) -> None:
        self.snapshot = snap
        self.throughput.add(
            snap.get("time", time.monotonic()), snap.get("prompt_tokens", 0), snap.get("generation_tokens", 0)
        )

    def count_request(self, endpoint: str, status: int) -> None:
        self._http.labels(self.model_name, endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StatsLogger:
    """Logs the engine's statistics every ``interval`` seconds while it has work (as vLLM does):
    prompt and generation throughput, running and waiting sequences, KV-cache usage, prefix-cache
    hit rate, and the health of the engine."""

    def __init__(self, metrics: ServerMetrics, engine):
        self.m = metrics
        self.engine = engine
        self._last: tuple[float, int, int] | None = None
        self._idle_logged = False

    def line(self) -> str | None:
        """The next line (None: nothing happened since the last one)."""
        snap = self.m.snapshot
        now = time.monotonic()
        p, g = snap.get("prompt_tokens", 0), snap.get("generation_tokens", 0)
        last = self._last or (now, p, g)
        self._last = (now, p, g)
        span = max(now - last[0], 1e-6)
        running, waiting = snap.get("running", 0), snap.get("waiting", 0)
        active = running or waiting or p != last[1] or g != last[2]
        if not active:
            if self._idle_logged:
                return None
            self._idle_logged = True
        else:
            self._idle_logged = False
        pc = snap.get("prefix_cache") or {}
        return (
            f"Avg prompt throughput: {(p - last[1]) / span:.1f} tokens/s, Avg generation throughput: "
            f"{(g - last[2]) / span:.1f} tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, "
            f"KV cache usage: {100 * snap.get('kv_usage', 0.0):.1f}%, Prefix cache hit rate: "
            f"{100 * pc.get('hit_rate', 0.0):.1f}%, In flight: {self.m.in_flight()}, "
            f"Engine: {'healthy' if self.m.healthy() else 'unavailable'}"
        )

    async def run(self, interval: float) -> None:
        self.line()  # the baseline
        while True:
            await asyncio.sleep(interval)
            try:
                text = self.line()
            except Exception:
                logger.exception("engine statistics failed")
                continue
            if text:
                logger.info(text)
