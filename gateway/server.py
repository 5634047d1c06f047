"""`meridian gateway`: the OpenAI-compatible HTTP API and meridian.v1 gRPC in front of workers.

One process, one event loop: uvicorn serves HTTP, grpc.aio serves gRPC (with grpc.health.v1 and
reflection), and a LoadReport stream per worker keeps the routing view current. SIGTERM or SIGINT
stops accepting and lets in-flight requests finish for up to --drain-timeout seconds.
"""

import argparse
import asyncio
import contextlib
import dataclasses
import math
import re
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
from meridian.gateway import discovery
from meridian.gateway.auto_model import AUTO, parse_auto_model
from meridian.gateway.dispatch import Dispatcher
from meridian.gateway.grpc_service import GatewayInference
from meridian.gateway.openai_app import create_app
from meridian.gateway.ratelimit import RateLimiter, load_api_keys
from meridian.gateway.result_cache import ResultCache
from meridian.gateway.routing import RoutingPolicy
from meridian.gateway.workers import PoolCollector, WorkerPool
from meridian.limits import MAX_MESSAGE_BYTES
from meridian.metrics import RequestMetrics, new_registry

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name


@dataclass(frozen=True)
class GatewaySettings:
    region: str = "default"
    # Where the local workers are: HOST:PORT each; DNS names (NAME for SRV, NAME:PORT for A/AAAA);
    # NAMESPACE/SERVICE[:PORT_NAME] of EndpointSlices. Any mix.
    workers: tuple[str, ...] = ()
    worker_dns: tuple[str, ...] = ()
    worker_endpointslices: tuple[str, ...] = ()
    # Peer regions' gateways: REGION=HOST:PORT each; DNS SRV names.
    peers: tuple[str, ...] = ()
    peer_dns: tuple[str, ...] = ()
    dns_server: str | None = None  # IP[:PORT]; None: /etc/resolv.conf
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051
    max_queue_per_worker: int = 128  # requests a worker may queue beyond what it runs at once
    max_attempts: int = 3  # upstreams tried for one request before its first token
    stale_after: float = 5.0  # seconds: older load reports are not trusted
    report_interval: float = 0.5  # seconds between an upstream's load reports
    drain_timeout: float = 30.0  # seconds in-flight requests get to finish on SIGTERM
    request_timeout: float = 600.0  # seconds: the deadline of every upstream call
    first_token_timeout: float = 60.0  # seconds an upstream may take to a first token
    spill_margin: float = 0.25  # seconds a peer must be predicted faster by to take a request
    probe_share: float = 0.01  # of requests sent to a peer to keep its figures measured
    prefix_affinity: bool = True
    result_cache_size: int = 64 * 2**20  # bytes; 0 turns the result cache off
    result_cache_ttl: float = 300.0  # seconds
    api_keys_file: str | None = None
    auto_model: str | None = None  # "SMALL,LARGE"

    def __post_init__(self) -> None:
        sources = (self.workers, self.worker_dns, self.worker_endpointslices)
        if not any(sources) and not (self.peers or self.peer_dns):
            raise UserError(
                "give the workers (--worker, --worker-dns or --worker-endpointslices) or, "
                "for a region without workers of its own, peers (--peer or --peer-dns)"
            )
        if not REGION.fullmatch(self.region):
            raise UserError(f"region {self.region!r} must be 1-63 letters, digits, '-' or '_'")
        self.worker_sources(), self.peer_regions(), self.peer_sources()  # raise on bad values
        if self.dns_server is not None:
            discovery.parse_nameserver(self.dns_server)
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
        if self.request_timeout <= 0 or self.spill_margin < 0 or not 0 <= self.probe_share < 1:
            raise UserError("request timeout > 0, spill margin >= 0 and 0 <= probe share < 1")
        if self.first_token_timeout <= 0:
            raise UserError("first token timeout must be positive")
        if self.result_cache_size < 0 or self.result_cache_ttl <= 0:
            raise UserError("result cache size must be >= 0 bytes and its TTL positive")
        if self.auto_model is not None:
            parse_auto_model(self.auto_model)

    @property
    def policy(self) -> RoutingPolicy:
        return RoutingPolicy(
            self.max_queue_per_worker,
            self.stale_after,
            spill_margin=self.spill_margin,
            spill_exit_margin=min(SPILL_EXIT_MARGIN, self.spill_margin),
            probe_share=self.probe_share,
        )

    def worker_sources(self) -> list[discovery.Source]:
        sources = [discovery.parse_static(self.workers)] if self.workers else []
        sources += [discovery.parse_dns(name) for name in self.worker_dns]
        return sources + [discovery.parse_endpointslices(s) for s in self.worker_endpointslices]

    def peer_regions(self) -> dict[str, str]:
        """--peer values: address -> the region it was given as."""
        regions = {}
        for value in self.peers:
            region, sep, address = value.partition("=")
            if not sep or not REGION.fullmatch(region):
                raise UserError(
                    f"peer {value!r} is not REGION=HOST:PORT (e.g. eu-west=10.1.0.5:50051)"
                )
            discovery.parse_static([address])
            regions[address] = region
        return regions

    def peer_sources(self) -> list[discovery.Source]:
        return [discovery.parse_dns(name) for name in self.peer_dns]


