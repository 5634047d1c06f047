"""A started answer, as the front ends read it: a live Generate call on a replica or a peer gateway,
or a result replayed from the cache. Each knows where it came from (the x-meridian-* headers), and
settles its key's rate-limit charge when it ends."""

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from meridian.api.v1 import pb
from meridian.gateway.errors import EJECTING, GatewayError
from meridian.gateway.ratelimit import RateLimiter
from meridian.gateway.routing import LOCAL

if TYPE_CHECKING:  # the dispatcher makes the streams; a type only
    from meridian.gateway.dispatch import Dispatcher

FINISH_REASONS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}


@dataclass(frozen=True)
class Where:
    """Where an answer came from: the x-meridian-* headers and trailers."""

    region: str
    replica: str
    route: str

    def headers(self) -> dict[str, str]:
        return {
            "x-meridian-region": self.region,
            "x-meridian-replica": self.replica,
            "x-meridian-route": self.route,
        }


@dataclass
class Charge:
    """What a key was charged for one request, settled against its usage when it ends."""

    limiter: RateLimiter
    key: str
    estimate: int
    headers: dict[str, str]

    def settle(self, usage) -> None:
        used = usage.prompt_tokens + usage.completion_tokens if usage is not None else 0
        self.limiter.settle(self.key, self.estimate, used, time.monotonic())


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:8]


class UpstreamStream:
    """One Generate call on one replica or peer gateway. Iterate it for the responses; it is
    counted against the upstream until it ends, and cancelled if its reader goes away."""

    def __init__(self, dispatcher: "Dispatcher", address: str, request, deadline: float, metadata):
        self.dispatcher, self.address = dispatcher, address
        self.pool = dispatcher.pool
        self.cache_key: bytes | None = None
        self.charge: Charge | None = None
        self.origin: tuple = ()  # (request, prompt ids, deadline, metadata): to start it again
        self.usage = None  # the latest response's
        self.where = Where(self.pool.region, address, LOCAL)
        self._reservation = self.pool.reserve(address)
        timeout = max(deadline - time.monotonic(), 0.001)
        self._peer = self.pool.is_peer(address)
        self._sent = time.monotonic()
        # The whole call as the gateway saw it, once it has ended: what the gateway's own cost is
        # measured against (x-meridian-upstream-ms, like Envoy's x-envoy-upstream-service-time).
        self.upstream_seconds: float | None = None
        self._call = self.pool.stub(address).Generate(
            request, timeout=timeout, metadata=tuple(metadata) if self._peer else None
        )
        self._first = None
        self.lost: str | None = None  # why the gateway gave up on the call, if it did

    async def start(self, route: str, learn_prefill: bool, first_token_timeout: float) -> None:
        """Wait for the first response. Raises a retryable GatewayError if the upstream goes down
        or sends nothing for `first_token_timeout` seconds first: the request can go elsewhere."""
        self._reservation.__enter__()
        timer = asyncio.get_running_loop().call_later(
            first_token_timeout, self.lose, f"sent no first token in {first_token_timeout:g} s"
        )
        try:
            with self.pool.watch_down(self.address, lambda: self.lose("went down")):
                self._first = await self._read()
            region, replica = self.pool.region, self.address
            if self._peer:  # the peer gateway says where it went, before its first response
                sent = dict(await self._call.initial_metadata() or ())
                known = self.pool.upstreams[self.address].load.region
                region = sent.get("x-meridian-region", known)
                replica = sent.get("x-meridian-replica", self.address)
            self.where = Where(region, replica, route)
        except BaseException:
            self.close()
            raise
        finally:
            timer.cancel()
        if learn_prefill and self._first is not None:
            self.dispatcher.learn_prefill(time.monotonic() - self._sent, self._first.usage)

    @property
    def model(self) -> str:
        return self._first.model if self._first is not None else ""

    async def __aiter__(self) -> AsyncIterator:
        responses = []
        try:
            response = self._first
            while response is not None:
                responses.append(response)
                self.usage = response.usage
                yield response
                response = await self._read()
        except grpc.aio.AioRpcError as e:
            if e.code() in EJECTING:
                self.pool.failed(self.address)
            raise GatewayError.from_rpc(e, self.address) from None
        finally:
            self.close()
        if self.cache_key is not None:
            self.dispatcher.store(self.cache_key, responses)

    def lose(self, why: str) -> None:
        """Give up on the call: its reader gets a retryable error instead of waiting on."""
        if self.lost is None and self._reservation is not None:
            self.lost = why
            self._call.cancel()

    async def _read(self):
        try:
            response = await self._call.read()
        except asyncio.CancelledError:
            if self.lost is None or asyncio.current_task().cancelling():
                raise  # our own reader was cancelled (the client went away)
            message = f"the upstream {self.address} {self.lost}"
            raise GatewayError(503, message, "upstream_failed", retryable=True) from None
        if response is grpc.aio.EOF:
            self.upstream_seconds = time.monotonic() - self._sent
            return None
        return response

    def close(self) -> None:
        """End the call (a no-op once it has finished), release the upstream's slot and settle
        the key's charge."""
        if self._reservation is not None:
            self._call.cancel()
            self._reservation.__exit__(None, None, None)
            self._reservation = None
            if self.charge is not None:
                self.charge.settle(self.usage)


class CachedStream:
    """A stored answer, replayed as the live one was streamed."""

    def __init__(self, responses: list, where: Where, request_id: str):
        self.responses, self.where = responses, where
        self.upstream_seconds: float | None = None  # no upstream call
        for r in responses:
            r.request_id = request_id
        self.charge: Charge | None = None

    @property
    def model(self) -> str:
        return self.responses[0].model

    async def __aiter__(self) -> AsyncIterator:
        try:
            for r in self.responses:
                yield r
        finally:
            self.close()

    def close(self) -> None:
        if self.charge is not None:
            self.charge.settle(self.responses[-1].usage)
            self.charge = None


Stream = UpstreamStream | CachedStream


def answer_headers(stream: "Stream") -> dict[str, str]:
    """What an answer's headers (gRPC metadata) say: where it went, the key's rate limits, and
    x-meridian-upstream-ms once the upstream call has ended (never for a cached answer)."""
    headers = {**stream.where.headers(), **(stream.charge.headers if stream.charge else {})}
    if stream.upstream_seconds is not None:
        headers["x-meridian-upstream-ms"] = f"{stream.upstream_seconds * 1000:.3f}"
    return headers


async def collect(stream: Stream, observe=None) -> tuple[str, list, object, int]:
    """Read a stream to its end: (text, logprobs, final usage, finish reason). `observe` is called
    with each response as it comes (metrics)."""
    text, logprobs, usage, reason = [], [], pb.Usage(), pb.FINISH_REASON_UNSPECIFIED
    async for r in stream:
        if observe is not None:
            observe(r)
        text.append(r.text)
        logprobs.extend(r.logprobs)
        usage, reason = r.usage, r.finish_reason or reason
    return "".join(text), logprobs, usage, reason
