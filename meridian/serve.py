"""`meridian serve`: a whole local deployment in one command: N worker processes and a gateway, or
with `--regions`, one gateway and N workers per region with the gateways peered (geo routing on one
machine: each region's gateway serves its own workers and spills or fails over to the others).

The workers are `meridian worker` subprocesses on free localhost ports; the gateways run in this
process. The first region's gateway listens on --port and --grpc-port, the next ones on the ports
after them. Workers get their own sessions, so Ctrl-C reaches only this process, which then drains
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
    workers: int = 1  # per region
    regions: tuple[str, ...] = ()  # empty: one gateway, region "default"
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50051
    drain_timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise UserError(f"--workers must be at least 1, got {self.workers}")
        if self.drain_timeout < 0:
            raise UserError("--drain-timeout must be >= 0 seconds")
        if len(set(self.regions)) != len(self.regions):
            raise UserError(f"--regions names a region twice: {','.join(self.regions)}")

    def gateways(self) -> list[GatewaySettings]:
        """One gateway per region, each with its own workers on free ports and the others as
        peers."""
        regions = self.regions or ("default",)
        grpc_ports = [self.grpc_port + i for i, _ in enumerate(regions)]
        gateways = []
        for i, region in enumerate(regions):
            peers = tuple(
                f"{other}=127.0.0.1:{port}"
                for other, port in zip(regions, grpc_ports, strict=True)
                if other != region
            )
            gateways.append(
                GatewaySettings(
                    region=region,
                    workers=tuple(f"127.0.0.1:{free_port()}" for _ in range(self.workers)),
                    peers=peers,
                    host=self.host,
                    http_port=self.port + i,
                    grpc_port=grpc_ports[i],
                    drain_timeout=self.drain_timeout,
                )
            )
        return gateways


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = ServeSettings(EngineSettings())
    parser.add_argument(
        "--workers", type=int, default=d.workers, help="worker processes (per region) (1)"
    )
    parser.add_argument(
        "--regions",
        type=lambda v: tuple(r.strip() for r in v.split(",") if r.strip()),
        default=d.regions,
        metavar="REGION,REGION,...",
        help="one gateway per region, peered, each with its own workers (default: one gateway)",
    )
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
        regions=args.regions,
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        drain_timeout=args.drain_timeout,
    )
    resolve(settings.engine.model)  # a missing model fails here, not in N workers
    gateways = settings.gateways()
    addresses = [address for g in gateways for address in g.workers]
    # Spawned before asyncio and gRPC start any thread, which keeps preexec_fn safe.
    workers = [spawn_worker(settings, address, len(addresses)) for address in addresses]
    try:
        return asyncio.run(_serve(settings, gateways, workers))
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


def spawn_worker(settings: ServeSettings, address: str, count: int) -> LocalWorker:
    metrics_port = free_port()
    env = dict(os.environ)
    if settings.engine.device == "cpu" and "OMP_NUM_THREADS" not in env:
        # `count` workers sharing the CPU would otherwise each start one thread per core.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // count))
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


async def _serve(
    settings: ServeSettings, gateway_settings: list[GatewaySettings], workers: list[LocalWorker]
) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        stop.set()
        for w in workers:
            w.terminate()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    gateways = [Gateway(gs) for gs in gateway_settings]
    for gateway in gateways:
        await gateway.start()
    print(f"meridian serve: loading {settings.engine.model} in {len(workers)} worker(s)...")
    try:
        ready = asyncio.ensure_future(
            asyncio.gather(*(g.pool.wait_serving(len(g.settings.workers)) for g in gateways))
        )
        failed = asyncio.ensure_future(_first_exit(workers))
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({ready, failed, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done():
            _print_ready(settings, gateway_settings, workers)
            await asyncio.wait({failed, stopped}, return_when=asyncio.FIRST_COMPLETED)
        for task in (ready, failed, stopped):
            task.cancel()
        if not stop.is_set():
            code = next(w.process.returncode for w in workers if not w.running())
            print(f"meridian serve: a worker exited (status {code}); stopping", file=sys.stderr)
            return code or 1
        return 0
    finally:
        await asyncio.gather(*(g.stop() for g in gateways))


async def _first_exit(workers: list[LocalWorker]) -> None:
    while all(w.running() for w in workers):
        await asyncio.sleep(0.2)


def _print_ready(
    settings: ServeSettings, gateways: list[GatewaySettings], workers: list[LocalWorker]
) -> None:
    first = gateways[0]
    base = f"http://{first.host}:{first.http_port}"
    metrics = ", ".join(f"http://127.0.0.1:{w.metrics_port}/metrics" for w in workers)
    lines = ["meridian serve: ready"]
    for g in gateways:
        url = f"http://{g.host}:{g.http_port}"
        where = f"region {g.region}: " if settings.regions else ""
        lines.append(f"  OpenAI API   {where}{url}/v1  (model {settings.engine.model!r})")
        lines.append(f"  gRPC         {where}{g.host}:{g.grpc_port}  (meridian.v1.Inference)")
    lines += [
        f"  API docs     {base}/docs",
        f"  metrics      {base}/metrics (gateway), {metrics} (workers)",
        f"  try          curl -i {base}/v1/chat/completions -H 'Content-Type: application/json' "
        f"""-d '{{"model": "{settings.engine.model}", "messages": """
        f"""[{{"role": "user", "content": "What is the capital of France?"}}]}}'""",
    ]
    if settings.regions:
        lines.append("  (x-meridian-region / -route headers say which region answered and why)")
    lines.append("Press Ctrl-C to stop.")
    print("\n".join(lines), flush=True)


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
