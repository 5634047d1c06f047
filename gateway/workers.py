"""The gateway's view of its workers: one gRPC channel each, kept current by the worker's LoadReport
stream, which is reopened with backoff whenever it breaks (a worker that cannot be reached is DOWN).
"""

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator

import grpc
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from meridian.api.v1 import pb, pb_grpc
from meridian.gateway.routing import DOWN, DRAINING, SERVING, STARTING, WorkerLoad
from meridian.metrics import LABELS

log = logging.getLogger(__name__)

STATES = {
    pb.SERVING_STATE_STARTING: STARTING,
    pb.SERVING_STATE_SERVING: SERVING,
    pb.SERVING_STATE_DRAINING: DRAINING,
    pb.SERVING_STATE_FAILED: DOWN,
}
CHANNEL_OPTIONS = [
    # Notice a worker that vanished without closing its connections within seconds.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # Reconnect soon after a worker restarts (gRPC's default backoff grows to 2 minutes).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
MAX_BACKOFF = 2.0  # seconds between attempts to reopen a broken LoadReport stream


@dataclasses.dataclass
class Worker:
    address: str
    channel: grpc.aio.Channel
    stub: pb_grpc.InferenceStub
    load: WorkerLoad
    models: list = dataclasses.field(default_factory=list)  # pb.Model, fetched once SERVING
    in_flight: int = 0


class WorkerPool:
    def __init__(self, addresses: tuple[str, ...], report_interval: float = 0.5):
        self.report_interval = report_interval
        self.workers: dict[str, Worker] = {}
        for address in addresses:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self.workers[address] = Worker(
                address, channel, pb_grpc.InferenceStub(channel), WorkerLoad(address, state=DOWN)
            )
        self._tasks: list[asyncio.Task] = []
        self._changed = asyncio.Event()

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._watch(w)) for w in self.workers.values()]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(w.channel.close() for w in self.workers.values()))

    # ---- what routing reads --------------------------------------------------------------------

    def snapshot(self) -> list[WorkerLoad]:
        return [dataclasses.replace(w.load, in_flight=w.in_flight) for w in self.workers.values()]

    def stub(self, address: str) -> pb_grpc.InferenceStub:
        return self.workers[address].stub

    def models(self) -> list:
        """Every model some SERVING worker serves (pb.Model), one entry per name."""
        seen: dict[str, object] = {}
        for w in self.workers.values():
            if w.load.state == SERVING:
                for m in w.models:
                    seen.setdefault(m.id, m)
        return list(seen.values())

    def serving(self) -> int:
        return sum(w.load.state == SERVING for w in self.workers.values())

    async def changed(self) -> None:
        """Return at the next change of any worker's load or state."""
        await self._changed.wait()

    async def wait_serving(self, count: int) -> None:
        """Return once at least `count` workers are SERVING."""
        while self.serving() < count:
            await self.changed()

    # ---- bookkeeping from the request path -----------------------------------------------------

    @contextlib.contextmanager
    def reserve(self, address: str) -> Iterator[None]:
        """Count a request against a worker while it runs there."""
        worker = self.workers[address]
        worker.in_flight += 1
        try:
            yield
        finally:
            worker.in_flight -= 1

    def mark_unavailable(self, address: str) -> None:
        """A call just failed as UNAVAILABLE: stop routing there until its next report says
        otherwise (a draining worker's next report says DRAINING)."""
        worker = self.workers[address]
        if worker.load.state == SERVING:
            self._set(worker, dataclasses.replace(worker.load, state=DOWN))

    # ---- load reports --------------------------------------------------------------------------

    async def _watch(self, worker: Worker) -> None:
        backoff = 0.1
        request = pb.LoadReportRequest(
            interval_seconds=self.report_interval, include_prefix_cache=True
        )
        while True:
            try:
                async for report in worker.stub.LoadReport(request):
                    await self._on_report(worker, report)
                    backoff = 0.1
            except grpc.aio.AioRpcError as e:
                if worker.load.state != DOWN:
                    log.warning("worker %s: load stream broke: %s", worker.address, e.code().name)
            self._set(worker, dataclasses.replace(worker.load, state=DOWN))
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF)

    async def _on_report(self, worker: Worker, report) -> None:
        state = STATES.get(report.state, DOWN)
        if state == SERVING and not worker.models:
            worker.models = list((await worker.stub.Models(pb.ModelsRequest(), timeout=10)).models)
        hashes = worker.load.prefix_hashes
        if report.HasField("prefix_cache"):
            hashes = frozenset(report.prefix_cache.block_hashes)
        self._set(
            worker,
            WorkerLoad(
                address=worker.address,
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
            ),
        )

    def _set(self, worker: Worker, load: WorkerLoad) -> None:
        if load.state != worker.load.state:
            log.info("worker %s: %s -> %s", worker.address, worker.load.state, load.state)
            if load.state != SERVING:
                worker.models = []  # refetched when it serves again (it may have been replaced)
        worker.load = load
        self._changed.set()
        self._changed = asyncio.Event()


class PoolCollector(Collector):
    """meridian_workers{state}: how many workers the gateway sees in each state."""

    def __init__(self, pool: WorkerPool):
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        counts = collections.Counter(
            (w.load.model, w.load.state) for w in self.pool.workers.values()
        )
        g = GaugeMetricFamily(
            "meridian_workers",
            "Workers by serving state, as this gateway sees them.",
            labels=(*LABELS, "state"),
        )
        models = {w.load.model for w in self.pool.workers.values()}
        for model in sorted(models):
            for state in (STARTING, SERVING, DRAINING, DOWN):
                g.add_metric([model, "gateway", state], counts[(model, state)])
        yield g
