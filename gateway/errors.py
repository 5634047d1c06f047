"""Errors the gateway answers with: an HTTP status and a gRPC code for each, so that both front ends
answer in their own terms, with OpenAI's error types and Meridian's error-code trailers."""

import grpc

from meridian import metrics
from meridian.gateway.routing import Reject

# Upstream answers that mean "not there, not now": another replica or region may well succeed. (A
# worker cancels calls only when it is stopped without a drain; our own cancellations never surface
# here.) RESOURCE_EXHAUSTED is retried only when it says "overloaded" (a full queue), not for a
# key's rate limit or a message too large; it never counts toward ejecting the upstream, the others
# do. A client's error (INVALID_ARGUMENT, NOT_FOUND...) is neither retried nor held against anyone.
RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.CANCELLED,
}
EJECTING = RETRYABLE - {grpc.StatusCode.RESOURCE_EXHAUSTED}
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.CANCELLED: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
GRPC_CODE = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED}
GRPC_CODE |= {404: grpc.StatusCode.NOT_FOUND, 429: grpc.StatusCode.RESOURCE_EXHAUSTED}
GRPC_CODE |= {413: grpc.StatusCode.RESOURCE_EXHAUSTED}
GRPC_CODE |= {503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}
METRIC_STATUS = {400: metrics.INVALID, 401: metrics.INVALID, 404: metrics.NOT_FOUND}
METRIC_STATUS |= {413: metrics.INVALID}
METRIC_STATUS |= {429: metrics.REJECTED, 503: metrics.UNAVAILABLE}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error"}
ERROR_TYPES |= {404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable_error"}
ERROR_TYPES |= {413: "invalid_request_error", 504: "timeout_error"}


class GatewayError(Exception):
    def __init__(
        self,
        http_status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        retry_after: int | None = None,
        headers: dict[str, str] | None = None,
        retryable: bool = False,
    ):
        super().__init__(message)
        self.http_status, self.code, self.param = http_status, code, param
        self.retry_after = retry_after
        self.headers = dict(headers or {})  # extra answer headers (rate limits, region)
        self.retryable = retryable  # the upstream failed; another may succeed

    @property
    def message(self) -> str:
        return str(self)

    @property
    def type(self) -> str:
        return ERROR_TYPES.get(self.http_status, "server_error")

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return GRPC_CODE.get(self.http_status, grpc.StatusCode.INTERNAL)

    @property
    def metric_status(self) -> str:
        return METRIC_STATUS.get(self.http_status, metrics.ERROR)

    def http_headers(self) -> dict[str, str]:
        retry = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}
        return {**self.headers, **retry}

    def grpc_trailers(self) -> list[tuple[str, str]]:
        tags = [("meridian-error-code", self.code), ("meridian-error-param", self.param)]
        if self.retry_after is not None:
            tags.append(("retry-after", str(self.retry_after)))
        tags += self.headers.items()
        return [(k, v) for k, v in tags if v]

    @classmethod
    def from_reject(cls, reject: Reject) -> "GatewayError":
        code = {404: "model_not_found", 429: "overloaded", 503: "no_healthy_worker"}
        param = "model" if reject.status == 404 else None
        return cls(reject.status, reject.message, code[reject.status], param, reject.retry_after)

    @classmethod
    def from_rpc(cls, e: grpc.aio.AioRpcError, upstream: str) -> "GatewayError":
        """What the client is told when the call to `upstream` failed with `e`."""
        trailers = dict(e.trailing_metadata() or ())
        retry_after = trailers.get("retry-after")
        code, status = trailers.get("meridian-error-code"), HTTP_STATUS.get(e.code(), 502)
        message = e.details() or e.code().name
        retryable = e.code() in RETRYABLE
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            message, code = "the request's deadline passed before its answer ended", "timeout"
        elif code is None and e.code() in EJECTING:  # said by gRPC, not by a Meridian server
            message, code = f"the upstream {upstream} failed: {message}", "upstream_failed"
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            retryable = code == "overloaded"
            if code is None:  # gRPC's own: a message over a server's size limit
                status, code = 413, "request_too_large"
        return cls(
            status,
            message,
            code,
            trailers.get("meridian-error-param"),
            int(retry_after) if retry_after and retry_after.isdigit() else None,
            retryable=retryable,
        )
