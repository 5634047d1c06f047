"""`meridian.v1.Inference` on the gateway: Generate is routed like an HTTP request (and says where it
went in its metadata), Models lists what this region and its peers serve, Tokenizer relays a
replica's, and LoadReport sums this region's replicas (what a peer gateway routes on)."""

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from meridian import metrics
from meridian.api.v1 import pb, pb_grpc
from meridian.gateway.dispatch import Dispatcher
from meridian.gateway.errors import GatewayError
from meridian.gateway.routing import DRAINING, SERVING, STARTING, WorkerLoad
from meridian.gateway.streams import FINISH_REASONS, answer_headers
from meridian.gateway.workers import WorkerPool

DEFAULT_REPORT_INTERVAL = 0.5  # seconds
STATES = {SERVING: pb.SERVING_STATE_SERVING, STARTING: pb.SERVING_STATE_STARTING}
STATES[DRAINING] = pb.SERVING_STATE_DRAINING


class GatewayInference(pb_grpc.InferenceServicer):
    def __init__(
        self, dispatcher: Dispatcher, pool: WorkerPool, request_metrics: metrics.RequestMetrics
    ):
        self.dispatcher, self.pool, self.metrics = dispatcher, pool, request_metrics
        self.draining = False

    async def Generate(self, request, context) -> AsyncIterator:
        if not request.model and len(models := self.pool.models()) == 1:
            request.model = models[0].id
        request.request_id = request.request_id or uuid.uuid4().hex
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        credentials = dict(context.invocation_metadata() or ()).get("authorization")
        with self.metrics.start(request.model) as timer:
            reason = None
            try:
                stream = await self.dispatcher.open(request, deadline, credentials)
                await context.send_initial_metadata(tuple(answer_headers(stream).items()))
                async for r in stream:
                    timer.tokens(len(r.token_ids), r.usage.prompt_tokens)
                    reason = r.finish_reason or reason
                    yield r
                context.set_trailing_metadata(tuple(answer_headers(stream).items()))
                timer.outcome(metrics.OK, FINISH_REASONS.get(reason))
            except GatewayError as e:
                timer.outcome(e.metric_status, FINISH_REASONS.get(reason))
                region = ("x-meridian-region", self.dispatcher.region)
                context.set_trailing_metadata([*e.grpc_trailers(), region])
                await context.abort(e.grpc_code, e.message)

    async def Models(self, request, context):
        return pb.ModelsResponse(models=self.pool.models(request.local_only))

    async def Tokenizer(self, request, context):
        for address, w in self.pool.workers.items():
            if w.state == SERVING and (not request.model or w.load.model == request.model):
                with contextlib.suppress(grpc.aio.AioRpcError):
                    return await self.pool.stub(address).Tokenizer(request, timeout=30)
        await context.abort(
            grpc.StatusCode.UNAVAILABLE, f"no replica of {request.model!r} is serving here"
        )

    async def LoadReport(self, request, context) -> AsyncIterator:
        """The region's load at once, then whenever it changes (at most one report per local
        change) and at least every interval, so that a peer can tell a quiet region from a dead
        link."""
        interval = min(max(request.interval_seconds or DEFAULT_REPORT_INTERVAL, 0.05), 60.0)
        sent, sent_hashes, sent_at = None, None, -math.inf
        while not self.draining:  # ends the stream, so that a draining gateway can stop
            local = [w for w in self.pool.snapshot() if not w.peer]
            load = region_load(local, self.draining)
            load.region = self.pool.region
            hashes = sent_hashes
            if request.include_prefix_cache:
                hashes = frozenset().union(*(w.prefix_hashes for w in local))
            now = time.monotonic()
            if load != sent or hashes != sent_hashes or now - sent_at >= interval:
                sent, sent_at = pb.Load(), now
                sent.CopyFrom(load)
                if hashes != sent_hashes:
                    load.prefix_cache.block_hashes.extend(sorted(hashes))
                    sent_hashes = hashes
                yield load
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.pool.local_changed(), interval)


def region_load(workers: list[WorkerLoad], draining: bool = False):
    """The sum of the replicas' loads, as one report (pb.Load). Only replicas that are serving or
    finishing requests count; the state is the best of theirs."""
    live = [w for w in workers if w.state in (SERVING, DRAINING)]
    serving = sum(w.state == SERVING for w in workers)
    if draining:
        state = pb.SERVING_STATE_DRAINING
    elif serving:
        state = pb.SERVING_STATE_SERVING
    elif any(w.state == STARTING for w in workers):
        state = pb.SERVING_STATE_STARTING
    else:
        state = pb.SERVING_STATE_UNSPECIFIED
    return pb.Load(
        state=state,
        running=sum(w.running for w in live),
        waiting=sum(w.waiting for w in live),
        max_num_seqs=sum(w.max_num_seqs for w in workers if w.state == SERVING),
        kv_blocks_used=sum(w.kv_blocks_used for w in live),
        kv_blocks_total=sum(w.kv_blocks_total for w in live),
        block_size=max((w.block_size for w in live), default=0),
        generation_tokens_per_second=sum(w.tokens_per_second for w in live),
        requests_finished_per_second=sum(w.requests_per_second for w in live),
        serving_replicas=serving,
    )