REGION = re.compile(r"[A-Za-z0-9_-]{1,63}")
SPILL_EXIT_MARGIN = 0.05  # seconds: once spilling, a peer keeps requests while it wins by this


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = GatewaySettings(workers=("localhost:1",))
    parser.add_argument("--region", default=d.region, help=f"this gateway's region ({d.region!r})")
    workers = parser.add_argument_group("workers of this region (any mix, each repeatable)")
    workers.add_argument(
        "--worker",
        dest="workers",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a worker's gRPC address",
    )
    workers.add_argument(
        "--worker-dns",
        action="append",
        default=[],
        metavar="NAME[:PORT]",
        help="follow DNS: NAME's SRV records, or NAME:PORT's A/AAAA (a headless Service)",
    )
    workers.add_argument(
        "--worker-endpointslices",
        action="append",
        default=[],
        metavar="NAMESPACE/SERVICE[:PORT_NAME]",
        help="follow a Service's EndpointSlices (ready endpoints, port named grpc by default)",
    )
    peers = parser.add_argument_group("peer regions' gateways (each repeatable)")
    peers.add_argument(
        "--peer",
        dest="peers",
        action="append",
        default=[],
        metavar="REGION=HOST:PORT",
        help="a peer region's gateway (its gRPC address)",
    )
    peers.add_argument(
        "--peer-dns", action="append", default=[], metavar="NAME", help="follow NAME's SRV records"
    )
    parser.add_argument(
        "--dns-server", metavar="IP[:PORT]", help="DNS server for discovery (/etc/resolv.conf's)"
    )
    parser.add_argument("--host", default=d.host, help=f"address to listen on (default {d.host})")
    parser.add_argument("--http-port", type=int, default=d.http_port, help="OpenAI HTTP API port")
    parser.add_argument("--grpc-port", type=int, default=d.grpc_port, help="meridian.v1 gRPC port")
    routing = parser.add_argument_group("routing")
    routing.add_argument(
        "--max-queue-per-worker",
        type=int,
        default=d.max_queue_per_worker,
        help="requests a worker may queue beyond those it runs; past it everywhere: 429",
    )
    routing.add_argument(
        "--max-attempts",
        type=int,
        default=d.max_attempts,
        help="upstreams tried for a request before its first token",
    )
    routing.add_argument(
        "--load-stale-after",
        dest="stale_after",
        type=float,
        default=d.stale_after,
        help="seconds after which a load report is not trusted",
    )
    routing.add_argument(
        "--request-timeout",
        type=float,
        default=d.request_timeout,
        help="deadline in seconds of every upstream call (a client's shorter one wins)",
    )
    routing.add_argument(
        "--first-token-timeout",
        type=float,
        default=d.first_token_timeout,
        help="seconds an upstream may take to a first token before the request goes elsewhere",
    )
    routing.add_argument(
        "--spill-margin",
        type=float,
        default=d.spill_margin,
        help="seconds a peer region must be predicted faster by to take a request",
    )
    routing.add_argument(
        "--probe-share",
        type=float,
        default=d.probe_share,
        help="share of requests sent to a peer to keep its figures measured",
    )
    routing.add_argument(
        "--no-prefix-affinity",
        dest="prefix_affinity",
        action="store_false",
        help="within the region, power of two choices only (ignore cached prefixes)",
    )
    routing.add_argument(
        "--auto-model",
        metavar="SMALL,LARGE",
        help='answer model "auto" with SMALL (short prompt, short answer) or LARGE',
    )
    parser.add_argument(
        "--result-cache-size",
        type=int,
        default=d.result_cache_size,
        metavar="BYTES",
        help="bytes of results of deterministic requests kept (0 = off)",
    )
    parser.add_argument(
        "--result-cache-ttl",
        type=float,
        default=d.result_cache_ttl,
        metavar="S",
        help="seconds a cached result is served",
    )
    parser.add_argument(
        "--api-keys-file",
        metavar="PATH",
        help="API keys, one per line with optional rpm=N tpm=N: turns on 401s and rate limits",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=d.drain_timeout,
        help="seconds in-flight requests get to finish on SIGTERM",
    )


