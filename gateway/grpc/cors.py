"""CORS for gRPC-Web: what browsers need to call the gateway from another origin.

A browser sends a preflight ``OPTIONS`` before any gRPC-Web ``POST`` (its
content type and ``x-grpc-web`` / ``grpc-timeout`` headers are not "simple"),
and a script can read only the response headers we expose -- hence
``grpc-status`` and ``grpc-message``, which a trailers-only response carries
in its headers. Pure functions; the HTTP adapter adds the headers.
``allowed_origins=None`` allows any origin.
"""

from __future__ import annotations

from collections.abc import Collection

__all__ = ["ALLOW_HEADERS", "EXPOSE_HEADERS", "preflight_headers", "response_headers"]

ALLOW_HEADERS = (b"content-type,x-grpc-web,x-user-agent,grpc-timeout,grpc-encoding,"
                 b"grpc-accept-encoding,authorization")
EXPOSE_HEADERS = b"grpc-status,grpc-message,grpc-encoding,grpc-accept-encoding,retry-after"
_MAX_AGE = b"86400"  # a day: one preflight per origin and header set, not one per call


def _allow_origin(origin: bytes | None, allowed_origins: Collection[bytes] | None) -> bytes | None:
    if origin is None:
        return None
    if allowed_origins is None:
        return b"*"
    return origin if origin in allowed_origins else None


def preflight_headers(origin: bytes | None, allowed_origins: Collection[bytes] | None = None
                      ) -> list[tuple[bytes, bytes]]:
    """Headers for the 204 answer to a preflight; empty when the origin is not allowed."""
    allow = _allow_origin(origin, allowed_origins)
    if allow is None:
        return []
    return [(b"access-control-allow-origin", allow), (b"access-control-allow-methods", b"POST, OPTIONS"),
            (b"access-control-allow-headers", ALLOW_HEADERS), (b"access-control-max-age", _MAX_AGE),
            (b"vary", b"origin")]


def response_headers(origin: bytes | None, allowed_origins: Collection[bytes] | None = None
                     ) -> list[tuple[bytes, bytes]]:
    """Headers to add to a gRPC-Web response for a cross-origin caller."""
    allow = _allow_origin(origin, allowed_origins)
    if allow is None:
        return []
    return [(b"access-control-allow-origin", allow), (b"access-control-expose-headers", EXPOSE_HEADERS),
            (b"vary", b"origin")]
