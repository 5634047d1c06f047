"""`meridian gateway`: the OpenAI-compatible HTTP API and meridian.v1 gRPC in front of workers.

One process, one event loop: uvicorn serves HTTP, grpc.aio serves gRPC (with grpc.health.v1 and
reflection), and a LoadReport stream per worker keeps the routing view current. SIGTERM or SIGINT
stops accepting and lets in-flight requests finish for up to --drain-timeout seconds.
"""

import argparse
import asyncio
import contextlib
import math
import signal
import socket
import sys
from dataclasses import dataclass

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from meridian.api.v1 import pb, pb_grpc
from meridian.errors import UserError
from meridian.gateway.dispatch import Dispatcher
from meridian.gateway.grpc_service import GatewayInference
from meridian.gateway.openai_app import create_app
from meridian.gateway.routing import RoutingPolicy
from meridian.gateway.workers import PoolCollector, WorkerPool
from meridian.metrics import RequestMetrics, new_registry

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name


@dataclass(frozen=True)
class GatewaySettings:
    workers: tuple[str, ...]  # host:port of each worker's gRPC server
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051
    max_queue_per_worker: int = 128  # requests a worker may queue beyond what it runs at once
    max_attempts: int = 3  # workers tried for one request before its first token
    stale_after: float = 5.0  # seconds: older load reports are not trusted
    report_interval: float = 0.5  # seconds between a worker's load reports
    drain_timeout: float = 30.0  # seconds in-flight requests get to finish on SIGTERM

    def __post_init__(self) -> None:
        if not self.workers:
            raise UserError("give at least one --worker HOST:PORT")
        for address in self.workers:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise UserError(f"worker address {address!r} is not HOST:PORT")
        for name in ("http_port", "grpc_port"):
            if not 0 < getattr(self, name) < 65536:
                raise UserError(f"{name.replace('_', ' ')} must be between 1 and 65535")
        if self.http_port == self.grpc_port:
            raise UserError("the HTTP and gRPC ports must differ")
        if self.max_queue_per_worker < 0 or self.max_attempts < 1:
            raise UserError("max queue per worker must be >= 0 and max attempts >= 1")
        if min(self.stale_after, self.report_interval) <= 0 or self.drain_timeout < 0:
            raise UserError("stale-after and report interval must be positive, drain timeout >= 0")
        if self.stale_after <= self.report_interval:
            raise UserError("stale-after must be longer than the report interval")

    @property
    def policy(self) -> RoutingPolicy:
        return RoutingPolicy(self.max_queue_per_worker, self.stale_after)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = GatewaySettings(workers=("localhost:1",))
    parser.add_argument(
        "--worker",
        dest="workers",
        action="append",
        required=True,
        metavar="HOST:PORT",
        help="a worker's gRPC address (repeat for each worker)",
    )
    parser.add_argument("--host", default=d.host, help=f"address to listen on (default {d.host})")
    parser.add_argument("--http-port", type=int, default=d.http_port, help="OpenAI HTTP API port")
    parser.add_argument("--grpc-port", type=int, default=d.grpc_port, help="meridian.v1 gRPC port")
    parser.add_argument(
        "--max-queue-per-worker",
        type=int,
        default=d.max_queue_per_worker,
        help="requests a worker may queue beyond those it runs; past it on every worker: 429",
    )
    parser.add_argument(
        "--max-attempts",
        type=int,
        default=d.max_attempts,
        help="workers tried for a request before its first token",
    )
    parser.add_argument(
        "--load-stale-after",
        dest="stale_after",
        type=float,
        default=d.stale_after,
        help="seconds after which a worker's last load report is not trusted",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=d.drain_timeout,
        help="seconds in-flight requests get to finish on SIGTERM",
    )


def gateway_settings(args: argparse.Namespace) -> GatewaySettings:
    return GatewaySettings(
        workers=tuple(args.workers),
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        max_queue_per_worker=args.max_queue_per_worker,
        max_attempts=args.max_attempts,
        stale_after=args.stale_after,
        drain_timeout=args.drain_timeout,
    )


def run(args: argparse.Namespace) -> int:
    return asyncio.run(serve(gateway_settings(args)))


async def serve(settings: GatewaySettings) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    gateway = Gateway(settings)
    await gateway.start()
    print(f"meridian gateway: {gateway.describe()}", file=sys.stderr, flush=True)
    try:
        await stop.wait()
    finally:
        await gateway.stop()
    return 0


class _HTTPServer(uvicorn.Server):
    # The process owns its signals (the gateway also runs gRPC, and `meridian serve` runs workers).
    def capture_signals(self):
        return contextlib.nullcontext()


class Gateway:
    """The gateway's servers and worker pool, started and stopped together."""

    def __init__(self, settings: GatewaySettings):
        self.settings = settings
        self.registry = new_registry()
        self.metrics = RequestMetrics(self.registry, "gateway")
        self.pool = WorkerPool(settings.workers, settings.report_interval)
        self.dispatcher = Dispatcher(
            self.pool, settings.policy, self.registry, settings.max_attempts
        )
        self.servicer = GatewayInference(self.dispatcher, self.pool, self.metrics)
        self.health = health.aio.HealthServicer()
        self._grpc: grpc.aio.Server | None = None
        self._http: _HTTPServer | None = None
        self._http_task: asyncio.Task | None = None
        self._health_task: asyncio.Task | None = None

    def describe(self) -> str:
        s = self.settings
        return (
            f"OpenAI API on http://{s.host}:{s.http_port}/v1, meridian.v1 gRPC on "
            f"{s.host}:{s.grpc_port}, {len(s.workers)} worker(s)"
        )

    async def start(self) -> None:
        s = self.settings
        self.registry.register(PoolCollector(self.pool))
        http_socket = _listen(s.host, s.http_port)
        await self.pool.start()
        self._grpc = grpc.aio.server()
        pb_grpc.add_InferenceServicer_to_server(self.servicer, self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], self._grpc
        )
        try:
            self._grpc.add_insecure_port(f"{s.host}:{s.grpc_port}")
        except RuntimeError as e:
            raise UserError(f"cannot listen for gRPC on {s.host}:{s.grpc_port}: {e}") from e
        await self._grpc.start()
        self._health_task = asyncio.create_task(self._track_health())
        app = create_app(self.dispatcher, self.pool, self.registry, self.metrics)
        config = uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=max(1, math.ceil(s.drain_timeout)),
        )
        self._http = _HTTPServer(config)
        self._http_task = asyncio.create_task(self._http.serve(sockets=[http_socket]))
        while not self._http.started and not self._http_task.done():
            await asyncio.sleep(0.01)
        if self._http_task.done():
            self._http_task.result()  # raises what stopped it
            raise RuntimeError("the HTTP server stopped while starting")

    async def stop(self) -> None:
        """Stop accepting; give in-flight requests up to the drain timeout; close everything."""
        self.servicer.draining = True
        await self.health.enter_graceful_shutdown()
        if self._http is not None:
            self._http.should_exit = True
        # HTTP drains in its own task (uvicorn waits for open responses) while gRPC drains here.
        if self._grpc is not None:
            await self._grpc.stop(grace=self.settings.drain_timeout)
        if self._http_task is not None:
            await asyncio.gather(self._http_task, return_exceptions=True)
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        await self.pool.close()

    async def _track_health(self) -> None:
        """gRPC health follows the HTTP /health rule: SERVING while some worker serves."""
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        while True:
            status = serving if self.pool.serving() else not_serving
            for name in ("", SERVICE_NAME):
                await self.health.set(name, status)
            await self.pool.changed()


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen for HTTP on {host}:{port}: {e.strerror}") from e
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock
