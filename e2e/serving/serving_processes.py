"""Real `meridian worker` / `meridian gateway` / `meridian serve` processes for the e2e suite.

Every process listens on 127.0.0.1 on free ports, writes its output to a log file (shown when it
fails to start), runs in its own session, and is always stopped: SIGTERM first, SIGKILL to its
whole process group if it does not exit in time.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from meridian.net import free_port

MODEL = "smollm2-135m-instruct"
MAX_MODEL_LEN = 2048
# Small enough for several workers to share the machine; large enough for 64 concurrent requests.
WORKER_FLAGS = ["--kv-cache-memory", "256MiB", "--max-num-seqs", "32"]
WORKER_FLAGS += ["--max-model-len", str(MAX_MODEL_LEN)]
STARTUP_TIMEOUT = 300  # seconds; loading the model on a busy 2-core machine can take a minute


class Process:
    def __init__(self, name: str, argv: list[str], log_dir: Path, threads: int = 1):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        # One compute thread per worker: the workers share the machine's few cores.
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-P", "-m", "meridian.cli", *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return f"--- {self.name} log (last {lines} lines) ---\n" + "\n".join(text[-lines:])

    def wait_until(self, ready, what: str, timeout: float = STARTUP_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.alive(), (
                f"{self.name} exited ({self.popen.returncode}) before {what}\n{self.log()}"
            )
            if ready():
                return
            time.sleep(0.25)
        raise AssertionError(f"{self.name}: not {what} after {timeout:.0f} s\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.alive():
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        return self.popen.returncode


class Worker(Process):
    def __init__(self, name: str, log_dir: Path, extra: list[str] | None = None):
        self.port, self.metrics_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        argv = ["worker", "--host", "127.0.0.1", "--port", str(self.port)]
        argv += ["--metrics-port", str(self.metrics_port), *WORKER_FLAGS, *(extra or [])]
        super().__init__(name, argv, log_dir)

    def serving(self) -> bool:
        return grpc_serving(self.address)

    def metrics(self) -> dict:
        return scrape(f"http://127.0.0.1:{self.metrics_port}/metrics")


class Gateway(Process):
    def __init__(
        self, name: str, log_dir: Path, workers: list[str], extra: list[str] | None = None
    ):
        self.http_port, self.grpc_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        argv = ["gateway", "--host", "127.0.0.1", "--http-port", str(self.http_port)]
        argv += ["--grpc-port", str(self.grpc_port)]
        for address in workers:
            argv += ["--worker", address]
        super().__init__(name, argv + (extra or []), log_dir)

    def serving(self, workers: int) -> bool:
        try:
            r = httpx.get(f"{self.url}/health", timeout=2)
        except httpx.TransportError:
            return False
        return r.status_code == 200 and r.json()["workers_serving"] >= workers

    def metrics(self) -> dict:
        return scrape(f"{self.url}/metrics")


def grpc_serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=2
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def scrape(url: str) -> dict:
    """{(sample name, frozenset of label items): value} of a Prometheus endpoint."""
    text = httpx.get(url, timeout=5).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)
