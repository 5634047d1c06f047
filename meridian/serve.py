"""`meridian serve`: a whole local deployment in one command: N worker processes and a gateway, or
with `--regions`, one gateway and N workers per region with the gateways peered (geo routing on one
machine: each region's gateway serves its own workers and spills or fails over to the others).

The workers are `meridian worker` subprocesses on free localhost ports; the gateways run in this
process. The first region's gateway listens on --port and --grpc-port, the next ones on the ports
after them. Workers get their own sessions, so Ctrl-C reaches only this process, which then drains
everything in order: the gateway stops accepting, each worker gets one SIGTERM and finishes what it
is running, and the command exits 0. A second Ctrl-C cuts the drain short. On Linux the workers are
also told to exit if this process dies without cleaning up (PR_SET_PDEATHSIG).

A worker that exits once the deployment is ready is started again on the same address and metrics
port, so its gateway reconnects to it by itself; the wait before each restart doubles from 0.5 s
to 8 s while the worker keeps dying within a minute of its start. A worker that dies more than 5
times in a row that soon, or any worker that exits while the deployment is still loading (a wrong
flag, too little memory), stops everything: the command exits 1 and says which worker and how.
"""

import argparse
import asyncio
import contextlib
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

# Run as `python -S -P -c EXEC_WITH_PARENT_DEATH_SIGNAL PARENT_PID ARGV...`: the worker is asked to
# get SIGTERM when this process dies, then becomes ARGV. (-P: the current folder, which may be this
# repository's root, must not shadow the standard library's `operator` with ours.) preexec_fn would
# do it without the extra interpreter, but is unsafe once threads run, and restarts happen while gRPC
# and asyncio run them.
EXEC_WITH_PARENT_DEATH_SIGNAL = """
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
except AttributeError:  # not Linux
    pass
if os.getppid() != int(sys.argv[1]):  # the parent died before prctl took effect
    sys.exit(1)
os.execv(sys.argv[2], sys.argv[2:])
"""


@dataclass(frozen=True)
class RestartPolicy:
    """When to start an exited worker again: soon after a long life, later and later while it keeps
    dying young, never after more than `max_restarts` young deaths in a row."""

    max_restarts: int = 5
    young: float = 60.0  # seconds: a run shorter than this counts toward giving up
    first_backoff: float = 0.5  # seconds before the first restart; doubles with each young death
    max_backoff: float = 8.0

    def __post_init__(self) -> None:
        if (
            self.max_restarts < 0
            or self.young < 0
            or not 0 <= self.first_backoff <= self.max_backoff
        ):
            raise ValueError(f"invalid restart policy {self}")

    def young_deaths(self, before: int, lived: float) -> int:
        """Young deaths in a row, counting a run that lasted `lived` seconds after `before`."""
        return before + 1 if lived < self.young else 0

    def delay(self, young_deaths: int) -> float | None:
        """Seconds to wait before the restart, or None to give up."""
        if young_deaths > self.max_restarts:
            return None
        return min(self.first_backoff * 2 ** max(young_deaths - 1, 0), self.max_backoff)


RESTART = RestartPolicy()


