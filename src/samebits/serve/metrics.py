"""GET /metrics: the engine's state in Prometheus text, read at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class EngineCollector:
    """Requests running/waiting, KV blocks, tokens generated, preemptions, step time."""

    def __init__(self, llm, engine):
        self.llm = llm
        self.engine = engine

    def collect(self):
        sched, blocks, stats = self.llm.scheduler, self.llm.block_manager, self.llm.core.stats
        yield _gauge("samebits_num_requests_running", "sequences holding KV blocks", len(sched.running))
        yield _gauge("samebits_num_requests_waiting", "sequences queued or preempted", len(sched.waiting))
        streaming = self.engine.num_in_flight()
        yield _gauge("samebits_requests_in_flight", "requests with a client waiting", streaming)
        yield _gauge("samebits_kv_blocks_used", "KV blocks in use", blocks.num_blocks - blocks.num_free_blocks)
        yield _gauge("samebits_kv_blocks_total", "KV blocks in the cache", blocks.num_blocks)
        yield _counter("samebits_generation_tokens", "tokens sampled", stats.generated_tokens)
        yield _counter("samebits_aborted_requests", "requests aborted unfinished", stats.aborted_requests)
        yield _counter("samebits_num_preemptions", "sequences preempted", sched.num_preemptions)
        yield _counter("samebits_engine_steps", "engine steps", stats.steps)
        yield _counter("samebits_engine_step_seconds", "seconds spent in engine steps", stats.step_seconds)
        yield _gauge("samebits_last_step_seconds", "duration of the last engine step", stats.last_step_seconds)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def make_registry(llm, engine) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(llm, engine))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
