"""`meridian worker`: one model replica behind gRPC (meridian.v1.Inference, grpc.health.v1, server
reflection), with Prometheus metrics on a separate HTTP port.

Lifecycle: the gRPC server starts at once with health NOT_SERVING (so probes get an answer while
weights load), the model loads in a background thread, a short warm-up runs through the engine, and
only then does health turn SERVING. SIGTERM or SIGINT drains: health turns NOT_SERVING, new calls
get UNAVAILABLE (a gateway retries them on another worker), in-flight requests run to completion
for up to --drain-timeout seconds, whatever is left is aborted, and the process exits 0. A second
signal ends the wait at once. If the engine itself fails, the worker reports FAILED and exits 1.

A watchdog checks every half second how long the engine's current step has run: past
--step-timeout the worker reports STALLED, health turns NOT_SERVING (so a liveness probe can
restart a hung process) and new calls get UNAVAILABLE; when steps return, it serves again.
"""

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from meridian.api.v1 import pb, pb_grpc
from meridian.errors import UserError
from meridian.limits import MAX_MESSAGE_BYTES
from meridian.metrics import RequestMetrics, new_registry
from meridian.worker.arguments import add_engine_arguments, engine_settings
from meridian.worker.engine.async_engine import AsyncEngine
from meridian.worker.engine.llm_engine import EngineSettings, LLMEngine
from meridian.worker.metrics import COMPONENT, EngineCollector, queue_time_histogram
from meridian.worker.sampling_params import SamplingParams
from meridian.worker.service import InferenceService

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
SERVER_OPTIONS = [
    # Gateways keep a LoadReport stream open and ping it to notice a dead peer quickly.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000),
    # Whatever a gateway accepts (meridian.limits) reaches the worker.
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
WATCHDOG_INTERVAL = 0.5  # seconds between checks of the engine's step


@dataclass(frozen=True)
class WorkerSettings:
    engine: EngineSettings
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 9400  # 0: no metrics endpoint
    served_model_name: str | None = None  # default: --model as given
    drain_timeout: float = 30.0  # seconds in-flight requests get to finish after SIGTERM
    step_timeout: float = 30.0  # seconds one engine step may run before the worker is STALLED

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536 or not 0 <= self.metrics_port < 65536:
            raise UserError("ports must be between 0 and 65535")
        if self.drain_timeout < 0:
            raise UserError(f"drain timeout must be >= 0 seconds, got {self.drain_timeout}")
        if self.step_timeout <= 0:
            raise UserError(f"step timeout must be > 0 seconds, got {self.step_timeout}")
        if self.served_model_name == "":
            raise UserError("served model name must not be empty")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = WorkerSettings(EngineSettings())
    s = parser.add_argument_group("server")
    s.add_argument("--host", default=d.host, help=f"address to listen on (default {d.host})")
    s.add_argument("--port", type=int, default=d.port, help=f"gRPC port (default {d.port})")
    s.add_argument(
        "--metrics-port",
        type=int,
        default=d.metrics_port,
        help=f"Prometheus /metrics port (default {d.metrics_port}; 0 = off)",
    )
    s.add_argument("--served-model-name", help="the name requests use (default: --model)")
    s.add_argument(
        "--drain-timeout",
        type=float,
        default=d.drain_timeout,
        help=f"seconds in-flight requests get to finish on SIGTERM (default {d.drain_timeout:g})",
    )
    s.add_argument(
        "--step-timeout",
        type=float,
        default=d.step_timeout,
        help="seconds one engine step may run before the worker reports itself stalled: health "
        f"NOT_SERVING and new requests refused until steps return (default {d.step_timeout:g})",
    )
    add_engine_arguments(parser)


def worker_settings(args: argparse.Namespace) -> WorkerSettings:
    return WorkerSettings(
        engine=engine_settings(args),
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        served_model_name=args.served_model_name,
        drain_timeout=args.drain_timeout,
        step_timeout=args.step_timeout,
    )


def run(args: argparse.Namespace) -> int:
    return asyncio.run(serve(worker_settings(args)))


async def serve(settings: WorkerSettings) -> int:
    registry = new_registry()
    service = InferenceService(
        settings.model_name, RequestMetrics(registry, COMPONENT), queue_time_histogram(registry)
    )
    registry.register(
        EngineCollector(settings.model_name, lambda: service.engine and service.engine.stats())
    )
    health_servicer = health.aio.HealthServicer()
    await _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
    server = grpc_server(service, health_servicer)
    address = f"{settings.host}:{settings.port}"
    try:
        server.add_insecure_port(address)
    except RuntimeError as e:
        raise UserError(f"cannot listen on {address}: {e}") from e
    await server.start()
    metrics_server = None
    if settings.metrics_port:
        try:
            metrics_server, _ = start_http_server(
                settings.metrics_port, settings.host, registry=registry
            )
        except OSError as e:
            raise UserError(f"cannot serve metrics on port {settings.metrics_port}: {e}") from e
    signals = _Signals()
    engine = None
    try:
        engine = await _load(settings.engine, signals.stop)
        if engine is None:  # stopped while loading
            return 0
        service.engine = engine
        await _warm_up(engine)
        service.set_state(pb.SERVING_STATE_SERVING)
        await _set_health(health_servicer, health_pb2.HealthCheckResponse.SERVING)
        print(
            f"meridian worker: serving {settings.model_name} on {address}"
            + (f", metrics on :{settings.metrics_port}" if metrics_server else ""),
            file=sys.stderr,
            flush=True,
        )
        await watch_engine(service, health_servicer, settings.step_timeout, signals.stop)
        if engine.error is not None:
            # Nothing can be served any more: say so, and exit for a supervisor to restart us.
            service.set_state(pb.SERVING_STATE_FAILED)
            await _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
            print(f"meridian worker: the engine failed: {engine.error}", file=sys.stderr)
            return 1
        await _drain(service, health_servicer, settings.drain_timeout, signals.hurry)
    finally:
        await server.stop(grace=1.0)
        if engine is not None:
            engine.shutdown()
        if metrics_server is not None:
            metrics_server.shutdown()
    return 0


def grpc_server(service: InferenceService, health_servicer) -> grpc.aio.Server:
    """The worker's gRPC server (not started, no port yet): inference, health and reflection."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    pb_grpc.add_InferenceServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    return server


async def watch_engine(
    service: InferenceService, health_servicer, step_timeout: float, stop: asyncio.Event
) -> None:
    """Until `stop` is set or the engine fails: turn STALLED (health NOT_SERVING) while a step
    overruns `step_timeout`, and SERVING again once it returns."""
    engine = service.engine
    while not stop.is_set() and engine.error is None:
        state = watchdog_state(service.state, engine.step_started, time.monotonic(), step_timeout)
        if state != service.state:
            if state == pb.SERVING_STATE_STALLED:
                log.warning("an engine step has run for over %g s: not admitting", step_timeout)
                health_status = health_pb2.HealthCheckResponse.NOT_SERVING
            else:
                log.warning("the engine's steps returned: admitting again")
                health_status = health_pb2.HealthCheckResponse.SERVING
            service.set_state(state)
            await _set_health(health_servicer, health_status)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), WATCHDOG_INTERVAL)


def watchdog_state(state: int, step_started: float | None, now: float, step_timeout: float) -> int:
    """SERVING turns STALLED while the engine's current step (started at `step_started`, None
    when idle) has run longer than `step_timeout` seconds, and back once it returns; any other
    state stays as it is."""
    stalled = step_started is not None and now - step_started > step_timeout
    if state == pb.SERVING_STATE_SERVING and stalled:
        return pb.SERVING_STATE_STALLED
    if state == pb.SERVING_STATE_STALLED and not stalled:
        return pb.SERVING_STATE_SERVING
    return state


class _Signals:
    """SIGTERM/SIGINT: the first starts a drain, the second cuts it short."""

    def __init__(self):
        self.stop, self.hurry = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)

    def _on_signal(self) -> None:
        (self.hurry if self.stop.is_set() else self.stop).set()


async def _set_health(servicer, status) -> None:
    for name in ("", SERVICE_NAME):  # "" is the whole server, what Kubernetes' gRPC probe asks
        await servicer.set(name, status)


async def _load(settings: EngineSettings, stop: asyncio.Event) -> AsyncEngine | None:
    """Load the model off the event loop (health keeps answering); None if stopped first. The
    thread is a daemon so that a stop during a long load does not wait for it."""
    loop = asyncio.get_running_loop()
    loaded: asyncio.Future = loop.create_future()

    def settle(result=None, error=None) -> None:
        if loaded.done():
            return
        if error is not None:
            loaded.set_exception(error)
        else:
            loaded.set_result(result)

    def load() -> None:
        try:
            engine = LLMEngine(settings)
            engine.tokenizer.token_text(0)  # builds the vocabulary's text table here, not in a call
        except BaseException as e:
            loop.call_soon_threadsafe(settle, None, e)
        else:
            loop.call_soon_threadsafe(settle, engine)

    threading.Thread(target=load, name="load-model", daemon=True).start()
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({loaded, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not loaded.done():
        return None
    return AsyncEngine(loaded.result())


async def _warm_up(engine: AsyncEngine) -> None:
    """Run a prefill, batched decodes and both samplers once, so the first user request does not
    pay for lazy initialisation."""
    ids = engine.tokenizer.encode("Hello! How are you today?") or [0]

    async def one(n: int, params: SamplingParams) -> None:
        async for _ in engine.generate(f"warm-up-{n}", ids, params):
            pass

    await asyncio.gather(
        one(0, SamplingParams(max_tokens=4, temperature=0)),
        one(1, SamplingParams(max_tokens=4, temperature=0.8, seed=0, logprobs=1)),
    )


async def _drain(service: InferenceService, health_servicer, timeout: float, hurry) -> None:
    service.set_state(pb.SERVING_STATE_DRAINING)
    await health_servicer.enter_graceful_shutdown()
    print(
        f"meridian worker: draining {len(service.live)} request(s) (up to {timeout:g} s)",
        file=sys.stderr,
        flush=True,
    )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while service.live and loop.time() < deadline and not hurry.is_set():
        await asyncio.sleep(0.05)
    if service.live:
        log.warning("drain timeout: aborting %d request(s)", len(service.live))
        for request_id in list(service.live):
            service.engine.abort(request_id)
        # Let their handlers send the final "abort" responses before the server closes.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                while service.live:
                    await asyncio.sleep(0.05)
