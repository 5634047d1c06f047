"""Three regions on loopback: real workers and gateways, toxiproxy between regions, dnsmasq for peers.

    region a: 2 workers   region b: 1 worker   region c: 1 worker   (4 workers: the test machines
    have 2 cores, so more would only slow every region down alike)

Links between regions are toxiproxy proxies, one per ordered pair (r -> s listens on a free port and
forwards to s's gateway gRPC port), with a fixed round trip added: a<->b 40 ms, a<->c 120 ms,
b<->c 100 ms. Each gateway finds its peers as DNS SRV records served by dnsmasq:
`_grpc._tcp.peers-<r>.geo.test` lists the proxies from r to the two other regions (their targets
have A records for 127.0.0.1); the peer's region comes from its own load report. Clients talk to
region a's gateway directly: the client is "at" a.

Workers are kept small (`--max-num-seqs 4`, 256 MiB of KV cache) so that modest load forms queues.
"""

import contextlib
import itertools
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

E2E = Path(__file__).resolve().parents[1]
for folder in (E2E, E2E / "serving"):  # dns_server.py; serving_processes.py
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from dns_server import Dnsmasq  # noqa: E402
from serving_processes import MAX_MODEL_LEN, Gateway, Process, Worker, value  # noqa: E402
from toxiproxy import Toxiproxy  # noqa: E402

from meridian.net import free_port  # noqa: E402

REGIONS = ("a", "b", "c")
WORKERS_PER_REGION = {"a": 2, "b": 1, "c": 1}
RTT_MS = {frozenset("ab"): 40, frozenset("ac"): 120, frozenset("bc"): 100}
DOMAIN = "geo.test"
MAX_NUM_SEQS = 4
WORKER_FLAGS = ["--max-num-seqs", str(MAX_NUM_SEQS), "--kv-cache-memory", "256MiB"]
WORKER_FLAGS += ["--max-model-len", str(MAX_MODEL_LEN), "--drain-timeout", "2"]
# Short drains keep teardown quick; the fleet's tests never stop a gateway under load on purpose.
GATEWAY_FLAGS = ["--drain-timeout", "2"]
READY_TIMEOUT = 90  # seconds for a gateway to see its workers serving and every peer region


def peers_name(region: str) -> str:
    return f"_grpc._tcp.peers-{region}.{DOMAIN}"


