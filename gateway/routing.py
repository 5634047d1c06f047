"""Where a request goes: plain values in, a decision out (no I/O, no clock, no globals).

Candidates are this region's replicas (workers) and peer regions' gateways; a peer is a candidate
like a replica, with its region's summed load report as its load. For each the cost is the predicted
time to first token:

    network RTT (EWMA of probes; ~0 locally) + queue wait (requests ahead / measured drain rate)
    + prefill of the prompt tokens not already in that candidate's prefix cache

- Within the region: among replicas that are not hot spots (load within `balance_rel` x the least
  loaded plus `balance_abs`), the longest cached prefix wins; without one, power of two choices on
  load (it spreads load almost as well as the minimum, and a burst does not all land on the one
  replica whose last report happened to be lowest).
- Across regions: local first. A request spills to the cheapest peer only when that peer's cost
  beats the local one by `spill_margin` seconds; once spilling, it goes on while the peer wins by
  `spill_exit_margin` (hysteresis, so traffic does not flap). With no local replica open, the
  request spills (all full) or fails over (none serving) to the cheapest peer. A `probe_share` of
  requests goes to a random peer so its figures stay measured.
- A request that already passed a gateway (`hops` > 0) is served locally or refused: never
  forwarded twice. Figures older than `stale_after` are not trusted. Ejected candidates are skipped
  unless every candidate of their kind is ejected (never eject everything).
- Every open candidate full: 429 with Retry-After from the measured drain rate; none serving: 503.
"""

import math
import random
from collections import deque
from dataclasses import dataclass

from meridian.worker.engine.block_manager import prefix_block_hashes

STARTING, SERVING, DRAINING, DOWN = "starting", "serving", "draining", "down"
# x-meridian-route values
LOCAL, SPILL, FAILOVER, RETRY, CACHE = "local", "spill", "failover", "retry", "cache"

DEFAULT_RETRY_AFTER = 2  # seconds, when no drain rate has been measured yet
MAX_RETRY_AFTER = 60


@dataclass(frozen=True)
class RoutingPolicy:
    max_queue_per_worker: int = 128  # requests a worker may queue beyond those it runs at once
    stale_after: float = 5.0  # seconds: a candidate whose latest report is older is skipped
    spill_margin: float = 0.25  # seconds a peer must beat the local cost by to take a request
    spill_exit_margin: float = 0.05  # ... and to keep taking them once spilling (hysteresis)
    probe_share: float = 0.01  # of requests sent to a random peer to keep its figures fresh
    balance_abs: int = 4  # hot-spot guard for prefix affinity: a replica whose load exceeds
    balance_rel: float = 1.5  # balance_rel x the least loaded's + balance_abs is skipped for it
    # Until a replica reports a drain rate: seconds one running request takes, so that queue wait
    # is (requests ahead) x this / max_num_seqs.
    default_request_seconds: float = 5.0

    def __post_init__(self) -> None:
        if self.max_queue_per_worker < 0:
            raise ValueError("max_queue_per_worker must be >= 0")
        if self.stale_after <= 0:
            raise ValueError("stale_after must be positive")
        if not 0 <= self.spill_exit_margin <= self.spill_margin:
            raise ValueError("spill_exit_margin must be between 0 and spill_margin")
        if not 0 <= self.probe_share < 1:
            raise ValueError("probe_share must be in [0, 1)")
        if self.balance_abs < 0 or self.balance_rel < 1 or self.default_request_seconds <= 0:
            raise ValueError("balance_abs >= 0, balance_rel >= 1, default_request_seconds > 0")


