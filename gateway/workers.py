"""The gateway's view of its upstreams: this region's replicas and peer regions' gateways.

Each has one gRPC channel, kept current by its LoadReport stream (reopened with backoff whenever it
breaks; one that cannot be reached is DOWN) and probed with gRPC health checks, whose round trips
make its RTT. One that fails a probe (stopped, hung, or a stalled engine) counts as DOWN until a
probe succeeds again, and the requests still waiting there for a first token (or reading a whole
answer) are told to go elsewhere (see `watch_down`). Membership follows discovery: an address that
disappears stops being routed to at once and its channel closes when its last request ends, so no
request in flight fails because of it. A peer that reports this gateway's own region (DNS lists
every gateway) is never routed to.
"""

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from meridian.api.v1 import pb, pb_grpc
from meridian.gateway.ejection import EjectionPolicy, Outlier, on_failure, on_success
from meridian.gateway.routing import DOWN, DRAINING, SERVING, STARTING, WorkerLoad
from meridian.limits import MAX_MESSAGE_BYTES
from meridian.metrics import LABELS
from meridian.worker.tokenizer import Tokenizer

log = logging.getLogger(__name__)

STATES = {
    pb.SERVING_STATE_STARTING: STARTING,
    pb.SERVING_STATE_SERVING: SERVING,
    pb.SERVING_STATE_DRAINING: DRAINING,
    pb.SERVING_STATE_FAILED: DOWN,
    pb.SERVING_STATE_STALLED: DOWN,
}
CHANNEL_OPTIONS = [
    # Notice an upstream that vanished without closing its connections within seconds.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # Reconnect soon after a worker restarts (gRPC's default backoff grows to 2 minutes).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    # A Tokenizer answer is a whole vocabulary (about 1.5 MB for a 49k-token one).
    ("grpc.max_receive_message_length", 32 * 2**20),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
MAX_BACKOFF = 2.0  # seconds between attempts to reopen a broken LoadReport stream
RTT_WEIGHT = 0.3  # EWMA weight of the newest probe
PROBE_TIMEOUT = 2.0  # seconds (or 4 RTTs if longer) a health probe may take


@dataclasses.dataclass
class Upstream:
    address: str
    peer: bool
    channel: grpc.aio.Channel
    stub: pb_grpc.InferenceStub
    load: WorkerLoad
    models: list = dataclasses.field(default_factory=list)  # pb.Model, fetched once SERVING
    in_flight: int = 0
    rtt: float | None = None
    outlier: Outlier = dataclasses.field(default_factory=Outlier)
    region: str = ""  # a peer's region as configured ("" when found by DNS)
    own_region: bool = False  # a "peer" that turned out to be a gateway of this region
    leaving: bool = False  # dropped by discovery: closes when its last request ends
    responsive: bool = True  # False from a failed health probe until one succeeds
    on_down: set = dataclasses.field(default_factory=set)  # callables, see watch_down
    tasks: list = dataclasses.field(default_factory=list)

    @property
    def state(self) -> str:
        """Its reported state, unless it stopped answering probes or is this region's own."""
        return DOWN if self.own_region or not self.responsive else self.load.state


class WorkerPool:
    def __init__(
        self,
        region: str,
        report_interval: float = 0.5,
        probe_interval: float = 1.0,
        ejection: EjectionPolicy | None = None,
    ):
        self.region = region
        self.report_interval, self.probe_interval = report_interval, probe_interval
        self.ejection = ejection or EjectionPolicy()
        self.upstreams: dict[str, Upstream] = {}
        self.ejections: collections.Counter = collections.Counter()  # (kind, region) -> count
        self._tokenizers: dict[str, Tokenizer] = {}
        self._fetching: set[str] = set()
        self._background: set[asyncio.Task] = set()
        self._changed = asyncio.Event()
        self._local_changed = asyncio.Event()

    @property
    def workers(self) -> dict[str, Upstream]:
        """This region's replicas (not leaving)."""
        return {a: u for a, u in self.upstreams.items() if not u.peer and not u.leaving}

    # ---- membership ----------------------------------------------------------------------------

    async def follow(self, addresses: AsyncIterator[frozenset[str]], peer: bool) -> None:
        """Keep the replicas (or peers) of one discovery source equal to its latest answer."""
        current: frozenset[str] = frozenset()
        async for latest in addresses:
            for address in latest - current:
                self.add(address, peer)
            for address in current - latest:
                self.remove(address)
            current = latest

    def add(self, address: str, peer: bool = False, region: str = "") -> None:
        """Route to `address` (a peer gateway when `peer`; `region` is what it was given as)."""
        u = self.upstreams.get(address)
        if u is not None:
            u.leaving = False
            return
        channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        load = WorkerLoad(address, state=DOWN, peer=peer, region=region)
        u = Upstream(address, peer, channel, pb_grpc.InferenceStub(channel), load, region=region)
        self.upstreams[address] = u
        u.tasks = [asyncio.create_task(self._watch(u)), asyncio.create_task(self._probe(u))]
        log.info("%s %s added", "peer" if peer else "worker", address)
        self._notify(u)

    def remove(self, address: str) -> None:
        u = self.upstreams.get(address)
        if u is None or u.leaving:
            return
        log.info("%s %s removed; draining %d request(s)", _kind(u), address, u.in_flight)
        u.leaving = True
        self._notify(u)
        if u.in_flight == 0:
            self._close(u)

    def _close(self, u: Upstream) -> None:
        del self.upstreams[u.address]
        for task in u.tasks:
            task.cancel()
        self._spawn(u.channel.close())

    async def close(self) -> None:
        tasks = [t for u in self.upstreams.values() for t in u.tasks] + list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(u.channel.close() for u in self.upstreams.values()))
        self.upstreams.clear()

    # ---- what routing reads --------------------------------------------------------------------

    def snapshot(self) -> list[WorkerLoad]:
        return [
            dataclasses.replace(
                u.load,
                in_flight=u.in_flight,
                rtt=u.rtt or 0.0,
                ejected_until=u.outlier.ejected_until,
                state=u.state,
            )
            for u in self.upstreams.values()
            if not u.leaving
        ]

    def stub(self, address: str) -> pb_grpc.InferenceStub:
        return self.upstreams[address].stub

    def is_peer(self, address: str) -> bool:
        return self.upstreams[address].peer

    def models(self, local_only: bool = False) -> list:
        """Every model some serving replica or peer region serves (pb.Model), one per name."""
        seen: dict[str, object] = {}
        for u in sorted(self.upstreams.values(), key=lambda u: u.peer):  # local entries first
            if u.peer and local_only:
                continue
            if u.state == SERVING and not u.leaving:
                for m in u.models:
                    seen.setdefault(m.id, m)
        return list(seen.values())

    def serving(self) -> int:
        """Local replicas that are SERVING."""
        return sum(u.state == SERVING for u in self.workers.values())

    def peers_serving(self) -> int:
        """Peer gateways whose regions have a SERVING replica."""
        return sum(u.peer and u.state == SERVING and not u.leaving for u in self.upstreams.values())

    def tokenizer(self, model: str) -> Tokenizer | None:
        """The model's tokenizer once fetched from an upstream that serves it (None until then)."""
        return self._tokenizers.get(model)

    async def changed(self) -> None:
        """Return at the next change of any upstream's load, state or membership."""
        await self._changed.wait()

    async def local_changed(self) -> None:
        """Return at the next change of a local replica's load, state or membership (what this
        region's report to its peers sums: peers' own reports must not echo back and forth)."""
        await self._local_changed.wait()

    async def wait_serving(self, count: int) -> None:
        """Return once at least `count` local replicas are SERVING."""
        while self.serving() < count:
            await self.changed()

    # ---- bookkeeping from the request path -----------------------------------------------------

    @contextlib.contextmanager
    def reserve(self, address: str) -> Iterator[None]:
        """Count a request against an upstream while it runs there."""
        u = self.upstreams[address]
        u.in_flight += 1
        try:
            yield
        finally:
            u.in_flight -= 1
            if u.leaving and u.in_flight == 0 and self.upstreams.get(address) is u:
                self._close(u)

    @contextlib.contextmanager
    def watch_down(self, address: str, callback) -> Iterator[None]:
        """Call `callback()` if the upstream goes down (stops responding, fails, is ejected) while
        the block runs: a request waiting there for its first token can still go elsewhere."""
        u = self.upstreams[address]
        u.on_down.add(callback)
        try:
            yield
        finally:
            u.on_down.discard(callback)

    def _went_down(self, u: Upstream) -> None:
        for callback in list(u.on_down):
            callback()

    def failed(self, address: str) -> None:
        """A call there failed in a way another upstream may not: count it toward ejection."""
        u = self.upstreams.get(address)
        if u is None:
            return
        before = u.outlier.ejections
        u.outlier = on_failure(u.outlier, time.monotonic(), self.ejection)
        if u.outlier.ejections > before:
            until = u.outlier.ejected_until - time.monotonic()
            log.warning("%s %s ejected for %.1f s", _kind(u), address, until)
            self.ejections[(_kind(u), u.load.region or self.region)] += 1
            self._notify(u)
            self._went_down(u)

    def succeeded(self, address: str) -> None:
        u = self.upstreams.get(address)
        if u is not None and u.outlier.failures:
            u.outlier = on_success(u.outlier, time.monotonic(), self.ejection)

    # ---- load reports and probes ---------------------------------------------------------------

    async def _watch(self, u: Upstream) -> None:
        backoff = 0.1
        request = pb.LoadReportRequest(
            interval_seconds=self.report_interval, include_prefix_cache=True
        )
        while True:
            try:
                async for report in u.stub.LoadReport(request):
                    await self._on_report(u, report)
                    backoff = 0.1
            except grpc.aio.AioRpcError as e:
                if u.load.state != DOWN:
                    log.warning("%s %s: load stream broke: %s", _kind(u), u.address, e.code().name)
            self._set(u, dataclasses.replace(u.load, state=DOWN))
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF)

    async def _on_report(self, u: Upstream, report) -> None:
        state = STATES.get(report.state, DOWN)
        if u.peer and report.region == self.region:
            if not u.own_region:
                log.info("peer %s is a gateway of this region; not routing to it", u.address)
            u.own_region = True
        if u.peer and u.region and report.region != u.region and u.load.region != report.region:
            log.warning(
                "peer %s was given as region %s but reports region %s; routing on what it reports",
                u.address,
                u.region,
                report.region,
            )
        if state == SERVING and not u.models:
            asked = pb.ModelsRequest(local_only=True)
            u.models = list((await u.stub.Models(asked, timeout=10)).models)
            for m in u.models:
                self._fetch_tokenizer(m.id, u)
        if state == SERVING and u.load.state == DOWN:
            u.outlier = Outlier()  # it came back (a restarted process): forgive its past
        hashes = u.load.prefix_hashes
        if report.HasField("prefix_cache"):
            hashes = frozenset(report.prefix_cache.block_hashes)
        load = WorkerLoad(
            address=u.address,
            model=report.model,
            state=state,
            running=report.running,
            waiting=report.waiting,
            max_num_seqs=report.max_num_seqs,
            kv_blocks_used=report.kv_blocks_used,
            kv_blocks_total=report.kv_blocks_total,
            block_size=report.block_size,
            tokens_per_second=report.generation_tokens_per_second,
            requests_per_second=report.requests_finished_per_second,
            prefix_hashes=hashes,
            reported_at=time.monotonic(),
            peer=u.peer,
            region=report.region if u.peer else "",
            models=frozenset(m.id for m in u.models) if u.peer else frozenset(),
            serving_replicas=report.serving_replicas,
        )
        self._set(u, load)

    def _set(self, u: Upstream, load: WorkerLoad) -> None:
        went_down = load.state == DOWN and u.load.state != DOWN
        if load.state != u.load.state:
            log.info("%s %s: %s -> %s", _kind(u), u.address, u.load.state, load.state)
            if load.state != SERVING:
                u.models = []  # refetched when it serves again (it may have been replaced)
        u.load = load
        self._notify(u)
        if went_down:
            self._went_down(u)

    async def _probe(self, u: Upstream) -> None:
        """Active health checks; their round trips are the upstream's RTT."""
        health = health_pb2_grpc.HealthStub(u.channel)
        check = health_pb2.HealthCheckRequest(service="")
        while True:
            start = time.monotonic()
            try:
                await health.Check(check, timeout=max(PROBE_TIMEOUT, 4 * (u.rtt or 0.0)))
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    self._unresponsive(u, e.code().name)
            else:
                rtt = time.monotonic() - start
                u.rtt = rtt if u.rtt is None else (1 - RTT_WEIGHT) * u.rtt + RTT_WEIGHT * rtt
                if not u.responsive:
                    log.info("%s %s answers probes again", _kind(u), u.address)
                    u.responsive, u.outlier = True, Outlier()
                    self._notify(u)
            await asyncio.sleep(self.probe_interval)

    def _unresponsive(self, u: Upstream, why: str) -> None:
        if not u.responsive:
            return
        if u.load.state == SERVING:
            log.warning(
                "%s %s failed a health probe (%s): not routing to it", _kind(u), u.address, why
            )
        u.responsive = False
        self._notify(u)
        self._went_down(u)

    def _fetch_tokenizer(self, model: str, u: Upstream) -> None:
        if model in self._tokenizers or model in self._fetching:
            return
        self._fetching.add(model)

        async def fetch() -> None:
            try:
                reply = await u.stub.Tokenizer(pb.TokenizerRequest(model=model), timeout=30)
                self._tokenizers[model] = await asyncio.to_thread(Tokenizer.from_pb, reply)
            except grpc.aio.AioRpcError as e:  # an older worker, or it went away: try the next
                log.info("no tokenizer for %s from %s: %s", model, u.address, e.code().name)
            finally:
                self._fetching.discard(model)

        self._spawn(fetch())

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _notify(self, u: Upstream) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
        if not u.peer:
            self._local_changed.set()
            self._local_changed = asyncio.Event()


def _kind(u: Upstream) -> str:
    return "peer" if u.peer else "replica"


class PoolCollector(Collector):
    """Workers by state, and each peer region's RTT and load as this gateway sees them."""

    def __init__(self, pool: WorkerPool):
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        workers = list(self.pool.workers.values())
        counts = collections.Counter((w.load.model, w.state) for w in workers)
        g = GaugeMetricFamily(
            "meridian_workers",
            "Workers by serving state, as this gateway sees them.",
            labels=(*LABELS, "state"),
        )
        for model in sorted({w.load.model for w in workers}):
            for state in (STARTING, SERVING, DRAINING, DOWN):
                g.add_metric([model, "gateway", state], counts[(model, state)])
        yield g
        yield from self._peers()

    def _peers(self) -> Iterator[Metric]:
        regions: dict[str, list[Upstream]] = collections.defaultdict(list)
        for u in self.pool.upstreams.values():
            if u.peer and u.load.region and not u.own_region and not u.leaving:
                regions[u.load.region].append(u)
        rtt = GaugeMetricFamily(
            "meridian_peer_rtt_seconds",
            "Round trip to a peer region's gateway (EWMA of health probes; the nearest of its "
            "gateways).",
            labels=("component", "region"),
        )
        requests = GaugeMetricFamily(
            "meridian_peer_requests",
            "A peer region's running and waiting requests, from its latest load report.",
            labels=("component", "region", "state"),
        )
        replicas = GaugeMetricFamily(
            "meridian_peer_serving_replicas",
            "A peer region's serving replicas, from its latest load report.",
            labels=("component", "region"),
        )
        for region, ups in sorted(regions.items()):
            measured = [u.rtt for u in ups if u.rtt is not None]
            if measured:
                rtt.add_metric(["gateway", region], min(measured))
            for state in ("running", "waiting"):
                total = sum(getattr(u.load, state) for u in ups if u.state == SERVING)
                requests.add_metric(["gateway", region, state], total)
            total = sum(u.load.serving_replicas for u in ups if u.state == SERVING)
            replicas.add_metric(["gateway", region], total)
        yield from (rtt, requests, replicas)
        ejections = CounterMetricFamily(
            "meridian_ejections",
            "Replicas (kind=replica) and peer gateways (kind=peer) taken out of routing after "
            "failed calls, by their region.",
            labels=("component", "kind", "region"),
        )
        for (kind, region), count in sorted(self.pool.ejections.items()):
            ejections.add_metric(["gateway", kind, region], count)
        yield ejections
