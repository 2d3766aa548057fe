"""Transport errors. Each class carries the wire :class:`ErrorCode` it maps to."""

from __future__ import annotations

from .messages import ErrorCode

__all__ = [
    "TransportError",
    "ConnectError",
    "ConnectionClosed",
    "ProtocolError",
    "WireError",
    "CreditExceeded",
    "RdmaUnavailable",
    "SecurityConfigError",
    "TlsFailure",
]


class TransportError(Exception):
    """Base class of every error raised by ``transport``."""

    code: ErrorCode = ErrorCode.INTERNAL


class ConnectError(TransportError):
    """Could not establish a connection (refused, timeout, handshake failed)."""

    code = ErrorCode.CONNECTION_LOST


class ConnectionClosed(TransportError):
    """The connection is closed, lost, or draining (no new requests)."""

    code = ErrorCode.CONNECTION_LOST


class ProtocolError(TransportError):
    """The peer broke the protocol (bad frame, wrong message, version mismatch)."""

    code = ErrorCode.PROTOCOL


class WireError(ProtocolError):
    """The byte stream is not valid frames: garbage, oversize, truncation, version."""


class CreditExceeded(TransportError):
    """A worker tried to send more tokens for a request than its credit allows."""

    code = ErrorCode.INTERNAL


class RdmaUnavailable(ConnectError):
    """RDMA was required but no usable RDMA device / pyverbs is available."""


class SecurityConfigError(ConnectError, ValueError):
    """Transport security refuses to run as configured: no authentication beyond loopback (default
    deny), or certificates or a key that do not load. Restarting does not help; the message says
    what to configure."""


class TlsFailure(ConnectError):
    """The TLS handshake or a TLS record failed; the message says why in the transport's terms."""
