"""Send one Generate request to a worker: route, retry on another worker while nothing has reached
the client yet, then relay the worker's stream. Both front ends (HTTP and gRPC) go through here.

Errors are `GatewayError`s carrying both an HTTP status and a gRPC code, so each front end answers in
its own terms. Cancelling the task that reads a `WorkerStream` (the client went away) cancels the
worker call, and the worker aborts the request in its engine.
"""

import logging
import random
import time
from collections.abc import AsyncIterator

import grpc
from prometheus_client import CollectorRegistry, Counter

from meridian import metrics
from meridian.api.v1 import pb
from meridian.gateway.routing import Reject, RetryBudget, RouteRequest, RoutingPolicy, choose
from meridian.gateway.workers import WorkerPool
from meridian.metrics import LABELS

log = logging.getLogger(__name__)

FINISH_REASONS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}
# Worker answers that mean "not this worker, not now": another worker may well succeed. (A worker
# cancels calls only when it is stopped without a drain; our own cancellations never surface here.)
RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.CANCELLED,
}
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.CANCELLED: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
GRPC_CODE = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND}
GRPC_CODE |= {429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}
METRIC_STATUS = {400: metrics.INVALID, 404: metrics.NOT_FOUND, 429: metrics.REJECTED}
METRIC_STATUS |= {503: metrics.UNAVAILABLE}
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error"}
ERROR_TYPES |= {503: "service_unavailable_error"}


class GatewayError(Exception):
    def __init__(
        self,
        http_status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.http_status, self.code, self.param = http_status, code, param
        self.retry_after = retry_after

    @property
    def message(self) -> str:
        return str(self)

    @property
    def type(self) -> str:
        return ERROR_TYPES.get(self.http_status, "server_error")

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return GRPC_CODE.get(self.http_status, grpc.StatusCode.INTERNAL)

    @property
    def metric_status(self) -> str:
        return METRIC_STATUS.get(self.http_status, metrics.ERROR)

    def grpc_trailers(self) -> list[tuple[str, str]]:
        tags = [("meridian-error-code", self.code), ("meridian-error-param", self.param)]
        if self.retry_after is not None:
            tags.append(("retry-after", str(self.retry_after)))
        return [(k, v) for k, v in tags if v]

    @classmethod
    def from_reject(cls, reject: Reject) -> "GatewayError":
        code = {404: "model_not_found", 429: "overloaded", 503: "no_healthy_worker"}
        param = "model" if reject.status == 404 else None
        return cls(reject.status, reject.message, code[reject.status], param, reject.retry_after)

    @classmethod
    def from_rpc(cls, e: grpc.aio.AioRpcError) -> "GatewayError":
        trailers = dict(e.trailing_metadata() or ())
        retry_after = trailers.get("retry-after")
        return cls(
            HTTP_STATUS.get(e.code(), 502),
            e.details() or e.code().name,
            trailers.get("meridian-error-code"),
            trailers.get("meridian-error-param"),
            int(retry_after) if retry_after and retry_after.isdigit() else None,
        )


class Dispatcher:
    def __init__(
        self,
        pool: WorkerPool,
        policy: RoutingPolicy,
        registry: CollectorRegistry,
        max_attempts: int = 3,
        rng: random.Random | None = None,
    ):
        self.pool, self.policy, self.max_attempts = pool, policy, max_attempts
        self.rng = rng or random.Random()
        self.budget = RetryBudget()
        self.retries = Counter(
            "meridian_request_retries",
            "Requests sent to another worker after one failed before the first token.",
            LABELS,
            registry=registry,
        )

    async def open(self, request) -> "WorkerStream":
        """Start `request` (pb.GenerateRequest) on a worker and wait for its first response,
        trying other workers while none has come back. Raises GatewayError."""
        tried: set[str] = set()
        self.budget.record_request(time.monotonic())
        while True:
            choice = choose(
                RouteRequest(request.model, frozenset(tried)),
                self.pool.snapshot(),
                time.monotonic(),
                self.policy,
                self.rng,
            )
            if isinstance(choice, Reject):
                raise GatewayError.from_reject(choice)
            address = choice.address
            stream = WorkerStream(self.pool, address, request)
            try:
                await stream.start()
                return stream
            except grpc.aio.AioRpcError as e:
                if e.code() not in RETRYABLE:
                    raise GatewayError.from_rpc(e) from None
                self.pool.mark_unavailable(address)
                tried.add(address)
                log.info("worker %s refused a request (%s); retrying", address, e.code().name)
                if len(tried) >= self.max_attempts or not self.budget.try_retry(time.monotonic()):
                    raise GatewayError.from_rpc(e) from None
                self.retries.labels(request.model, "gateway").inc()


class WorkerStream:
    """One Generate call on one worker. Iterate it for the responses; it is counted against the
    worker until it ends, and cancelled if its reader goes away."""

    def __init__(self, pool: WorkerPool, address: str, request):
        self.pool, self.address = pool, address
        self._reservation = pool.reserve(address)
        self._call = pool.stub(address).Generate(request)
        self._first = None

    async def start(self) -> None:
        self._reservation.__enter__()
        try:
            self._first = await self._read()
        except BaseException:
            self.close()
            raise

    async def __aiter__(self) -> AsyncIterator:
        try:
            response = self._first
            while response is not None:
                yield response
                response = await self._read()
        except grpc.aio.AioRpcError as e:
            raise GatewayError.from_rpc(e) from None
        finally:
            self.close()

    async def _read(self):
        response = await self._call.read()
        return None if response is grpc.aio.EOF else response

    def close(self) -> None:
        """End the call (a no-op once it has finished) and release the worker's slot."""
        if self._reservation is not None:
            self._call.cancel()
            self._reservation.__exit__(None, None, None)
            self._reservation = None


async def collect(stream: WorkerStream) -> tuple[str, list, object, int]:
    """Read a stream to its end: (text, logprobs, final usage, finish reason)."""
    text, logprobs, usage, reason = [], [], pb.Usage(), pb.FINISH_REASON_UNSPECIFIED
    async for r in stream:
        text.append(r.text)
        logprobs.extend(r.logprobs)
        usage, reason = r.usage, r.finish_reason or reason
    return "".join(text), logprobs, usage, reason
