"""Request metrics shared by the worker and the gateway (Prometheus, via prometheus-client).

Names follow vLLM's (`vllm:time_to_first_token_seconds` -> `meridian_time_to_first_token_seconds`),
so dashboards and alerts written for it carry over. Every series has the labels `model` (the served
model name) and `component` (`worker` or `gateway`): the same request is seen by both, and the
difference between them is the routing and network overhead. Each process has its own registry.

Label values are bounded: a model name that nothing serves (whatever a client typed) is counted as
`unknown`, so no client can add series.
"""

import asyncio
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)

LABELS = ("model", "component")

# Outcome of a request (`status` label of meridian_requests_total).
OK = "ok"
INVALID = "invalid"  # the request was wrong: 4xx / INVALID_ARGUMENT
NOT_FOUND = "not_found"  # unknown model
REJECTED = "rejected"  # every replica saturated: 429 / RESOURCE_EXHAUSTED
UNAVAILABLE = "unavailable"  # no replica could take it: 503 / UNAVAILABLE
CANCELLED = "cancelled"  # the client went away before the end
ERROR = "error"  # a failure of ours: 5xx / INTERNAL
UNKNOWN_MODEL = "unknown"  # the model label of requests for a model nothing serves

# seconds; TTFT spans a cached decode on a GPU (~10 ms) to a long prefill queued on a CPU (minutes).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160, 640)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5, 10, 20)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 3600)


def new_registry() -> CollectorRegistry:
    disable_created_metrics()  # the *_created series only double the scrape size
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)  # process_cpu_seconds_total, process_resident_memory_bytes
    return registry


class RequestMetrics:
    """The per-request series of one process. `known_models` gives the model names that may be
    label values (None: any, for a worker, which names only its own)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        component: str,
        known_models: Callable[[], Collection[str]] | None = None,
    ):
        self.component = component
        self.known_models = known_models
        self.ttft = Histogram(
            "meridian_time_to_first_token_seconds",
            "Time from request arrival to its first generated token.",
            LABELS,
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "meridian_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request.",
            LABELS,
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "meridian_e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            LABELS,
            buckets=REQUEST_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "meridian_prompt_tokens",
            "Prompt tokens of requests that started generating (cached ones included).",
            LABELS,
            registry=registry,
        )
        self.generation_tokens = Counter(
            "meridian_generation_tokens",
            "Tokens generated and sent back.",
            LABELS,
            registry=registry,
        )
        self.requests = Counter(
            "meridian_requests",
            "Finished requests by outcome (status) and finish reason (stop, length, abort, none).",
            (*LABELS, "status", "finished_reason"),
            registry=registry,
        )
        self.in_flight = Gauge(
            "meridian_requests_in_flight",
            "Requests this process has accepted and not yet answered in full.",
            LABELS,
            registry=registry,
        )

    def start(self, model: str) -> "RequestTimer":
        if self.known_models is not None and model not in self.known_models():
            model = UNKNOWN_MODEL
        return RequestTimer(self, model)


@dataclass
class RequestTimer:
    """One request's timings; observed into its process's metrics when it ends.

    Used as a context manager, it ends exactly once however the block is left: with the outcome
    set by `outcome()`, else the one its exception says (`metric_status` of the exception, or
    `cancelled` for a cancellation or a closed generator, else `error`), else `cancelled`."""

    metrics: RequestMetrics
    model: str
    arrival: float = field(default_factory=time.monotonic)
    last_token: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    status: str | None = None
    finished_reason: str | None = None
    done: bool = False

    def __post_init__(self) -> None:
        self.labels = (self.model, self.metrics.component)
        self.metrics.in_flight.labels(*self.labels).inc()

    def __enter__(self) -> "RequestTimer":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        status = self.status
        if status is None and error is not None:
            cancelled = isinstance(error, GeneratorExit | asyncio.CancelledError)
            status = CANCELLED if cancelled else getattr(error, "metric_status", ERROR)
        self.finish(status or CANCELLED, self.finished_reason)

    def outcome(self, status: str, finished_reason: str | None = None) -> None:
        """How the request ended, recorded for when the timer's block is left."""
        self.status, self.finished_reason = status, finished_reason

    def tokens(self, n: int, prompt_tokens: int) -> None:
        """n more tokens reached the client (n may be 0 for a final, token-less response)."""
        if n == 0:
            return
        now = time.monotonic()
        m, labels = self.metrics, self.labels
        if self.last_token is None:
            m.ttft.labels(*labels).observe(now - self.arrival)
            m.prompt_tokens.labels(*labels).inc(prompt_tokens)
            self.prompt_tokens = prompt_tokens
        else:
            # A response carrying several tokens spreads its gap over them, as they arrived together.
            gap = (now - self.last_token) / n
            for _ in range(n):
                m.itl.labels(*labels).observe(gap)
        m.generation_tokens.labels(*labels).inc(n)
        self.completion_tokens += n
        self.last_token = now

    def finish(self, status: str, finished_reason: str | None = None) -> None:
        if self.done:
            return
        self.done = True
        m, labels = self.metrics, self.labels
        m.in_flight.labels(*labels).dec()
        if status == OK:
            m.e2e.labels(*labels).observe(time.monotonic() - self.arrival)
        m.requests.labels(*labels, status, finished_reason or "none").inc()
