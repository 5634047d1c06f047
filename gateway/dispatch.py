"""Send one Generate request where it will be answered soonest: a cached result, a replica of this
region, or a peer region's gateway; retry elsewhere while nothing has reached the client yet, then
relay the stream. Both front ends (HTTP and gRPC) go through here.

Before routing: the client's API key is checked and charged (a caller without one gets priority
0), and `model: auto` is resolved. Errors are `GatewayError`s (errors.py); answers are streams
(streams.py). Cancelling the task that reads a stream (the client went away) cancels the upstream
call, and the worker aborts the request in its engine. Every call carries a deadline: the gateway's
`--request-timeout`, shortened by the client's own. An upstream that sends no first token within
`--first-token-timeout`, or goes down before it does, loses the request to another.
"""

import asyncio
import logging
import random
import time
from functools import partial

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge

from meridian.api.v1 import pb
from meridian.errors import UserError
from meridian.gateway.auto_model import AUTO, AutoModel, pick
from meridian.gateway.errors import EJECTING, GatewayError
from meridian.gateway.ratelimit import AuthError, RateLimiter
from meridian.gateway.result_cache import ResultCache, cache_key, cacheable
from meridian.gateway.routing import (
    CACHE,
    RETRY,
    SPILL,
    PrefillSpeed,
    Reject,
    RetryBudget,
    RouteRequest,
    RoutingPolicy,
    choose,
)
from meridian.gateway.streams import (
    CachedStream,
    Charge,
    Stream,
    UpstreamStream,
    Where,
    collect,
    key_id,
)
from meridian.gateway.workers import WorkerPool
from meridian.metrics import LABELS
from meridian.worker.tokenizer import PromptTooLong, prompt_token_ids

log = logging.getLogger(__name__)


class Dispatcher:
    def __init__(
        self,
        pool: WorkerPool,
        policy: RoutingPolicy,
        registry: CollectorRegistry,
        max_attempts: int = 3,
        request_timeout: float = 600.0,
        first_token_timeout: float = 60.0,
        cache: ResultCache | None = None,
        auto_model: AutoModel | None = None,
        limiter: RateLimiter | None = None,
        prefix_affinity: bool = True,
        rng: random.Random | None = None,
    ):
        self.pool, self.policy, self.max_attempts = pool, policy, max_attempts
        self.request_timeout, self.first_token_timeout = request_timeout, first_token_timeout
        self.cache, self.auto_model, self.limiter = cache, auto_model, limiter
        self.prefix_affinity = prefix_affinity  # off: P2C within the region, no prefill costs
        self.rng = rng or random.Random()
        self.budget = RetryBudget()
        self.spilling: dict[str, bool] = {}  # model -> its last routing decision was a spill
        self.prefill = PrefillSpeed()  # measured from local first tokens as they come
        self.retries = Counter(
            "meridian_request_retries",
            "Requests sent to another worker after one failed before the first token.",
            LABELS,
            registry=registry,
        )
        self.routed = Counter(
            "meridian_routed_requests",
            "Requests answered, by the region that served them and the route that took them "
            "there (local, spill, failover, retry, cache).",
            (*LABELS, "region", "route"),
            registry=registry,
        )
        self.cache_lookups = Counter(
            "meridian_result_cache_lookups",
            "Deterministic requests looked up in the result cache, by result (hit, miss).",
            ("component", "result"),
            registry=registry,
        )
        self.throttled = Counter(
            "meridian_throttled_requests",
            "Requests refused by authentication or a key's limits, by key (the first 8 hex digits "
            "of its SHA-256; empty when none was valid) and reason (unauthenticated, requests, "
            "tokens, too_large).",
            ("component", "key", "reason"),
            registry=registry,
        )
        self.cache_bytes = Gauge(
            "meridian_result_cache_bytes",
            "Bytes of results held by the result cache.",
            ("component",),
            registry=registry,
        )

    @property
    def region(self) -> str:
        return self.pool.region

    async def open(
        self, request, deadline: float | None = None, credentials: str | None = None
    ) -> "Stream":
        """Start `request` (pb.GenerateRequest) and wait for its first response, trying other
        upstreams while none has come back. `deadline` (monotonic seconds) shortens the gateway's
        own; `credentials` is the client's Authorization value, checked here when the gateway has
        API keys and passed on to a peer gateway. Raises GatewayError."""
        now = time.monotonic()
        deadline = min(deadline or now + self.request_timeout, now + self.request_timeout)
        api_key = self._authenticate(credentials)
        if api_key is None:
            request.priority = 0  # jumping the queue is for callers with a key
        prompt_ids = await self._prompt_ids(request)
        # Every gateway charges what it handles, forwarded requests too: `hops` is set by callers,
        # so trusting it would let any client skip its limits.
        charge = self._admit(api_key, request, prompt_ids)
        metadata = (("authorization", credentials),) if credentials else ()
        try:
            stream = await self._open(request, prompt_ids, deadline, metadata)
        except GatewayError as e:
            if charge is not None:
                charge.settle(None)
                e.headers.update(charge.headers)
            raise
        stream.charge = charge
        return stream

    async def _open(self, request, prompt_ids, deadline, metadata) -> "Stream":
        key = cache_key(request) if self.cache is not None and request.hops == 0 else None
        if key is not None:
            cached = self.cache.get(key, time.monotonic())
            self.cache_lookups.labels("gateway", "hit" if cached else "miss").inc()
            if cached:
                self.routed.labels(request.model, "gateway", self.region, CACHE).inc()
                where = Where(self.region, "result-cache", CACHE)
                return CachedStream(cached, where, request.request_id)
        stream = await self._route(request, prompt_ids, deadline, metadata)
        stream.cache_key = key
        return stream

    def _authenticate(self, credentials: str | None) -> str | None:
        if self.limiter is None or not self.limiter.enabled:
            return None
        try:
            return self.limiter.authenticate(credentials)
        except AuthError as e:
            self.throttled.labels("gateway", "", "unauthenticated").inc()
            raise GatewayError(401, str(e), "invalid_api_key") from None

    def _admit(self, api_key: str | None, request, prompt_ids: list[int]) -> "Charge | None":
        """Charge the key for the request's most tokens (prompt + max_tokens, or what the
        context window leaves), or refuse it; the charge is settled when the answer ends."""
        if api_key is None:
            return None
        prompt_tokens = len(prompt_ids) or request.ByteSize() // 4
        if request.sampling.HasField("max_tokens"):
            estimate = prompt_tokens + request.sampling.max_tokens
        else:
            windows = [m.max_model_len for m in self.pool.models() if m.id == request.model]
            estimate = max(windows or [prompt_tokens])
        admission = self.limiter.admit(api_key, estimate, time.monotonic())
        if not admission.allowed:
            reason = "too_large" if admission.never else admission.limit
            self.throttled.labels("gateway", key_id(api_key), reason).inc()
            if admission.never:
                raise GatewayError(400, admission.message, "rate_limit_exceeded", "max_tokens")
            raise GatewayError(
                429,
                admission.message,
                "rate_limit_exceeded",
                retry_after=admission.retry_after,
                headers=admission.headers,
            )
        return Charge(self.limiter, api_key, estimate, admission.headers)

    async def complete(
        self, stream: Stream, observe=None
    ) -> tuple[Stream, tuple[str, list, object, int]]:
        """Read a whole answer that is sent as one (not streamed): nothing reaches the client
        before its end, so when the upstream fails or goes down midway (see
        WorkerPool.watch_down) the request starts again elsewhere. Returns the stream that
        answered and what `collect` makes of it."""
        tried: set[str] = set()
        while True:
            try:
                if not isinstance(stream, UpstreamStream):
                    return stream, await collect(stream, observe)
                with self.pool.watch_down(stream.address, partial(stream.lose, "went down")):
                    return stream, await collect(stream, observe)
            except GatewayError as e:
                if not e.retryable or not isinstance(stream, UpstreamStream):
                    raise
                request, prompt_ids, deadline, metadata = stream.origin
                log.info("%s failed mid-answer (%s)", stream.address, e.message)
                if not self._may_retry(tried, stream.address, request.model):
                    raise
                cache_key = stream.cache_key
                stream = await self._route(request, prompt_ids, deadline, metadata, tried)
                stream.cache_key = cache_key

    async def _route(
        self, request, prompt_ids, deadline, metadata, tried: set[str] | None = None
    ) -> UpstreamStream:
        tried = set(tried or ())
        if not tried:
            self.budget.record_request(time.monotonic())
        while True:
            now = time.monotonic()
            route_request = RouteRequest(
                request.model,
                frozenset(tried),
                tuple(prompt_ids) if self.prefix_affinity else (),
                request.hops,
                self.spilling.get(request.model, False),
            )
            choice = choose(
                route_request,
                self.pool.snapshot(),
                now,
                self.policy,
                self.rng,
                self.prefill.seconds_per_token,
            )
            if isinstance(choice, Reject):
                raise GatewayError.from_reject(choice)
            if deadline <= now:
                raise GatewayError(504, "the request's deadline passed before it could start")
            peer = self.pool.is_peer(choice.address)
            if not tried and not choice.probe:
                self.spilling[request.model] = choice.route == SPILL
            upstream_request = request
            if peer:
                upstream_request = pb.GenerateRequest()
                upstream_request.CopyFrom(request)
                upstream_request.hops += 1
            stream = UpstreamStream(self, choice.address, upstream_request, deadline, metadata)
            stream.origin = (request, prompt_ids, deadline, metadata)
            route = RETRY if tried else choice.route
            learn_prefill = not peer and choice.queue_wait == 0.0
            try:
                await stream.start(route, learn_prefill, self.first_token_timeout)
            except grpc.aio.AioRpcError as e:
                error = GatewayError.from_rpc(e, choice.address)
                if not error.retryable:
                    raise error from None
                if e.code() in EJECTING:
                    self.pool.failed(choice.address)
                log.info("%s refused a request (%s)", choice.address, e.code().name)
                if not self._may_retry(tried, choice.address, request.model):
                    raise error from None
                continue
            except GatewayError as e:  # we gave up on it (see UpstreamStream.lose)
                log.info("%s: %s", choice.address, e.message)
                if not self._may_retry(tried, choice.address, request.model):
                    raise
                continue
            self.pool.succeeded(choice.address)
            self.routed.labels(request.model, "gateway", stream.where.region, route).inc()
            return stream

    def _may_retry(self, tried: set[str], failed: str, model: str) -> bool:
        """Note that `failed` failed this request; may it go on elsewhere (attempts left and
        within the retry budget)?"""
        tried.add(failed)
        if len(tried) >= self.max_attempts or not self.budget.try_retry(time.monotonic()):
            return False
        self.retries.labels(model, "gateway").inc()
        log.info("retrying elsewhere (attempt %d)", len(tried) + 1)
        return True

    async def _prompt_ids(self, request) -> list[int]:
        """The prompt's token ids when a tokenizer for the model is known (for prefix affinity
        and the auto model), resolving `model: auto` on the way; else []."""
        model = request.model
        if model == AUTO and self.auto_model is not None:
            model = self.auto_model.small
        # With one upstream and no key limits or auto model, the ids would change nothing.
        needed = len(self.pool.upstreams) > 1 or self.auto_model or self.limiter
        ids = await self._tokenize(model, request) if needed else []
        if request.model == AUTO and self.auto_model is not None:
            prompt_tokens = len(ids) or request.ByteSize() // 4  # about 4 bytes per token
            max_tokens = request.sampling.max_tokens
            has_max = request.sampling.HasField("max_tokens")
            request.model = pick(self.auto_model, prompt_tokens, max_tokens if has_max else None)
            if request.model != self.auto_model.small:
                ids = await self._tokenize(request.model, request)
        return ids

    async def _tokenize(self, model: str, request) -> list[int]:
        """The prompt's ids with `model`'s tokenizer; [] while it is unknown or when the prompt
        is one the worker will refuse (it answers with the reason). A prompt longer than any
        context window of the model, as told from its byte length, is refused here."""
        tokenizer = self.pool.tokenizer(model)
        if tokenizer is None:
            return []
        window = max((m.max_model_len for m in self.pool.models() if m.id == model), default=0)
        limit = window - 1 if window else None  # room for at least one generated token
        try:
            if request.ByteSize() < 16_384:
                return prompt_token_ids(tokenizer, request, limit)
            # Long prompts: off the event loop (the tokenizer releases the GIL).
            return await asyncio.to_thread(prompt_token_ids, tokenizer, request, limit)
        except PromptTooLong as e:
            message = f"{e}; the context window of {model!r} holds {window} tokens: shorten it"
            raise GatewayError(400, message, "context_length_exceeded", "prompt") from None
        except UserError:
            return []

    def learn_prefill(self, seconds: float, usage) -> None:
        """A local request that did not queue reached its first token in `seconds`."""
        self.prefill.add(usage.prompt_tokens - usage.cached_tokens, seconds)

    def store(self, key: bytes, responses: list) -> None:
        if self.cache is not None and cacheable(responses):
            self.cache.put(key, responses, time.monotonic())
            self.cache_bytes.labels("gateway").set(self.cache.bytes)