def gateway_settings(args: argparse.Namespace) -> GatewaySettings:
    names = [f.name for f in dataclasses.fields(GatewaySettings) if hasattr(args, f.name)]
    values = {name: getattr(args, name) for name in names}
    for name, value in values.items():
        if isinstance(value, list):
            values[name] = tuple(value)
    return GatewaySettings(**values)


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
    """The gateway's servers, upstreams and discovery, started and stopped together."""

    def __init__(self, settings: GatewaySettings):
        s = self.settings = settings
        self.registry = new_registry()
        self.pool = WorkerPool(s.region, s.report_interval)
        self.metrics = RequestMetrics(self.registry, "gateway", self._model_names)
        keys = load_api_keys(s.api_keys_file) if s.api_keys_file else {}
        self.dispatcher = Dispatcher(
            self.pool,
            s.policy,
            self.registry,
            s.max_attempts,
            s.request_timeout,
            s.first_token_timeout,
            cache=ResultCache(s.result_cache_size, s.result_cache_ttl)
            if s.result_cache_size
            else None,
            auto_model=parse_auto_model(s.auto_model) if s.auto_model else None,
            limiter=RateLimiter(keys) if keys else None,
            prefix_affinity=s.prefix_affinity,
        )
        self.servicer = GatewayInference(self.dispatcher, self.pool, self.metrics)
        self.health = health.aio.HealthServicer()
        self._grpc: grpc.aio.Server | None = None
        self._http: _HTTPServer | None = None
        self._http_task: asyncio.Task | None = None
        self._tasks: list[asyncio.Task] = []

    def _model_names(self) -> set[str]:
        """What a request's model may be labelled as in metrics (anything else: unknown)."""
        names = {m.id for m in self.pool.models()}
        return names | {AUTO} if self.settings.auto_model else names

    def describe(self) -> str:
        s = self.settings
        sources = [str(source) for source in s.worker_sources()] or ["none"]
        peers = [*s.peers, *s.peer_dns] or ["none"]
        return (
            f"region {s.region}: OpenAI API on http://{s.host}:{s.http_port}/v1, meridian.v1 "
            f"gRPC on {s.host}:{s.grpc_port}; workers: {'; '.join(sources)}; "
            f"peers: {', '.join(peers)}"
        )

    async def start(self) -> None:
        s = self.settings
        self.registry.register(PoolCollector(self.pool))
        http_socket = _listen(s.host, s.http_port)
        for address, region in s.peer_regions().items():
            self.pool.add(address, peer=True, region=region)
        follow = [(source, False) for source in s.worker_sources()]
        follow += [(source, True) for source in s.peer_sources()]
        for source, peer in follow:
            addresses = discovery.watch(source, s.dns_server)
            self._tasks.append(asyncio.create_task(self.pool.follow(addresses, peer)))
        self._grpc = grpc.aio.server(
            options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        )
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
        self._tasks.append(asyncio.create_task(self._track_health()))
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
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.pool.close()

    async def _track_health(self) -> None:
        """gRPC health follows the HTTP /health rule: SERVING while some worker here or in a
        peer region serves."""
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        while True:
            status = serving if self.pool.serving() or self.pool.peers_serving() else not_serving
            for name in ("", SERVICE_NAME):
                await self.health.set(name, status)
            await self.pool.changed()


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets
    # created with it, and with Nagle on, each kept-alive response waits for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen for HTTP on {host}:{port}: {e.strerror}") from e
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock
