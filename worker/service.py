"""`meridian.v1.Inference` on a worker: the engine behind gRPC.

Generate turns a request into prompt token ids (in a thread: templating and tokenizing are slow)
and bounded SamplingParams, streams the engine's deltas back, and aborts the request in the engine
when the caller cancels (the handler's task is cancelled, which closes the engine's iterator). The
call's deadline travels with the request, so the engine stops working on it when nobody waits any
more. Every call ends one way: an answer, or a status (INVALID_ARGUMENT, NOT_FOUND,
RESOURCE_EXHAUSTED when the queue is full, UNAVAILABLE, INTERNAL when this request failed).
LoadReport publishes what a gateway needs to route: serving state, queue depth, KV-cache use, drain
rate and the prefix cache's block hashes.
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
from meridian.worker.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
    RequestFailedError,
)
from meridian.worker.engine.llm_engine import RequestOutput
from meridian.worker.sampling_params import SamplingParams
from meridian.worker.tokenizer import PromptTooLong, prompt_token_ids

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
            engine, ids, params = await self._prepare(request)
            request_id = request.request_id or uuid.uuid4().hex
            engine_id = f"{request_id}-{uuid.uuid4().hex[:8]}"  # callers' ids need not be unique
            self.live.add(engine_id)
            remaining = context.time_remaining()  # seconds; None without a deadline
            deadline = None if remaining is None else time.monotonic() + remaining
            stream = engine.generate(engine_id, ids, params, request.priority, deadline)
            async with contextlib.aclosing(stream):
                async for out in stream:
                    if timer.last_token is None and out.queue_time is not None:
                        self.queue_time.labels(*timer.labels).observe(out.queue_time)
                    timer.tokens(len(out.token_ids), out.prompt_tokens)
                    reason = out.finish_reason
                    yield self._response(request_id, out, engine)
            status = metrics.OK
        except Exception as e:  # cancellation (BaseException) passes: grpc ends the call itself
            rejection = _rejection(e)
            status = rejection.status
            await rejection.abort(context)
        finally:
            self.live.discard(engine_id)
            if status == metrics.OK:
                self.finished += 1
            timer.finish(status, reason)

    async def _prepare(self, request) -> tuple[AsyncEngine, list[int], SamplingParams]:
        engine = self.engine
        if self.state != pb.SERVING_STATE_SERVING or engine is None:
            what = {
                pb.SERVING_STATE_DRAINING: "draining",
                pb.SERVING_STATE_FAILED: "failed (its engine stopped)",
                pb.SERVING_STATE_STALLED: "stalled (an engine step is overrunning)",
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
        room, window = _room(engine)
        try:
            ids = await asyncio.to_thread(prompt_token_ids, engine.tokenizer, request, room - 1)
        except PromptTooLong as e:
            raise ContextLengthError(
                f"{e}; the {window} holds {room} tokens (prompt and output together): "
                "shorten the prompt"
            ) from e
        return engine, ids, _sampling_params(request.sampling, len(ids), room, window)

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
        token_text = engine.tokenizer.token_text  # a table lookup: no decoding on the event loop
        for token_id, logprob, top in out.logprobs or ():
            response.logprobs.append(
                pb.TokenLogprob(
                    token_id=token_id,
                    token=token_text(token_id),
                    logprob=logprob,
                    top=[
                        pb.TopLogprob(token_id=t, token=token_text(t), logprob=lp) for t, lp in top
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
    """A request this worker will not run (or no longer can), with the gRPC status, the status
    label of meridian_requests_total and the error tags it gets."""

    def __init__(
        self,
        grpc_code: grpc.StatusCode,
        status: str,
        message: str,
        code: str = "",
        param: str = "",
        retry_after: int | None = None,  # seconds
    ):
        super().__init__(message)
        self.grpc_code, self.status, self.code, self.param = grpc_code, status, code, param
        self.retry_after = retry_after

    @classmethod
    def invalid(cls, e: UserError) -> "Rejection":
        return cls(grpc.StatusCode.INVALID_ARGUMENT, metrics.INVALID, str(e))

    async def abort(self, context) -> None:
        tags = {"meridian-error-code": self.code, "meridian-error-param": self.param}
        if self.retry_after is not None:
            tags["retry-after"] = str(self.retry_after)
        context.set_trailing_metadata([(k, v) for k, v in tags.items() if v])
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


def _rejection(e: Exception) -> Rejection:
    """How a Generate call that raised `e` ends (a failure of this worker's own code is logged with
    its traceback)."""
    if isinstance(e, Rejection):
        return e
    if isinstance(e, UserError):  # the engine's own checks, before anything is queued
        return Rejection.invalid(e)
    if isinstance(e, EngineOverloadedError):  # another worker, or this one shortly, may take it
        return Rejection(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            metrics.REJECTED,
            str(e),
            code="overloaded",
            retry_after=1,
        )
    if isinstance(e, EngineDeadError):  # another worker can still serve the request
        return Rejection(grpc.StatusCode.UNAVAILABLE, metrics.ERROR, str(e))
    if isinstance(e, RequestFailedError):  # logged by the engine
        message = f"the engine failed on this request: {e}"
    else:
        log.exception("Generate failed")
        message = f"this worker failed on the request: {type(e).__name__}: {e}"
    return Rejection(grpc.StatusCode.INTERNAL, metrics.ERROR, message)


def _room(engine: AsyncEngine) -> tuple[int, str]:
    """Tokens one request can hold (prompt and output together), and what sets that bound: the
    context window, or the KV pool when it is smaller."""
    e = engine.engine
    kv_tokens = engine.stats().kv_blocks_total * e.settings.block_size  # fixed at startup
    room = min(e.max_model_len, kv_tokens)
    return room, "context window" if room == e.max_model_len else "KV cache of this worker"


def _sampling_params(p, num_prompt_tokens: int, room: int, window: str) -> SamplingParams:
    """A pb.SamplingParams checked against the room the prompt leaves; unset max_tokens means
    "whatever room that leaves"."""
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
