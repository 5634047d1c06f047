"""The worker's engine metrics: read from the engine's latest stats snapshot at scrape time, so the
engine thread never touches Prometheus objects."""

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from meridian.metrics import LABELS, REQUEST_BUCKETS
from meridian.worker.engine.llm_engine import EngineStats

COMPONENT = "worker"


class EngineCollector(Collector):
    def __init__(self, model: str, stats: Callable[[], EngineStats | None]):
        self.labels = [model, COMPONENT]
        self.stats = stats  # None while the model loads

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        if s is None:
            return
        for name, doc, value in (
            ("meridian_num_requests_running", "Requests in the engine's running batch.", s.running),
            ("meridian_num_requests_waiting", "Requests queued in the engine.", s.waiting),
            (
                "meridian_kv_cache_usage_perc",
                "Fraction of KV-cache blocks held by requests (0 to 1; cached free blocks excluded).",
                s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0,
            ),
            ("meridian_kv_cache_blocks", "KV-cache blocks in the pool.", s.kv_blocks_total),
        ):
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(self.labels, value)
            yield g
        for name, doc, value in (
            (
                "meridian_prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                s.prefix_cache_queries,
            ),
            (
                "meridian_prefix_cache_hits",
                "Prompt tokens found in the prefix cache (their prefill was skipped).",
                s.prefix_cache_hits,
            ),
            (
                "meridian_prompt_tokens_computed",
                "Prompt tokens prefilled (cache hits excluded, recomputation after preemption included).",
                s.prompt_tokens_computed,
            ),
            ("meridian_num_preemptions", "Requests preempted to free KV blocks.", s.preemptions),
            ("meridian_engine_steps", "Batched model steps run.", s.steps),
        ):
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(self.labels, value)
            yield c


def queue_time_histogram(registry: CollectorRegistry) -> Histogram:
    return Histogram(
        "meridian_request_queue_time_seconds",
        "Time from a request's arrival to the first engine step that ran it.",
        LABELS,
        buckets=REQUEST_BUCKETS,
        registry=registry,
    )
