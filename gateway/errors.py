"""One error model for the gateway, rendered once at the edge.

Anything that goes wrong while serving a request is raised as (or converted
to) an :class:`APIError`; :func:`render` turns it into an OpenAI-shaped JSON
body with the right HTTP status. gRPC status mapping will live beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

__all__ = ["APIError", "render_json", "error_headers", "from_wire_code"]


@dataclass(slots=True)
class APIError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after: float | None = None
    headers: tuple[tuple[bytes, bytes], ...] = ()

    def __str__(self) -> str:
        return f"{self.status} {self.type}: {self.message}"


def render_json(err: APIError) -> bytes:
    """``{"error": {"message", "type", "param", "code"}}`` as OpenAI sends it."""
    return orjson.dumps(
        {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}
    )


_JSON = (b"content-type", b"application/json")


def error_headers(err: APIError) -> list[tuple[bytes, bytes]]:
    """Response headers for an error body (``retry-after`` when the error carries one)."""
    if err.retry_after is not None:
        return [_JSON, (b"retry-after", str(max(1, round(err.retry_after))).encode())]
    return [_JSON]


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
    return APIError(status, message, typ, None, c)
