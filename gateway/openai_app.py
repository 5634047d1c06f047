"""The OpenAI-compatible HTTP front end (FastAPI on uvicorn; OpenAPI document at /openapi.json).

Streaming answers are Server-Sent Events ending in `data: [DONE]`. The HTTP status is decided before
the first byte: the first worker response is awaited (with retries on other workers) before the
response starts, so routing and validation failures get a real status code rather than an error
event inside a 200 stream. A client that disconnects cancels the worker call, streaming or not.
"""

import asyncio
import contextlib
import json
import logging
import math
import re
import time
import uuid
from functools import partial

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from meridian import __version__, metrics
from meridian.gateway.dispatch import Dispatcher
from meridian.gateway.errors import GatewayError
from meridian.gateway.openai_protocol import (
    ChatCompletionRequest,
    ChatFormat,
    CompletionFormat,
    CompletionRequest,
    finish_reason,
)
from meridian.gateway.streams import Stream, answer_headers
from meridian.gateway.workers import WorkerPool
from meridian.limits import MAX_REQUEST_BYTES

log = logging.getLogger(__name__)
UNION_TAG = re.compile(r"str|int|float|bool|list\[.*\]|function-\w+\[.*\]")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None):
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ClientDisconnected(Exception):
    pass


class BodyLimit:
    """Refuse a request body over `limit` bytes, by its Content-Length or as it streams in, with a
    413 (HTTPException, answered by the app's handler in OpenAI's error shape)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length", "")
        received = int(length) if length.isdigit() else 0

        async def limited():
            nonlocal received
            if received > self.limit:
                raise HTTPException(413)
            message = await receive()
            if message["type"] == "http.request" and not length.isdigit():
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise HTTPException(413)
            return message

        await self.app(scope, limited, send)


def create_app(
    dispatcher: Dispatcher,
    pool: WorkerPool,
    registry: CollectorRegistry,
    request_metrics: metrics.RequestMetrics,
) -> FastAPI:
    app = FastAPI(
        title="Meridian",
        version=__version__,
        summary="OpenAI-compatible API of a Meridian gateway.",
    )
    app.add_middleware(BodyLimit, limit=MAX_REQUEST_BYTES)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        body = exc.body if isinstance(exc.body, dict) else {}
        model = body.get("model") if isinstance(body.get("model"), str) else "unknown"
        request_metrics.start(model).finish(metrics.INVALID)
        message, param = _describe(exc.errors())
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        return JSONResponse(
            error_body(exc.message, exc.type, exc.param, exc.code),
            status_code=exc.http_status,
            headers={**exc.http_headers(), "x-meridian-region": dispatcher.region},
        )

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message, code = str(exc.detail), None
        if exc.status_code == 413:
            message = (
                f"the request body is larger than this server's limit of {MAX_REQUEST_BYTES} bytes"
            )
            code = "request_too_large"
        return JSONResponse(
            error_body(message, kind, code=code), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        message = "the gateway failed to handle this request (a bug; it has been logged)"
        return JSONResponse(error_body(message, "server_error"), status_code=500)

    async def generate(request: Request, body, fmt) -> Response:
        # Whatever happens below, the request's accounting and its upstream call end once: here
        # for a whole answer, or with the response for a streamed one (it takes them over).
        with contextlib.ExitStack() as owned:
            timer = owned.enter_context(request_metrics.start(body.model))
            try:
                work = dispatcher.open(
                    body.to_pb(fmt.base["id"]),
                    deadline=_client_deadline(request, body.stream),
                    credentials=request.headers.get("authorization"),
                )
                stream = await _until_disconnected(request, work)
            except GatewayError as e:
                if e.code == "context_length_exceeded":
                    e.param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
                raise
            except ClientDisconnected:
                return Response(status_code=499)  # nobody is listening; nginx's "client closed"
            owned.callback(lambda: stream.close())  # the latest attempt's, after any retry
            fmt.base["model"] = stream.model or body.model  # which model answered `auto`
            headers = answer_headers(stream)
            if body.stream:
                events = _sse(stream, fmt, body.include_usage, timer)
                return StreamedAnswer(events, owned.pop_all(), {**SSE_HEADERS, **headers})
            try:
                # A retry after a failure midway counts the failed attempt's tokens too.
                stream, (text, logprobs, usage, reason) = await _until_disconnected(
                    request, dispatcher.complete(stream, partial(_observe, timer))
                )
            except ClientDisconnected:
                return Response(status_code=499)
            # A retry may have moved it; the upstream's time is known now that it has ended.
            headers = {**headers, **answer_headers(stream)}
            timer.outcome(metrics.OK, finish_reason(reason))
            return JSONResponse(fmt.response(text, logprobs, usage, reason), headers=headers)

    @app.post("/v1/chat/completions", summary="Create a chat completion")
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        fmt = ChatFormat(
            f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), body.model, body.logprobs
        )
        return await generate(request, body, fmt)

    @app.post("/v1/completions", summary="Create a text completion")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        created, logprobs = int(time.time()), body.logprobs is not None
        fmt = CompletionFormat(f"cmpl-{uuid.uuid4().hex}", created, body.model, logprobs)
        return await generate(request, body, fmt)

    @app.get("/v1/models", summary="List the models the workers serve")
    async def models() -> dict:
        data = [
            {
                "id": m.id,
                "object": "model",
                "created": m.created,
                "owned_by": "meridian",
                "max_model_len": m.max_model_len,
            }
            for m in pool.models()
        ]
        return {"object": "list", "data": data}

    @app.get("/health", summary="200 when a worker here or in a peer region is serving, else 503")
    async def health() -> JSONResponse:
        serving, peers = pool.serving(), pool.peers_serving()
        body = {
            "status": "ok" if serving or peers else "unavailable",
            "region": pool.region,
            "workers_serving": serving,
            "peers_serving": peers,
        }
        return JSONResponse(body, status_code=200 if serving or peers else 503)

    @app.get("/metrics", summary="Prometheus metrics", include_in_schema=False)
    async def prometheus() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


class StreamedAnswer(StreamingResponse):
    """Server-sent events that own their request's accounting and upstream call, and end them
    however the response ends: finished, failed, or never sent because the client left first."""

    def __init__(self, events, owned: contextlib.ExitStack, headers: dict[str, str]):
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self.owned = owned

    async def __call__(self, scope, receive, send) -> None:
        with self.owned:
            try:
                await super().__call__(scope, receive, send)
            finally:
                await self.body_iterator.aclose()


async def _sse(stream: Stream, fmt, include_usage: bool, timer: metrics.RequestTimer):
    reason, usage = None, None
    extra = {"usage": None} if include_usage else {}
    try:
        first = fmt.first_chunk()
        if first is not None:
            yield _event({**first, **extra})
        async for r in _counted(stream, timer):
            usage, reason = r.usage, r.finish_reason or reason
            if r.text or r.finish_reason or (fmt.logprobs and r.logprobs):
                yield _event({**fmt.delta_chunk(r), **extra})
        if include_usage and usage is not None:
            yield _event(fmt.usage_chunk(usage))
        timer.outcome(metrics.OK, finish_reason(reason))
        yield "data: [DONE]\n\n"
    except GatewayError as e:  # the worker failed after the stream began: too late to retry
        timer.outcome(e.metric_status, finish_reason(reason))
        yield _event(error_body(e.message, e.type, e.param, e.code))
        yield "data: [DONE]\n\n"


async def _counted(stream: Stream, timer: metrics.RequestTimer):
    async for r in stream:
        _observe(timer, r)
        yield r


def _observe(timer: metrics.RequestTimer, r) -> None:
    timer.tokens(len(r.token_ids), r.usage.prompt_tokens)


def _client_deadline(request: Request, streamed: bool) -> float | None:
    """The client's own deadline (monotonic seconds), where it has one: the openai SDKs send their
    read timeout, and a whole (not streamed) answer arrives in one read."""
    if streamed:
        return None
    try:
        seconds = float(request.headers.get("x-stainless-read-timeout", "nan"))
    except ValueError:
        return None
    return time.monotonic() + seconds if 0 < seconds < math.inf else None


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _until_disconnected(request: Request, work):
    """Run `work` unless the client disconnects first (then cancel it and raise
    ClientDisconnected). Starlette cancels a streaming body on disconnect by itself, but not an
    endpoint that is still computing its response."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ClientDisconnected()
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _describe(errors) -> tuple[str, str | None]:
    """One line from pydantic's errors, naming the field (OpenAI's `param`) when there is one."""
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Union members add their type names to the path (e.g. stop.str); keep the request's own names.
    loc = [p for p in loc if not UNION_TAG.fullmatch(p)]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":
        message = "unknown or unsupported parameter"
    if param:
        message = f"{param}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return message, param