class GeoWorker(Worker):
    """A worker whose ports are chosen by the caller, so that it can be restarted on them."""

    def __init__(self, name: str, log_dir: Path, port: int, metrics_port: int):
        self.port, self.metrics_port = port, metrics_port
        self.address = f"127.0.0.1:{port}"
        argv = ["worker", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--metrics-port", str(metrics_port), *WORKER_FLAGS]
        Process.__init__(self, name, argv, log_dir)

    @classmethod
    def fresh(cls, name: str, log_dir: Path) -> "GeoWorker":
        return cls(name, log_dir, free_port(), free_port())

    def restarted(self, log_dir: Path) -> "GeoWorker":
        """A new process on the same ports (its log is a new file)."""
        return GeoWorker(f"{self.name}-restarted", log_dir, self.port, self.metrics_port)


class GeoGateway(Gateway):
    """A gateway of one region, on ports chosen by the caller (its peers' proxies point at them)."""

    def __init__(
        self,
        name: str,
        log_dir: Path,
        region: str,
        workers: list[str],
        flags: list[str],
        http_port: int | None = None,
        grpc_port: int | None = None,
    ):
        self.region = region
        self.http_port, self.grpc_port = http_port or free_port(), grpc_port or free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.local_workers = len(workers)
        argv = ["gateway", "--region", region, "--host", "127.0.0.1"]
        argv += ["--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port)]
        for address in workers:
            argv += ["--worker", address]
        Process.__init__(self, name, [*argv, *GATEWAY_FLAGS, *flags], log_dir)

    def sees(self, peer_regions: list[str]) -> bool:
        """Every local worker serving, and each peer region measured and serving."""
        if self.local_workers and not self.serving(self.local_workers):
            return False
        try:
            samples = self.metrics()
        except Exception:  # not listening yet
            return False
        return all(
            value(samples, "meridian_peer_serving_replicas", region=r) >= 1
            and any(
                n == "meridian_peer_rtt_seconds" and dict(ls).get("region") == r
                for n, ls in samples
            )
            for r in peer_regions
        )

    def wait_ready(self, peer_regions: list[str], timeout: float = READY_TIMEOUT) -> None:
        self.wait_until(lambda: self.sees(peer_regions), f"seeing peers {peer_regions}", timeout)


class Workers:
    """The fleet's workers by region, started once for the whole geo suite (loading the model takes
    most of a minute on 2 cores). A test that kills some restarts them with `restart`."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.by_region = {
            r: [GeoWorker.fresh(f"worker-{r}{i}", log_dir) for i in range(n)]
            for r, n in WORKERS_PER_REGION.items()
        }

    def __iter__(self) -> Iterator[GeoWorker]:
        return itertools.chain.from_iterable(self.by_region.values())

    def addresses(self, region: str) -> list[str]:
        return [w.address for w in self.by_region[region]]

    def wait_serving(self) -> None:
        for w in self:
            w.wait_until(w.serving, "serving")

    def kill(self, region: str) -> None:
        for w in self.by_region[region]:
            w.stop(signal.SIGKILL)

    def restart(self, region: str) -> None:
        """Start the region's stopped workers again on their ports (returns at once)."""
        self.by_region[region] = [
            w if w.alive() else w.restarted(self.log_dir) for w in self.by_region[region]
        ]

    def revive(self) -> None:
        """Restart any worker that died (a failed test may leave some) and wait until all serve."""
        for region in self.by_region:
            self.restart(region)
        self.wait_serving()

    def stop(self) -> None:
        for w in self:
            w.stop(timeout=10)


class Fleet:
    """Toxiproxy, dnsmasq and one gateway per region over `workers`; extra gateways on request."""

    def __init__(self, log_dir: Path, workers: Workers, gateway_flags: list[str]):
        self.log_dir, self.workers = log_dir, workers
        self.toxiproxy: Toxiproxy | None = None
        self.dns: Dnsmasq | None = None
        self.gateways: dict[str, GeoGateway] = {}
        self._extra: list[GeoGateway] = []
        try:
            self._start(gateway_flags)
        except BaseException:
            self.stop()
            raise

    def _start(self, gateway_flags: list[str]) -> None:
        self.toxiproxy = Toxiproxy(self.log_dir)
        grpc_ports = {r: free_port() for r in REGIONS}
        srv, hosts = {}, {}
        for source, dest in itertools.permutations(REGIONS, 2):
            listen = self.toxiproxy.proxy(
                f"{source}-to-{dest}",
                f"127.0.0.1:{grpc_ports[dest]}",
                RTT_MS[frozenset((source, dest))],
            )
            target = f"{dest}-from-{source}.{DOMAIN}"
            srv.setdefault(peers_name(source), []).append((target, int(listen.rpartition(":")[2])))
            hosts[target] = ["127.0.0.1"]
        self.dns = Dnsmasq(srv=srv, hosts=hosts, domain=DOMAIN)
        for r in REGIONS:
            flags = ["--peer-dns", peers_name(r), "--dns-server", self.dns.nameserver]
            self.gateways[r] = GeoGateway(
                f"gateway-{r}",
                self.log_dir,
                r,
                self.workers.addresses(r),
                [*flags, *gateway_flags],
                grpc_port=grpc_ports[r],
            )
        for r, g in self.gateways.items():
            g.wait_ready([p for p in REGIONS if p != r])

    @property
    def a(self) -> GeoGateway:
        """The gateway clients use."""
        return self.gateways["a"]

    @contextlib.contextmanager
    def gateway(
        self, name: str, region: str, workers: list[str], flags: list[str] | None = None
    ) -> Iterator[GeoGateway]:
        """An extra gateway (a baseline, or one with other flags) over some of the fleet's
        workers, without peers unless `flags` give some; stopped on leaving the block."""
        g = GeoGateway(name, self.log_dir, region, workers, flags or [])
        self._extra.append(g)
        try:
            g.wait_ready([])
            yield g
        finally:
            g.stop(timeout=10)

    def stop(self) -> None:
        for g in [*self._extra, *self.gateways.values()]:
            g.stop(timeout=10)
        if self.dns is not None:
            self.dns.stop()
        if self.toxiproxy is not None:
            self.toxiproxy.stop()

    def wait_idle(self, timeout: float = 120) -> None:
        """Until no worker runs or queues anything (a test's leftovers would skew the next)."""
        deadline = time.monotonic() + timeout
        while True:
            samples = {w.name: w.metrics() for w in self.workers}
            busy = [
                name
                for name, s in samples.items()
                if value(s, "meridian_num_requests_running")
                + value(s, "meridian_num_requests_waiting")
            ]
            if not busy:
                return
            assert time.monotonic() < deadline, f"still busy after {timeout:.0f} s: {busy}"
            time.sleep(0.2)
