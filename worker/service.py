"""`meridian.v1.Inference` on a worker: the engine behind gRPC.

Generate turns a request into prompt token ids and SamplingParams, streams the engine's deltas back,
and aborts the request in the engine when the caller cancels (the handler's task is cancelled, which
closes the engine's iterator). LoadReport publishes what a gateway needs to route: serving state,
queue depth, KV-cache use, drain rate and the prefix cache's block hashes.
"""

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator

import grpc
from prometheus_client import Histogram

from meridian import metrics
from meridian.api.v1 import pb, pb_grpc
from meridian.errors import UserError
from meridian.worker.engine.async_engine import AsyncEngine, EngineDeadError
from meridian.worker.engine.llm_engine import RequestOutput
from meridian.worker.sampling_params import SamplingParams
from meridian.worker.tokenizer import prompt_token_ids

log = logging.getLogger(__name__)

FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
DEFAULT_REPORT_INTERVAL = 0.5  # seconds


class RateWindow:
    """Rate of a growing count over the last `window` seconds (plain values, no clock of its own)."""

    def __init__(self, window: float = 5.0):
        self.window = window
        self.samples: deque[tuple[float, float]] = deque()

    def add(self, now: float, count: float) -> None:
        self.samples.append((now, count))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window:
            self.samples.popleft()

    def rate(self) -> float:
        if len(self.samples) < 2:
            return 0.0
        (t0, c0), (t1, c1) = self.samples[0], self.samples[-1]
        return (c1 - c0) / (t1 - t0) if t1 > t0 else 0.0


