"""The gateway's own cost: latency of 1-token requests direct to a worker, through its region's
gateway, and through a second gateway that forwards to the first, same run.

One worker, gateway b (region b, that worker) and gateway a (region a, no workers of its own, peer
b) on 127.0.0.1, with the result cache and the worker's prefix cache off. Each round sends the
same new prompt (a gRPC Generate of one greedy token) down the three paths, one after the other in
a rotating order, so the three do the same work in the worker and a machine whose speed drifts
slows all three alike. The worker's own time (a model step: tens of milliseconds on a CPU) varies
far more than a gateway's cost, so what a gateway adds is measured per request: the client's total
time minus the upstream call's, which the gateway reports in the x-meridian-upstream-ms trailer.
For "local" that is gateway b's cost; for "peer hop", gateway a's, forwarding to b (whose own cost
is inside a's upstream call). The peer: a bare grpc.aio relay (bench/grpc_relay.py), measured the
same way, the least a Python gRPC proxy costs. Prints each path's p50/p99, the relay's cost and,
last, each gateway's cost and its ratio to the relay's.

    python -P bench/gateway_overhead.py [--requests 300] [--warmup 20]
"""

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from meridian.api.v1 import pb, pb_grpc
from meridian.net import free_port
from meridian.worker.loaders import DEFAULT_MODEL

STARTUP_TIMEOUT = 300  # seconds: the worker loads and warms up the model
RELAY = Path(__file__).with_name("grpc_relay.py")


def start(argv: list[str], log: Path) -> subprocess.Popen:
    """`meridian ARGV...`, or with a .py file first, that script."""
    # One compute thread for the worker: the gateways need the machine's other core.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-P",
        *(argv if argv[0].endswith(".py") else ["-m", "meridian.cli", *argv]),
    ]
    with open(log, "wb") as out:
        return subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


NO_METRICS = ["--metrics-port", "0"]


def gateway_argv(region: str, grpc_port: int, *upstreams: str) -> list[str]:
    # The result cache is off: every request here must reach a worker.
    argv = ["gateway", "--region", region, "--result-cache-size", "0", "--drain-timeout", "1"]
    return [*argv, "--http-port", str(free_port()), "--grpc-port", str(grpc_port), *upstreams]


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def generate(stub, model: str, prompt: str) -> tuple[float, float | None]:
    """Seconds for one whole 1-token Generate call, and the seconds its upstream call took as the
    gateway reports it (x-meridian-upstream-ms; None direct to the worker)."""
    request = pb.GenerateRequest(
        model=model, text=prompt, sampling=pb.SamplingParams(max_tokens=1, temperature=0)
    )
    start = time.perf_counter()
    call = stub.Generate(request, timeout=60)
    for _ in call:
        pass
    took = time.perf_counter() - start
    upstream = dict(call.trailing_metadata() or ()).get("x-meridian-upstream-ms")
    return took, float(upstream) / 1000 if upstream is not None else None


def wait_answering(stub, model: str, name: str, processes, logs: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while True:
        try:
            generate(stub, model, "Hello")
            return
        except grpc.RpcError as e:
            exited = any(process.poll() is not None for process in processes)
            if exited or time.monotonic() > deadline:
                raise SystemExit(f"{name} did not answer ({e.code().name}); logs in {logs}") from e
            time.sleep(0.5)


def percentile(samples: list[float], q: float) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[q - 1]


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--requests", type=int, default=300, help="measured requests per path")
    p.add_argument("--warmup", type=int, default=20, help="unmeasured requests per path first")
    args = p.parse_args()
    if args.requests < 2 or args.warmup < 0:
        p.error("--requests must be at least 2 and --warmup at least 0")

    logs = Path(tempfile.mkdtemp(prefix="meridian-gateway-overhead-"))
    ports = {name: free_port() for name in ("worker", "b", "a", "relay")}
    worker, b, a, relay = (f"127.0.0.1:{ports[name]}" for name in ("worker", "b", "a", "relay"))
    with contextlib.ExitStack() as stack:
        processes = [
            start(
                [
                    "worker",
                    "--model",
                    args.model,
                    "--port",
                    str(ports["worker"]),
                    "--no-prefix-caching",  # the same prompt costs the same on every path
                    *NO_METRICS,
                ],
                logs / "worker.log",
            ),
            start(gateway_argv("b", ports["b"], "--worker", worker), logs / "gateway-b.log"),
            start(gateway_argv("a", ports["a"], "--peer", f"b={b}"), logs / "gateway-a.log"),
            start([str(RELAY), str(ports["relay"]), worker], logs / "relay.log"),
        ]
        for process in processes:
            stack.callback(stop, process)
        paths = {}
        for name, address in (
            ("direct", worker),
            ("local", b),
            ("peer hop", a),
            ("relay", relay),
        ):
            channel = stack.enter_context(grpc.insecure_channel(address))
            paths[name] = pb_grpc.InferenceStub(channel)
            wait_answering(paths[name], args.model, name, processes, logs)
        print(
            f"{args.requests} measured 1-token requests per path ({args.warmup} warm-up), "
            f"model {args.model}; logs in {logs}",
            file=sys.stderr,
        )

        seconds: dict[str, list[float]] = {name: [] for name in paths}
        own: dict[str, list[float]] = {"local": [], "peer hop": [], "relay": []}  # own seconds
        names = list(paths)
        for i in range(args.warmup + args.requests):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                took, upstream = generate(paths[name], args.model, f"Request {i}: say one word")
                if i >= args.warmup:
                    seconds[name].append(took)
                    if upstream is not None:
                        own[name].append(took - upstream)

    ms = {name: [s * 1000 for s in samples] for name, samples in seconds.items()}
    labels = {
        "direct": "direct to the worker",
        "local": "through gateway b (local)",
        "peer hop": "through gateway a (peer hop to b)",
        "relay": "through a bare grpc.aio relay",
    }
    for name, label in labels.items():
        print(
            f"{label:<36} p50 {statistics.median(ms[name]):7.2f} ms  "
            f"p99 {percentile(ms[name], 99):7.2f} ms"
        )
    # The worker's time swings by tens of ms between identical requests, which would drown a
    # gateway's cost in a difference of paths; each gateway's own time is measured per request
    # instead: the client's total minus the upstream call the gateway timed.
    added = {name: [s * 1000 for s in samples] for name, samples in own.items()}
    relay = added.pop("relay")
    print(
        f"a bare grpc.aio relay (the floor of a Python gRPC proxy) adds p50/p99: "
        f"{statistics.median(relay):.2f}/{percentile(relay, 99):.2f} ms"
    )
    print(
        "gateway added latency p50/p99: "
        + ", ".join(
            f"{statistics.median(d):.2f}/{percentile(d, 99):.2f} ms ({name})"
            for name, d in added.items()
        )
        + f"; p50 over the relay's: {statistics.median(added['local']) / statistics.median(relay):.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
