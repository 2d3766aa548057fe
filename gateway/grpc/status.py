"""The gateway's one error model, rendered as gRPC status.

Every failure is an :class:`~gateway.errors.APIError` (HTTP status + code
string) until it reaches the edge; native gRPC and gRPC-Web render it with
:func:`grpc_status` here, so both wire formats agree with each other and with
the HTTP status the OpenAI API would send. Also here: the ``grpc-timeout``
header (the client's deadline) and the percent-encoding of ``grpc-message``,
shared with grpclib so both transports encode messages the same way.
"""

from __future__ import annotations

import re

from grpclib.const import Status
from grpclib.metadata import decode_grpc_message, encode_grpc_message

from ..errors import APIError, retry_after_value

__all__ = [
    "Status",
    "grpc_status",
    "retry_trailers",
    "parse_grpc_timeout",
    "encode_grpc_message",
    "decode_grpc_message",
]

# HTTP status -> gRPC code. Where the gRPC spec's own HTTP mapping (meant for
# proxies that never saw a grpc-status) disagrees, this follows what the gateway
# means by the status: 504 is our request timeout, 502 a lost worker (retryable).
_BY_HTTP = {
    400: Status.INVALID_ARGUMENT,
    401: Status.UNAUTHENTICATED,
    403: Status.PERMISSION_DENIED,
    404: Status.NOT_FOUND,
    405: Status.UNIMPLEMENTED,
    408: Status.DEADLINE_EXCEEDED,
    409: Status.ABORTED,
    413: Status.RESOURCE_EXHAUSTED,  # what gRPC says for an oversized message
    415: Status.INVALID_ARGUMENT,
    422: Status.INVALID_ARGUMENT,
    429: Status.RESOURCE_EXHAUSTED,
    499: Status.CANCELLED,
    500: Status.INTERNAL,
    501: Status.UNIMPLEMENTED,
    502: Status.UNAVAILABLE,
    503: Status.UNAVAILABLE,
    504: Status.DEADLINE_EXCEEDED,
}


def grpc_status(err: APIError) -> Status:
    """The gRPC status code for ``err`` (other 4xx: INVALID_ARGUMENT, other 5xx: INTERNAL)."""
    status = _BY_HTTP.get(err.status)
    if status is not None:
        return status
    if 400 <= err.status < 500:
        return Status.INVALID_ARGUMENT
    if 500 <= err.status < 600:
        return Status.INTERNAL
    return Status.UNKNOWN


def retry_trailers(err: APIError) -> list[tuple[str, str]]:
    """``retry-after`` when the error says when to retry: the HTTP header's value
    (:func:`~gateway.errors.retry_after_value`: whole seconds, rounded up, at least 1).

    Not gRPC's ``grpc-retry-pushback-ms``: grpclib reserves every ``grpc-`` key
    for itself, and one trailer in both wire formats beats two spellings.
    """
    if err.retry_after is None:
        return []
    return [("retry-after", retry_after_value(err.retry_after).decode("ascii"))]


# TimeoutValue is at most 8 ASCII digits, then one unit (gRPC over HTTP/2 spec).
_TIMEOUT = re.compile(rb"\A([0-9]{1,8})([HMSmun])\Z")
# (multiplier, divisor): one integer division, so "250m" is exactly 0.25.
_UNIT = {b"H": (3600, 1), b"M": (60, 1), b"S": (1, 1), b"m": (1, 10**3), b"u": (1, 10**6), b"n": (1, 10**9)}


def parse_grpc_timeout(value: str | bytes) -> float:
    """Seconds in a ``grpc-timeout`` value such as ``"250m"``; a malformed one raises an APIError
    (a call answers it INTERNAL: a protocol error, not the method's argument)."""
    raw = value.encode("latin-1", "replace") if isinstance(value, str) else value
    match = _TIMEOUT.match(raw)
    if match is None:
        raise APIError(400, f"Malformed grpc-timeout {raw!r}: expected 1-8 digits and a unit "
                       "(H, M, S, m, u, n).", "invalid_request_error", "grpc-timeout",
                       "invalid_grpc_timeout")
    mul, div = _UNIT[match.group(2)]
    return int(match.group(1)) * mul / div
