"""What the flow core (:mod:`transport.flow`) tells its owner: one event type per thing that
happened on a connection, returned by its methods (sans-I/O; the owner acts on them)."""

from __future__ import annotations

from dataclasses import dataclass

from .messages import Error, Finish, Hello, KvEvents, Stats, Submit, TokenBatch

__all__ = [
    "PeerHello",
    "SubmitReceived",
    "SubmitRefused",
    "CancelReceived",
    "CreditResumed",
    "TokensReceived",
    "RequestEnded",
    "StatsReceived",
    "GoodbyeReceived",
    "ConnectionEnded",
    "KvSubscribed",
    "KvEventsReceived",
    "Event",
]


@dataclass(frozen=True, slots=True)
class PeerHello:
    hello: Hello


@dataclass(slots=True)  # not frozen: one per step/request, and frozen init is slow
class SubmitReceived:
    """Worker: a new request (its credit is the gateway's initial window)."""

    submit: Submit


@dataclass(frozen=True, slots=True)
class SubmitRefused:
    """Worker: a SUBMIT whose body did not decode; the core has already answered it with an
    ``INVALID_REQUEST`` error (this event is for the log)."""

    request_id: int
    reason: str


@dataclass(frozen=True, slots=True)
class CancelReceived:
    """Worker: the gateway cancelled an open request; the worker still ends it."""

    request_id: int


@dataclass(frozen=True, slots=True)
class CreditResumed:
    """Worker: a request's credit rose from 0 to ``available``."""

    request_id: int
    available: int


@dataclass(slots=True)  # not frozen: one per step/request, and frozen init is slow
class TokensReceived:
    """Gateway: one engine step. Entries of locally cancelled requests are to be ignored."""

    batch: TokenBatch


@dataclass(slots=True)  # not frozen: one per step/request, and frozen init is slow
class RequestEnded:
    """Gateway: the one and only end of a request."""

    result: Finish | Error


@dataclass(frozen=True, slots=True)
class StatsReceived:
    stats: Stats


@dataclass(frozen=True, slots=True)
class GoodbyeReceived:
    reason: str


@dataclass(frozen=True, slots=True)
class ConnectionEnded:
    """The connection is over; ``open_requests`` were still open (worker: cancel them)."""

    error: Error
    open_requests: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KvSubscribed:
    """Worker: the gateway asks for the whole prefix cache now, then every change (a resync too)."""


@dataclass(slots=True)  # not frozen: one per engine step
class KvEventsReceived:
    """Gateway: a batch of the worker's prefix-cache changes (it subscribed)."""

    events: KvEvents


Event = (
    PeerHello
    | SubmitReceived
    | SubmitRefused
    | CancelReceived
    | CreditResumed
    | TokensReceived
    | RequestEnded
    | StatsReceived
    | GoodbyeReceived
    | ConnectionEnded
    | KvSubscribed
    | KvEventsReceived
)