@dataclass(frozen=True)
class ServeSettings:
    engine: EngineSettings
    workers: int = 1  # per region
    regions: tuple[str, ...] = ()  # empty: one gateway, region "default"
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50051
    drain_timeout: float = 30.0
    request_timeout: float = GatewaySettings.request_timeout
    first_token_timeout: float = GatewaySettings.first_token_timeout

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise UserError(f"--workers must be at least 1, got {self.workers}")
        if self.drain_timeout < 0:
            raise UserError("--drain-timeout must be >= 0 seconds")
        if self.request_timeout <= 0 or self.first_token_timeout <= 0:
            raise UserError("--request-timeout and --first-token-timeout must be > 0 seconds")
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
                    request_timeout=self.request_timeout,
                    first_token_timeout=self.first_token_timeout,
                )
            )
        return gateways


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = ServeSettings(EngineSettings())
    parser.epilog = (
        "A worker that exits after the deployment is ready is started again on the same "
        f"address: after {RESTART.first_backoff:g} s, then longer (up to {RESTART.max_backoff:g} "
        f"s) while it keeps dying within {RESTART.young:g} s of starting. One that does so more "
        f"than {RESTART.max_restarts} times in a row, or any worker that exits while loading, "
        "stops everything: the command exits 1."
    )
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
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=d.request_timeout,
        metavar="SECONDS",
        help=f"deadline of every request to a worker (default {d.request_timeout:g})",
    )
    parser.add_argument(
        "--first-token-timeout",
        type=float,
        default=d.first_token_timeout,
        metavar="SECONDS",
        help="seconds a worker may take to a first token before the request goes to another "
        f"(default {d.first_token_timeout:g})",
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
        request_timeout=args.request_timeout,
        first_token_timeout=args.first_token_timeout,
    )
    resolve(settings.engine.model)  # a missing model fails here, not in N workers
    gateways = settings.gateways()
    addresses = [address for g in gateways for address in g.workers]
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
    """One worker's command and its current process; `restart` runs the same command again (same
    address, same metrics port)."""

    address: str  # its gRPC HOST:PORT, as its gateway knows it
    command: list[str]
    env: dict[str, str]
    metrics_port: int
    process: subprocess.Popen | None = None
    started: float = 0.0  # monotonic
    signals_sent: int = 0
    restarts: int = 0
    young_deaths: int = 0  # in a row (RestartPolicy)

    def start(self) -> None:
        launcher = [sys.executable, "-S", "-P", "-c", EXEC_WITH_PARENT_DEATH_SIGNAL]
        launcher.append(str(os.getpid()))
        self.process = subprocess.Popen(
            [*launcher, *self.command], env=self.env, start_new_session=True
        )
        self.started = time.monotonic()
        self.signals_sent = 0

    def restart(self) -> None:
        self.restarts += 1
        self.start()

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

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
    worker = LocalWorker(address, command, env, metrics_port)
    worker.start()
    return worker


async def keep_running(
    worker: LocalWorker,
    policy: RestartPolicy,
    ready: asyncio.Event,
    stopping: asyncio.Event,
    poll: float = 0.2,
) -> str | None:
    """Restart `worker` whenever it exits, as `policy` says. Returns why everything must stop (it
    exited while loading, or kept dying), or None once `stopping` is set."""
    while True:
        while worker.running() and not stopping.is_set():
            await asyncio.sleep(poll)
        if stopping.is_set():
            return None
        code = worker.process.returncode
        if not ready.is_set():
            return f"worker {worker.address} exited (status {code}) while loading; stopping"
        lived = time.monotonic() - worker.started
        worker.young_deaths = policy.young_deaths(worker.young_deaths, lived)
        delay = policy.delay(worker.young_deaths)
        if delay is None:
            return (
                f"worker {worker.address} exited (status {code}) {worker.young_deaths} times in a "
                f"row within {policy.young:g} s of starting; giving up and stopping"
            )
        print(
            f"meridian serve: worker {worker.address} exited (status {code}) after {lived:.0f} s; "
            f"restarting it in {delay:g} s",
            file=sys.stderr,
            flush=True,
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), delay)
        if stopping.is_set():
            return None
        worker.restart()


async def _serve(
    settings: ServeSettings, gateway_settings: list[GatewaySettings], workers: list[LocalWorker]
) -> int:
    stop, ready = asyncio.Event(), asyncio.Event()
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
    supervisors = [asyncio.ensure_future(keep_running(w, RESTART, ready, stop)) for w in workers]
    gave_up = asyncio.ensure_future(_first_result(supervisors))
    loaded = asyncio.ensure_future(
        asyncio.gather(*(g.pool.wait_serving(len(g.settings.workers)) for g in gateways))
    )
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({loaded, gave_up, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if loaded.done() and not gave_up.done():
            ready.set()
            _print_ready(settings, gateway_settings, workers)
            await asyncio.wait({gave_up, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if gave_up.done() and gave_up.result() is not None:
            print(f"meridian serve: {gave_up.result()}", file=sys.stderr, flush=True)
            return 1
        return 0
    finally:
        stop.set()  # the supervisors restart nothing from here on
        for task in (loaded, gave_up, stopped, *supervisors):
            task.cancel()
        await asyncio.gather(loaded, gave_up, stopped, *supervisors, return_exceptions=True)
        await asyncio.gather(*(g.stop() for g in gateways))


async def _first_result(tasks: list[asyncio.Future]) -> str | None:
    """The first reason to stop that a worker's supervisor returns (None: they all ended)."""
    for done in asyncio.as_completed(tasks):
        reason = await done
        if reason is not None:
            return reason
    return None


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