@dataclass(frozen=True)
class WorkerLoad:
    """What the gateway knows of one candidate: a local replica, or a peer region's gateway (then
    the load is the sum over that region's replicas)."""

    address: str
    model: str = ""  # a replica's served model
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
    peer: bool = False
    region: str = ""  # a peer's region ("" for local replicas)
    models: frozenset[str] = frozenset()  # what a peer region serves
    serving_replicas: int = 1
    rtt: float = 0.0  # seconds, EWMA of probes
    ejected_until: float = -math.inf  # monotonic seconds

    @property
    def load(self) -> int:
        # The report lags by up to one interval; what this gateway itself sent since is exact.
        return max(self.running + self.waiting, self.in_flight)

    def capacity(self, policy: RoutingPolicy) -> int:
        return self.max_num_seqs + policy.max_queue_per_worker * max(self.serving_replicas, 1)

    def fresh(self, now: float, policy: RoutingPolicy) -> bool:
        return now - self.reported_at <= policy.stale_after

    def serves(self, model: str) -> bool:
        return not model or model == self.model or model in self.models


@dataclass(frozen=True)
class RouteRequest:
    model: str  # "" = any model (only sensible when every worker serves the same one)
    exclude: frozenset[str] = frozenset()  # candidates that already failed this request
    prompt_ids: tuple[int, ...] = ()  # when the gateway could tokenize the prompt
    hops: int = 0  # gateways passed already: > 0 means local replicas only
    spilling: bool = False  # the previous decision for this model went to a peer


@dataclass(frozen=True)
class Route:
    address: str
    route: str = LOCAL
    cost: float = 0.0  # predicted seconds to first token
    queue_wait: float = 0.0  # of which waiting for a place in the batch
    probe: bool = False  # sent to a peer to measure it, not because it was predicted faster


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
    prefill_seconds_per_token: float = 0.0,
) -> Route | Reject:
    live = [c for c in candidates if c.state != DOWN]
    models = {c.model for c in live if c.model} | {m for c in live for m in c.models}
    if request.model and models and request.model not in models:
        return Reject(
            404, f"model {request.model!r} is not served here; try one of {sorted(models)}"
        )
    cost = Cost(request, policy, prefill_seconds_per_token)
    eligible = [c for c in candidates if _eligible(c, request, now, policy)]
    local = _not_ejected([c for c in eligible if not c.peer], now)
    peers = [] if request.hops else _not_ejected([c for c in eligible if c.peer], now)
    local_open = [c for c in local if c.load < c.capacity(policy)]
    peers_open = [c for c in peers if c.load < c.capacity(policy)]
    if not local_open:
        if peers_open:
            best = min(peers_open, key=cost)
            return Route(best.address, SPILL if local else FAILOVER, cost(best))
        if not local and not peers:
            what = f"model {request.model!r}" if request.model else "any model"
            return Reject(503, f"no healthy worker is serving {what}; try again shortly")
        return Reject(
            429,
            "every worker is at capacity; retry after the time in the Retry-After header",
            retry_after(local + peers, policy),
        )
    replica = _pick_replica(local_open, cost, policy, rng)
    if peers_open and rng.random() < policy.probe_share:
        probe = rng.choice(peers_open)
        return Route(probe.address, SPILL, cost(probe), probe=True)
    if peers_open:
        best = min(peers_open, key=cost)
        margin = policy.spill_exit_margin if request.spilling else policy.spill_margin
        if cost(best) + margin < cost(replica):
            return Route(best.address, SPILL, cost(best))
    return Route(replica.address, LOCAL, cost(replica), cost.queue_wait(replica))


def _eligible(c: WorkerLoad, request: RouteRequest, now: float, policy: RoutingPolicy) -> bool:
    return (
        c.state == SERVING
        and c.fresh(now, policy)
        and c.serves(request.model)
        and c.address not in request.exclude
        and (not c.peer or c.serving_replicas > 0)
    )


def _not_ejected(candidates: list[WorkerLoad], now: float) -> list[WorkerLoad]:
    """Ejected candidates are skipped, unless that would leave none (never eject everything)."""
    healthy = [c for c in candidates if c.ejected_until <= now]
    return healthy or candidates


