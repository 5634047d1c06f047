"""Which worker gets a request: plain values in, a decision out (no I/O, no clock, no globals).

Power of two choices on least load: sample two eligible workers at random and take the less loaded
one. It spreads load almost as well as scanning for the minimum, and unlike the minimum it does not
send a burst of simultaneous requests to the one worker whose last report happened to be lowest.

A worker is eligible when it serves the model, reports SERVING, its report is fresh (older load is not
trusted) and it has room: running + queued below `max_num_seqs + max_queue_per_worker`. When every
serving worker is full the answer is 429 with a Retry-After from the measured drain rate; when none
is serving, 503. Per-worker load carries the prefix-cache block hashes and the drain rates too, so a
cost that adds cached-prefix savings or a peer region's RTT slots into `_score` without new inputs.
"""

import math
import random
from collections import deque
from dataclasses import dataclass

STARTING, SERVING, DRAINING, DOWN = "starting", "serving", "draining", "down"

DEFAULT_RETRY_AFTER = 2  # seconds, when no drain rate has been measured yet
MAX_RETRY_AFTER = 60


@dataclass(frozen=True)
class RoutingPolicy:
    max_queue_per_worker: int = 128  # requests a worker may queue beyond those it runs at once
    stale_after: float = 5.0  # seconds: a worker whose latest report is older is skipped

    def __post_init__(self) -> None:
        if self.max_queue_per_worker < 0:
            raise ValueError("max_queue_per_worker must be >= 0")
        if self.stale_after <= 0:
            raise ValueError("stale_after must be positive")


@dataclass(frozen=True)
class WorkerLoad:
    """What the gateway knows of one worker: its latest load report plus its own bookkeeping."""

    address: str
    model: str = ""
    state: str = STARTING
    running: int = 0
    waiting: int = 0
    max_num_seqs: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    block_size: int = 0
    tokens_per_second: float = 0.0  # drain rate: generated tokens per second
    requests_per_second: float = 0.0  # drain rate: finished requests per second
    prefix_hashes: frozenset[int] = frozenset()
    in_flight: int = 0  # requests this gateway has sent there that have not ended
    reported_at: float = -math.inf  # monotonic seconds of the latest report

    @property
    def load(self) -> int:
        # The report lags by up to one interval; what this gateway itself sent since is exact.
        return max(self.running + self.waiting, self.in_flight)

    def capacity(self, policy: RoutingPolicy) -> int:
        return self.max_num_seqs + policy.max_queue_per_worker

    def fresh(self, now: float, policy: RoutingPolicy) -> bool:
        return now - self.reported_at <= policy.stale_after


@dataclass(frozen=True)
class RouteRequest:
    model: str  # "" = any model (only sensible when every worker serves the same one)
    exclude: frozenset[str] = frozenset()  # workers that already failed this request


@dataclass(frozen=True)
class Route:
    address: str


@dataclass(frozen=True)
class Reject:
    status: int  # HTTP status: 404 unknown model, 429 saturated, 503 nothing serving
    message: str
    retry_after: int | None = None  # seconds, with 429


def choose(
    request: RouteRequest,
    candidates: list[WorkerLoad],
    now: float,
    policy: RoutingPolicy,
    rng: random.Random,
) -> Route | Reject:
    models = {w.model for w in candidates if w.model and w.state != DOWN}
    if request.model and models and request.model not in models:
        return Reject(
            404, f"model {request.model!r} is not served here; try one of {sorted(models)}"
        )
    serving = [
        w
        for w in candidates
        if w.state == SERVING
        and w.fresh(now, policy)
        and (not request.model or w.model == request.model)
        and w.address not in request.exclude
    ]
    if not serving:
        what = f"model {request.model!r}" if request.model else "any model"
        return Reject(503, f"no healthy worker is serving {what}; try again shortly")
    open_ = [w for w in serving if w.load < w.capacity(policy)]
    if not open_:
        return Reject(
            429,
            "every worker is at capacity; retry after the time in the Retry-After header",
            retry_after(serving, policy),
        )
    pair = rng.sample(open_, 2) if len(open_) > 1 else open_
    return Route(min(pair, key=_score).address)


def _score(w: WorkerLoad) -> tuple[float, float]:
    """Lower is better: load relative to what the worker runs at once, then KV-cache use."""
    return (
        w.load / max(w.max_num_seqs, 1),
        w.kv_blocks_used / w.kv_blocks_total if w.kv_blocks_total else 0.0,
    )


def retry_after(saturated: list[WorkerLoad], policy: RoutingPolicy) -> int:
    """Seconds until the region has drained enough for one more request: the requests over
    capacity, plus this one, at the measured rate at which requests finish."""
    excess = sum(max(w.load - w.capacity(policy), 0) for w in saturated) + 1
    rate = sum(w.requests_per_second for w in saturated)
    if rate <= 0:
        return DEFAULT_RETRY_AFTER
    return min(max(math.ceil(excess / rate), 1), MAX_RETRY_AFTER)


class RetryBudget:
    """Retries may add at most `ratio` of recent first attempts (plus `floor` per second), so a
    failing fleet is not hit with a retry storm. Counts cover the last `window` seconds."""

    def __init__(self, ratio: float = 0.2, floor: float = 1.0, window: float = 10.0):
        self.ratio, self.floor, self.window = ratio, floor, window
        self._requests: deque[float] = deque()
        self._retries: deque[float] = deque()

    def record_request(self, now: float) -> None:
        self._requests.append(now)
        _expire(self._requests, now - self.window)

    def try_retry(self, now: float) -> bool:
        _expire(self._requests, now - self.window)
        _expire(self._retries, now - self.window)
        if len(self._retries) >= self.ratio * len(self._requests) + self.floor * self.window:
            return False
        self._retries.append(now)
        return True


def _expire(times: deque[float], cutoff: float) -> None:
    while times and times[0] <= cutoff:
        times.popleft()