class InferenceService(pb_grpc.InferenceServicer):
    def __init__(
        self,
        model_name: str,
        request_metrics: metrics.RequestMetrics,
        queue_time: Histogram,
    ):
        self.model_name = model_name
        self.engine: AsyncEngine | None = None  # set once the model is loaded
        self.created = int(time.time())
        self.state = pb.SERVING_STATE_STARTING
        self.metrics = request_metrics
        self.queue_time = queue_time
        self.live: set[str] = set()  # engine request ids of in-flight Generate calls
        self.finished = 0
        self._changed = asyncio.Event()
        self._tokens_rate = RateWindow()
        self._finished_rate = RateWindow()

    # ---- state ---------------------------------------------------------------------------------

    def set_state(self, state: int) -> None:
        self.state = state
        self._changed.set()  # wakes every LoadReport stream to send the change at once
        self._changed = asyncio.Event()

    # ---- Generate ------------------------------------------------------------------------------

    async def Generate(self, request, context) -> AsyncIterator:
        timer = self.metrics.start(self.model_name)
        status, reason, engine_id = metrics.CANCELLED, None, None
        try:
            engine, ids, params = self._prepare(request)
            request_id = request.request_id or uuid.uuid4().hex
            engine_id = f"{request_id}-{uuid.uuid4().hex[:8]}"  # callers' ids need not be unique
            self.live.add(engine_id)
            stream = engine.generate(engine_id, ids, params, request.priority)
            async with contextlib.aclosing(stream):
                async for out in stream:
                    if timer.last_token is None and out.queue_time is not None:
                        self.queue_time.labels(*timer.labels).observe(out.queue_time)
                    timer.tokens(len(out.token_ids), out.prompt_tokens)
                    reason = out.finish_reason
                    yield self._response(request_id, out, engine)
            status = metrics.OK
        except UserError as e:  # ours (Rejection) or the engine's checks, before anything is queued
            rejection = e if isinstance(e, Rejection) else Rejection.invalid(e)
            status = rejection.status
            await rejection.abort(context)
        except EngineDeadError as e:  # UNAVAILABLE: another worker can still serve the request
            status = metrics.ERROR
            await Rejection(grpc.StatusCode.UNAVAILABLE, metrics.ERROR, str(e)).abort(context)
        finally:
            self.live.discard(engine_id)
            if status == metrics.OK:
                self.finished += 1
            timer.finish(status, reason)

    def _prepare(self, request) -> tuple[AsyncEngine, list[int], SamplingParams]:
        engine = self.engine
        if self.state != pb.SERVING_STATE_SERVING or engine is None:
            what = {
                pb.SERVING_STATE_DRAINING: "draining",
                pb.SERVING_STATE_FAILED: "failed (its engine stopped)",
            }.get(self.state, "loading its model")
            raise Rejection(
                grpc.StatusCode.UNAVAILABLE, metrics.UNAVAILABLE, f"this worker is {what}"
            )
        if request.model and request.model != self.model_name:
            raise Rejection(
                grpc.StatusCode.NOT_FOUND,
                metrics.NOT_FOUND,
                f"model {request.model!r} is not served here (this worker serves "
                f"{self.model_name!r})",
                code="model_not_found",
                param="model",
            )
        ids = prompt_token_ids(engine.tokenizer, request)
        return engine, ids, self._sampling_params(request.sampling, len(ids), engine)

    def _sampling_params(self, p, num_prompt_tokens: int, engine: AsyncEngine) -> SamplingParams:
        # The engine can hold a request only if prompt + output fit both the context window and
        # the KV pool; unset max_tokens means "whatever room that leaves".
        e = engine.engine
        kv_tokens = engine.stats().kv_blocks_total * e.settings.block_size  # fixed at startup
        room = min(e.max_model_len, kv_tokens)
        window = "context window" if room == e.max_model_len else "KV cache of this worker"
        if num_prompt_tokens >= room:
            raise ContextLengthError(
                f"the prompt has {num_prompt_tokens} tokens; the {window} holds {room} tokens "
                "(prompt and output together): shorten the prompt"
            )
        max_tokens = p.max_tokens if p.HasField("max_tokens") else room - num_prompt_tokens
        if max_tokens >= 1 and num_prompt_tokens + max_tokens > room:
            raise ContextLengthError(
                f"the prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
                f"{num_prompt_tokens + max_tokens} tokens exceeds the {window} of {room} tokens: "
                "shorten the prompt or lower max_tokens"
            )
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=p.temperature if p.HasField("temperature") else 1.0,
            top_p=p.top_p if p.HasField("top_p") else 1.0,
            top_k=p.top_k,
            seed=p.seed if p.HasField("seed") else None,
            stop=tuple(p.stop),
            stop_token_ids=tuple(p.stop_token_ids),
            ignore_eos=p.ignore_eos,
            logprobs=p.logprobs if p.HasField("logprobs") else None,
        )

    def _response(self, request_id: str, out: RequestOutput, engine: AsyncEngine):
        response = pb.GenerateResponse(
            request_id=request_id,
            token_ids=out.token_ids,
            text=out.text,
            finish_reason=FINISH_REASONS.get(out.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
            usage=pb.Usage(
                prompt_tokens=out.prompt_tokens,
                completion_tokens=out.completion_tokens,
                cached_tokens=out.cached_tokens,
            ),
            model=self.model_name,
        )
        decode = engine.tokenizer.decode
        for token_id, logprob, top in out.logprobs or ():
            response.logprobs.append(
                pb.TokenLogprob(
                    token_id=token_id,
                    token=decode([token_id], skip_special_tokens=False),
                    logprob=logprob,
                    top=[
                        pb.TopLogprob(
                            token_id=t, token=decode([t], skip_special_tokens=False), logprob=lp
                        )
                        for t, lp in top
                    ],
                )
            )
        return response

    # ---- Models --------------------------------------------------------------------------------

    async def Models(self, request, context):
        await self._loaded(context)
        model = pb.Model(
            id=self.model_name, max_model_len=self.engine.engine.max_model_len, created=self.created
        )
        return pb.ModelsResponse(models=[model])

    async def Tokenizer(self, request, context):
        await self._loaded(context)
        if request.model and request.model != self.model_name:
            await Rejection(
                grpc.StatusCode.NOT_FOUND,
                metrics.NOT_FOUND,
                f"model {request.model!r} is not served here",
                code="model_not_found",
                param="model",
            ).abort(context)
        return self.engine.tokenizer.to_pb(self.model_name)

    async def _loaded(self, context) -> None:
        if self.engine is None:
            rejection = Rejection(
                grpc.StatusCode.UNAVAILABLE, metrics.UNAVAILABLE, "this worker is loading its model"
            )
            await rejection.abort(context)

    # ---- LoadReport ----------------------------------------------------------------------------

    async def LoadReport(self, request, context) -> AsyncIterator:
        interval = request.interval_seconds or DEFAULT_REPORT_INTERVAL
        interval = min(max(interval, 0.05), 60.0)
        sent_hashes: tuple[int, ...] | None = None
        while True:
            changed = self._changed
            load = self.load()
            if request.include_prefix_cache and self.engine is not None:
                hashes = self.engine.prefix_cache_hashes()
                if hashes != sent_hashes:
                    load.prefix_cache.block_hashes.extend(hashes)
                    sent_hashes = hashes
            yield load
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), interval)

    def load(self) -> "pb.Load":
        load = pb.Load(
            state=self.state,
            model=self.model_name,
            serving_replicas=int(self.state == pb.SERVING_STATE_SERVING),
        )
        if self.engine is None:
            return load
        s, e = self.engine.stats(), self.engine.engine
        now = time.monotonic()
        self._tokens_rate.add(now, s.generation_tokens)
        self._finished_rate.add(now, self.finished)
        load.running, load.waiting = s.running, s.waiting
        load.max_num_seqs = e.settings.max_num_seqs
        load.kv_blocks_used, load.kv_blocks_total = s.kv_blocks_used, s.kv_blocks_total
        load.block_size = e.settings.block_size
        load.generation_tokens_per_second = self._tokens_rate.rate()
        load.requests_finished_per_second = self._finished_rate.rate()
        return load


class Rejection(UserError):
    """A request this worker will not run, with the gRPC status and error tags it gets."""

    def __init__(
        self, grpc_code: grpc.StatusCode, status: str, message: str, code: str = "", param: str = ""
    ):
        super().__init__(message)
        self.grpc_code, self.status, self.code, self.param = grpc_code, status, code, param

    @classmethod
    def invalid(cls, e: UserError) -> "Rejection":
        return cls(grpc.StatusCode.INVALID_ARGUMENT, metrics.INVALID, str(e))

    async def abort(self, context) -> None:
        tags = (("meridian-error-code", self.code), ("meridian-error-param", self.param))
        context.set_trailing_metadata([(k, v) for k, v in tags if v])
        await context.abort(self.grpc_code, str(self))


class ContextLengthError(Rejection):
    """The prompt, or prompt + max_tokens, does not fit this worker."""

    def __init__(self, message: str):
        super().__init__(
            grpc.StatusCode.INVALID_ARGUMENT,
            metrics.INVALID,
            message,
            code="context_length_exceeded",
            param="prompt",
        )
