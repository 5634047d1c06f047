"""`meridian serve`: a whole local deployment in one command: N worker processes and a gateway.

The workers are `meridian worker` subprocesses on free localhost ports; the gateway runs in this
process. Workers get their own sessions, so Ctrl-C reaches only this process, which then drains
everything in order: the gateway stops accepting, each worker gets one SIGTERM and finishes what it
is running, and the command exits 0. A second Ctrl-C cuts the drain short. On Linux the workers are
also told to exit if this process dies without cleaning up (PR_SET_PDEATHSIG).
"""

import argparse
import asyncio
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from meridian.errors import UserError
from meridian.gateway.server import Gateway, GatewaySettings
from meridian.net import free_port
from meridian.worker.arguments import add_engine_arguments, engine_flags, engine_settings
from meridian.worker.engine.llm_engine import EngineSettings
from meridian.worker.loaders import resolve

PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ServeSettings:
    engine: EngineSettings
    workers: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50051
    drain_timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise UserError(f"--workers must be at least 1, got {self.workers}")
        if self.drain_timeout < 0:
            raise UserError("--drain-timeout must be >= 0 seconds")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = ServeSettings(EngineSettings())
    parser.add_argument("--workers", type=int, default=d.workers, help="worker processes (1)")
    parser.add_argument("--host", default=d.host, help=f"gateway address (default {d.host})")
    parser.add_argument("--port", type=int, default=d.port, help=f"HTTP port (default {d.port})")
    parser.add_argument("--grpc-port", type=int, default=d.grpc_port, help="gRPC port (50051)")
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=d.drain_timeout,
        help="seconds in-flight requests get to finish on Ctrl-C",
    )
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    settings = ServeSettings(
        engine=engine_settings(args),
        workers=args.workers,
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        drain_timeout=args.drain_timeout,
    )
    resolve(settings.engine.model)  # a missing model fails here, not in N workers
    gateway_settings = GatewaySettings(
        workers=tuple(f"127.0.0.1:{free_port()}" for _ in range(settings.workers)),
        host=settings.host,
        http_port=settings.port,
        grpc_port=settings.grpc_port,
        drain_timeout=settings.drain_timeout,
    )
    # Spawned before asyncio and gRPC start any thread, which keeps preexec_fn safe.
    workers = [spawn_worker(settings, address) for address in gateway_settings.workers]
    try:
        return asyncio.run(_serve(settings, gateway_settings, workers))
    finally:
        _stop_workers(workers, settings.drain_timeout + 10)


def worker_command(engine: EngineSettings, address: str, metrics_port: int, drain: float):
    host, _, port = address.rpartition(":")
    command = [sys.executable, "-P", "-m", "meridian.cli", "worker", "--host", host]
    command += ["--port", port, "--metrics-port", str(metrics_port)]
    command += ["--drain-timeout", str(drain), *engine_flags(engine)]
    return command


@dataclass
class LocalWorker:
    process: subprocess.Popen
    metrics_port: int
    signals_sent: int = 0

    def running(self) -> bool:
        return self.process.poll() is None

    def terminate(self) -> None:
        """SIGTERM: the first starts the worker's drain, a second cuts it short."""
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
                self.signals_sent += 1


def spawn_worker(settings: ServeSettings, address: str) -> LocalWorker:
    metrics_port = free_port()
    env = dict(os.environ)
    if settings.engine.device == "cpu" and "OMP_NUM_THREADS" not in env:
        # Workers sharing the CPU would otherwise each start one thread per core.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // settings.workers))
    command = worker_command(settings.engine, address, metrics_port, settings.drain_timeout)
    process = subprocess.Popen(
        command, env=env, start_new_session=True, preexec_fn=_exit_with_parent()
    )
    return LocalWorker(process, metrics_port)


def _exit_with_parent():
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


async def _serve(settings: ServeSettings, gs: GatewaySettings, workers: list[LocalWorker]) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        stop.set()
        for w in workers:
            w.terminate()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    gateway = Gateway(gs)
    await gateway.start()
    print(f"meridian serve: loading {settings.engine.model} in {len(workers)} worker(s)...")
    try:
        ready = asyncio.ensure_future(gateway.pool.wait_serving(len(workers)))
        failed = asyncio.ensure_future(_first_exit(workers))
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({ready, failed, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done():
            _print_ready(settings, gs, workers)
            await asyncio.wait({failed, stopped}, return_when=asyncio.FIRST_COMPLETED)
        for task in (ready, failed, stopped):
            task.cancel()
        if not stop.is_set():
            code = next(w.process.returncode for w in workers if not w.running())
            print(f"meridian serve: a worker exited (status {code}); stopping", file=sys.stderr)
            return code or 1
        return 0
    finally:
        await gateway.stop()


async def _first_exit(workers: list[LocalWorker]) -> None:
    while all(w.running() for w in workers):
        await asyncio.sleep(0.2)


def _print_ready(settings: ServeSettings, gs: GatewaySettings, workers: list[LocalWorker]) -> None:
    base = f"http://{gs.host}:{gs.http_port}"
    metrics = ", ".join(f"http://127.0.0.1:{w.metrics_port}/metrics" for w in workers)
    print(
        f"meridian serve: ready\n"
        f"  OpenAI API   {base}/v1  (model {settings.engine.model!r})\n"
        f"  gRPC         {gs.host}:{gs.grpc_port}  (meridian.v1.Inference)\n"
        f"  API docs     {base}/docs\n"
        f"  metrics      {base}/metrics (gateway), {metrics} (workers)\n"
        f"  try          curl {base}/v1/chat/completions -H 'Content-Type: application/json' "
        f"""-d '{{"model": "{settings.engine.model}", "messages": """
        f"""[{{"role": "user", "content": "What is the capital of France?"}}]}}'\n"""
        f"Press Ctrl-C to stop.",
        flush=True,
    )


def _stop_workers(workers: list[LocalWorker], timeout: float) -> None:
    """Wait for the workers' drain: SIGTERM any not yet told to stop, SIGKILL any that hang."""
    for w in workers:
        if not w.signals_sent:
            w.terminate()
    deadline = time.monotonic() + timeout
    for w in workers:
        try:
            w.process.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            w.process.kill()
            w.process.wait()