def _pick_replica(
    replicas: list[WorkerLoad], cost: "Cost", policy: RoutingPolicy, rng: random.Random
) -> WorkerLoad:
    least = min(c.load for c in replicas)
    cool = [c for c in replicas if c.load <= least * policy.balance_rel + policy.balance_abs]
    best_cached = max(cost.cached_tokens(c) for c in cool)
    if best_cached > 0:
        return min((c for c in cool if cost.cached_tokens(c) == best_cached), key=_score)
    pair = rng.sample(replicas, 2) if len(replicas) > 1 else replicas
    return min(pair, key=_score)


def _score(w: WorkerLoad) -> tuple[float, float]:
    """Lower is better: load relative to what the worker runs at once, then KV-cache use."""
    return (
        w.load / max(w.max_num_seqs, 1),
        w.kv_blocks_used / w.kv_blocks_total if w.kv_blocks_total else 0.0,
    )


class Cost:
    """Predicted seconds to first token of one request on each candidate."""

    def __init__(self, request: RouteRequest, policy: RoutingPolicy, prefill_per_token: float):
        self.request, self.policy, self.prefill_per_token = request, policy, prefill_per_token
        self._hashes: dict[int, list[int]] = {}  # block size -> the prompt's block hashes

    def __call__(self, c: WorkerLoad) -> float:
        return c.rtt + self.queue_wait(c) + self.prefill(c)

    def queue_wait(self, c: WorkerLoad) -> float:
        ahead = c.load + 1 - c.max_num_seqs  # requests that must finish before this one starts
        if ahead <= 0:
            return 0.0
        rate = c.requests_per_second or max(c.max_num_seqs, 1) / self.policy.default_request_seconds
        return ahead / rate

    def prefill(self, c: WorkerLoad) -> float:
        uncached = len(self.request.prompt_ids) - self.cached_tokens(c)
        return uncached * self.prefill_per_token

    def cached_tokens(self, c: WorkerLoad) -> int:
        """Prompt tokens in the leading blocks that `c` reports holding."""
        if not c.block_size or not c.prefix_hashes or not self.request.prompt_ids:
            return 0
        if c.block_size not in self._hashes:
            self._hashes[c.block_size] = prefix_block_hashes(
                list(self.request.prompt_ids), c.block_size
            )
        held = 0
        for h in self._hashes[c.block_size]:
            if h not in c.prefix_hashes:
                break
            held += 1
        return held * c.block_size


class PrefillSpeed:
    """Marginal seconds per prefilled prompt token, learned from (uncached tokens, seconds to first
    token) of requests that did not queue: the slope of an exponentially weighted least-squares
    line, so the fixed cost of a model step, the same for 1 token or 1,000, is not charged per
    token (on a CPU it dwarfs the per-token cost of short prompts). Until the samples spread over
    enough prompt lengths, `initial`."""

    def __init__(self, weight: float = 0.05, initial: float = 0.0005, min_samples: int = 8):
        self.weight, self.initial, self.min_samples = weight, initial, min_samples
        self.samples = 0
        self.mean_tokens = self.mean_seconds = self.var = self.cov = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.samples += 1
        w = max(self.weight, 1 / self.samples)  # the first samples count in full
        dx, dy = tokens - self.mean_tokens, seconds - self.mean_seconds
        self.mean_tokens += w * dx
        self.mean_seconds += w * dy
        self.var = (1 - w) * (self.var + w * dx * dx)
        self.cov = (1 - w) * (self.cov + w * dx * dy)

    @property
    def seconds_per_token(self) -> float:
        if self.samples < self.min_samples or self.var < 16.0:  # prompt lengths spread < 4 tokens
            return self.initial
        return max(self.cov / self.var, 0.0)


def retry_after(saturated: list[WorkerLoad], policy: RoutingPolicy) -> int:
    """Seconds until there is room for one more request: the requests over capacity, plus this
    one, at the measured rate at which requests finish."""
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
