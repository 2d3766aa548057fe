"""One error model for the gateway, rendered once per wire format at the edge.

Anything that goes wrong while serving a request is raised as (or converted
to) an :class:`APIError`: protocol rejections of the adapters (400/408/413/431),
admission refusals (401/403/429/503), parse and validation errors, routing
errors (:mod:`gateway.routing.errors`, converted by :func:`from_routing`) and
worker errors (:func:`from_wire_code`). Each wire format renders it one way:
:func:`render_http` (status, headers, OpenAI JSON body) before a response has
started, :func:`render_sse` (an SSE error event) once a stream has; gRPC status
and gRPC-Web trailers map from the same fields (``gateway.grpc``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import orjson

from .routing.errors import NoReplica, RoutingError, UnknownModel, Unroutable

__all__ = [
    "APIError",
    "render_json",
    "render_http",
    "render_sse",
    "error_headers",
    "retry_after_value",
    "from_wire_code",
    "from_routing",
    "internal_error",
]

Headers = list[tuple[bytes, bytes]]


@dataclass(slots=True)
class APIError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after: float | None = None
    headers: tuple[tuple[bytes, bytes], ...] = ()  # extra response headers (x-ratelimit-*, allow, ...)

    def __str__(self) -> str:
        return f"{self.status} {self.type}: {self.message}"


def internal_error() -> APIError:
    return APIError(500, "Internal server error.", "server_error", None, "internal_error")


def render_json(err: APIError) -> bytes:
    """``{"error": {"message", "type", "param", "code"}}`` as OpenAI sends it."""
    return orjson.dumps(
        {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}
    )


_JSON = (b"content-type", b"application/json")


def retry_after_value(seconds: float) -> bytes:
    """``Retry-After`` in whole seconds (RFC 9110 10.2.3), rounded up and at least 1: a client told
    0 retries at once, and one told less than it must wait is refused again."""
    return b"%d" % max(1, math.ceil(seconds))


def error_headers(err: APIError) -> Headers:
    """Response headers for an error body: content type, ``retry-after``, the error's own."""
    out = [_JSON]
    if err.retry_after is not None:
        out.append((b"retry-after", retry_after_value(err.retry_after)))
    if err.headers:
        out.extend(err.headers)
    return out


def render_http(err: APIError) -> tuple[int, Headers, bytes]:
    """An error as a whole HTTP response (any HTTP version)."""
    return err.status, error_headers(err), render_json(err)


def render_sse(err: APIError) -> bytes:
    """An error inside a started SSE stream: one ``data:`` event with the same body as
    :func:`render_json`, plus the HTTP status it would have had."""
    return b"data: " + orjson.dumps({"error": {"message": err.message, "type": err.type, "param": err.param,
                                               "code": err.code, "status": err.status}}) + b"\n\n"


# ErrorCode (transport.messages) value -> (HTTP status, OpenAI type, code)
_WIRE = {
    1: (500, "server_error", "internal_error"),
    2: (400, "invalid_request_error", "invalid_request"),
    3: (404, "invalid_request_error", "model_not_found"),
    4: (503, "server_error", "overloaded"),
    5: (499, "cancelled", "cancelled"),
    6: (400, "invalid_request_error", "context_length_exceeded"),
    7: (503, "server_error", "shutting_down"),
    8: (502, "server_error", "worker_connection_lost"),
    9: (502, "server_error", "worker_protocol_error"),
    10: (504, "server_error", "timeout"),
}


def from_wire_code(code: int, message: str) -> APIError:
    status, typ, c = _WIRE.get(int(code), (500, "server_error", "internal_error"))
    return APIError(status, message, typ, None, c, retry_after=1.0 if status == 503 else None)  # retryable: say when


def from_routing(e: RoutingError) -> APIError:
    """A routing decision that found no replica, rendered as the client sees it."""
    if isinstance(e, UnknownModel):
        return APIError(404, f"The model `{e.model}` does not exist.", "invalid_request_error", "model",
                        "model_not_found")
    if isinstance(e, NoReplica):
        return APIError(503, f"No worker serving `{e.model}` is ready; try again shortly.", "server_error",
                        None, "no_worker_available", retry_after=1.0)
    if isinstance(e, Unroutable):
        return APIError(400, f"The request cannot be sent to a worker: {e}", "invalid_request_error", None,
                        "invalid_value")
    return internal_error()
