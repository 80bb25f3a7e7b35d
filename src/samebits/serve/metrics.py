"""GET /metrics: the engine's state in Prometheus text, read at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

GAUGES = {
    "num_requests_running": "sequences holding KV blocks",
    "num_requests_waiting": "sequences queued or preempted",
    "requests_in_flight": "requests with a client waiting",
    "kv_blocks_used": "KV blocks in use",
    "kv_blocks_total": "KV blocks in the cache",
    "last_step_seconds": "duration of the last engine step",
}
COUNTERS = {
    "generation_tokens": "tokens sampled",
    "aborted_requests": "requests aborted unfinished",
    "num_preemptions": "sequences preempted",
    "engine_steps": "engine steps",
    "engine_step_seconds": "seconds spent in engine steps",
    # vLLM's prefix_cache_queries / prefix_cache_hits, in tokens (engine/outputs.py EngineStats)
    "prefix_cache_queries": "prompt tokens looked up in the prefix cache at admission",
    "prefix_cache_hits": "of those, tokens whose K/V came from the cache (not computed)",
}


class EngineCollector:
    """Requests running/waiting, KV blocks, tokens generated, preemptions, step time, from
    `engine.metrics()` (an AsyncEngine's now, an EngineProcess's as of its last step)."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        values = self.engine.metrics()
        for name, doc in GAUGES.items():
            yield _gauge(f"samebits_{name}", doc, values[name])
        for name, doc in COUNTERS.items():
            yield _counter(f"samebits_{name}", doc, values[name])


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def make_registry(engine) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
