"""One `meridian serve` with two workers, small enough to abuse on two cores, and what the chaos
tests read from it: its workers (pid, gRPC address, metrics port, from /proc), its health and its
gauges (requests in flight in the gateway and in each worker, each worker's running and waiting
requests and KV blocks in use).

The context is short (64 tokens), so no valid request generates for long; the request and
first-token timeouts are short, so a stuck worker costs seconds, not minutes.
"""

import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

E2E = Path(__file__).resolve().parents[1]
if str(E2E / "serving") not in sys.path:
    sys.path.insert(0, str(E2E / "serving"))

from serving_processes import MODEL, Process, free_port, grpc_serving, value  # noqa: E402

__all__ = ["MODEL", "Serve", "WorkerProcess", "grpc_serving", "value"]

MAX_MODEL_LEN = 64
REQUEST_TIMEOUT = 20.0  # seconds: serve --request-timeout, every request's deadline
FIRST_TOKEN_TIMEOUT = 10.0  # seconds: serve --first-token-timeout
MAX_NUM_SEQS = 8
SERVE_FLAGS = ["--workers", "2", "--max-model-len", str(MAX_MODEL_LEN)]
SERVE_FLAGS += ["--kv-cache-memory", "32MiB", "--max-num-seqs", str(MAX_NUM_SEQS)]
SERVE_FLAGS += ["--request-timeout", str(REQUEST_TIMEOUT)]
SERVE_FLAGS += ["--first-token-timeout", str(FIRST_TOKEN_TIMEOUT), "--drain-timeout", "5"]
SCRAPE_TIMEOUT = 2.0  # seconds; a stopped worker never answers


@dataclass(frozen=True)
class WorkerProcess:
    pid: int
    address: str  # 127.0.0.1:PORT, as the gateway names it (x-meridian-replica)
    metrics_port: int

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def metrics(self) -> dict:
        return scrape(f"http://127.0.0.1:{self.metrics_port}/metrics")


class Serve(Process):
    def __init__(self, name: str, log_dir: Path, extra: list[str] | None = None):
        self.port, self.grpc_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = ["serve", "--port", str(self.port), "--grpc-port", str(self.grpc_port)]
        # One compute thread per worker (inherited from this OMP_NUM_THREADS).
        super().__init__(name, argv + SERVE_FLAGS + (extra or []), log_dir, threads=1)

    def ready(self) -> bool:
        return "meridian serve: ready" in self.log_path.read_text(errors="replace")

    def workers(self) -> list[WorkerProcess]:
        """The worker processes running now (a restarted one has a new pid, same address)."""
        found = []
        for pid in _children(self.pid):
            argv = _cmdline(pid)
            if "worker" not in argv or "--metrics-port" not in argv:
                continue  # still in the launcher that becomes the worker
            port = argv[argv.index("--port") + 1]
            metrics_port = int(argv[argv.index("--metrics-port") + 1])
            found.append(WorkerProcess(pid, f"127.0.0.1:{port}", metrics_port))
        return sorted(found, key=lambda w: w.address)

    def worker(self, address: str) -> WorkerProcess | None:
        return next((w for w in self.workers() if w.address == address), None)

    def health(self) -> dict:
        try:
            return httpx.get(f"{self.url}/health", timeout=SCRAPE_TIMEOUT).json()
        except (httpx.TransportError, ValueError):
            return {}

    def serving(self) -> int:
        """Workers the gateway routes to (its /health)."""
        return self.health().get("workers_serving", 0)

    def metrics(self) -> dict:
        return scrape(f"{self.url}/metrics")

    def gauges(self) -> dict[str, float]:
        """What must be 0 when no request is open: requests in flight in the gateway and in each
        worker, each worker's running and waiting requests and KV-cache use (0 to 1)."""
        found = {"gateway in flight": value(self.metrics(), "meridian_requests_in_flight")}
        for w in self.workers():
            m = w.metrics()
            found[f"worker {w.address} in flight"] = value(m, "meridian_requests_in_flight")
            found[f"worker {w.address} running"] = value(m, "meridian_num_requests_running")
            found[f"worker {w.address} waiting"] = value(m, "meridian_num_requests_waiting")
            found[f"worker {w.address} KV use"] = value(m, "meridian_kv_cache_usage_perc")
        return found

    def wait_quiet(self, timeout: float) -> dict[str, float]:
        """Wait until every gauge is 0; fail with the last values if that takes over `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            gauges = self.gauges()
            if not any(gauges.values()):
                return gauges
            if time.monotonic() > deadline:
                busy = {k: v for k, v in gauges.items() if v}
                raise AssertionError(
                    f"gauges not back to 0 {timeout:g} s after the last request: {busy}"
                )
            time.sleep(0.1)

    def wait_healthy(self, workers: int = 2, timeout: float = 180) -> list[WorkerProcess]:
        """Both workers serving and routed to, nothing in flight: each test starts from here."""
        self.wait_until(
            lambda: self.serving() == workers and len(self.workers()) == workers,
            f"routing to {workers} workers",
            timeout,
        )
        self.wait_quiet(30)
        return self.workers()


def scrape(url: str) -> dict:
    """{(sample name, frozenset of label items): value}; a stopped process fails in seconds."""
    text = httpx.get(url, timeout=SCRAPE_TIMEOUT).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except (FileNotFoundError, ProcessLookupError):
        return []


def resume_all(serve: Serve) -> None:
    """SIGCONT every worker (after a test that stopped one, whatever became of it)."""
    for w in serve.workers():
        with contextlib.suppress(ProcessLookupError):
            w.signal(signal.SIGCONT)
