"""A real gateway (HTTP + gRPC servers on free localhost ports) in front of scripted gRPC workers.

The scripted workers speak meridian.v1 over a real gRPC server; each Generate call does what the
test asks (serve tokens, refuse, fail mid-stream, hang until cancelled), which is how the gateway's
retry and cancellation paths are driven without a model. Tests against real workers are in e2e/.
"""

import asyncio
import contextlib
import time

import grpc

from meridian.api.v1 import pb, pb_grpc
from meridian.gateway.routing import SERVING
from meridian.gateway.server import Gateway, GatewaySettings
from meridian.net import free_port

MODEL = "scripted"


class ScriptedWorker(pb_grpc.InferenceServicer):
    def __init__(
        self,
        mode: str = "serve",
        tokens: int = 3,
        running: int = 0,
        max_num_seqs: int = 8,
        model: str = MODEL,
    ):
        self.mode, self.tokens, self.model = mode, tokens, model
        self.running, self.max_num_seqs = running, max_num_seqs
        self.requests_per_second = 0.0
        self.state = pb.SERVING_STATE_SERVING
        self.calls: list = []  # the GenerateRequests received
        self.cancelled_at: float | None = None
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.server: grpc.aio.Server | None = None

    async def start(self) -> None:
        self.server = grpc.aio.server()
        pb_grpc.add_InferenceServicer_to_server(self, self.server)
        self.server.add_insecure_port(self.address)
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop(grace=None)

    def _response(self, i: int, last: bool):
        return pb.GenerateResponse(
            token_ids=[100 + i],
            text=f"w{i} ",
            finish_reason=pb.FINISH_REASON_LENGTH if last else pb.FINISH_REASON_UNSPECIFIED,
            usage=pb.Usage(prompt_tokens=4, completion_tokens=i + 1),
            model=self.model,
        )

    async def Generate(self, request, context):
        self.calls.append(request)
        if self.mode == "refuse":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this worker is draining")
        if self.mode == "too_long":
            context.set_trailing_metadata([("meridian-error-code", "context_length_exceeded")])
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the prompt has 9000 tokens")
        if self.mode == "overloaded":
            context.set_trailing_metadata([("meridian-error-code", "overloaded")])
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the queue is full")
        if self.mode == "too_big":  # what gRPC itself answers for a message over the size limit
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "message larger than max")
        if self.mode == "silent":  # accepts the call, never answers
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled_at = time.monotonic()
                raise
        yield self._response(0, last=self.tokens == 1)
        if self.mode == "break":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker went away")
        if self.mode == "hang":
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled_at = time.monotonic()
                raise
        for i in range(1, self.tokens):
            yield self._response(i, last=i == self.tokens - 1)

    async def Models(self, request, context):
        return pb.ModelsResponse(models=[pb.Model(id=self.model, max_model_len=2048, created=1)])

    async def LoadReport(self, request, context):
        while True:
            yield pb.Load(
                state=self.state,
                model=self.model,
                running=self.running,
                max_num_seqs=self.max_num_seqs,
                kv_blocks_total=64,
                block_size=16,
                requests_finished_per_second=self.requests_per_second,
                serving_replicas=int(self.state == pb.SERVING_STATE_SERVING),
                prefix_cache=pb.PrefixCache(block_hashes=[hash(self.address) % 2**63]),
            )
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def running_gateway(
    workers: list[ScriptedWorker],
    wait_serving: int | None = None,
    peer_gateways: tuple[Gateway, ...] = (),
    **settings,
):
    """A gateway in front of `workers` (started here), with `peer_gateways` (already running) as
    its peer regions; yielded once the workers and the peers serve."""
    for w in workers:
        await w.start()
    gateway = Gateway(
        GatewaySettings(
            workers=tuple(w.address for w in workers),
            peers=tuple(f"{p.settings.region}={grpc_address(p)}" for p in peer_gateways),
            http_port=free_port(),
            grpc_port=free_port(),
            report_interval=0.05,
            drain_timeout=1.0,
            **settings,
        )
    )
    await gateway.start()
    try:
        count = len(workers) if wait_serving is None else wait_serving
        await asyncio.wait_for(gateway.pool.wait_serving(count), 10)
        await asyncio.wait_for(_peers_serving(gateway, len(peer_gateways)), 10)
        yield gateway
    finally:
        await gateway.stop()
        for w in workers:
            await w.stop()


def url(gateway: Gateway, path: str) -> str:
    return f"http://127.0.0.1:{gateway.settings.http_port}{path}"


async def _peers_serving(gateway: Gateway, count: int) -> None:
    while sum(u.peer and u.load.state == SERVING for u in gateway.pool.upstreams.values()) < count:
        await gateway.pool.changed()


def grpc_address(gateway: Gateway) -> str:
    return f"127.0.0.1:{gateway.settings.grpc_port}"
