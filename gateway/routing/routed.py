"""A request's stream on a replica, which may move to another one before its first token.

How it works: :meth:`RoutedStream.submit` asks the pool's policy for a replica
and submits there; a replica that refuses at once (closed, draining, full) is
excluded and the policy asked again. Once the stream is open its consumer (the
generation call) reads :attr:`RoutedStream.stream` in whatever mode it likes;
if the stream ends with a retryable error before any token (the worker died,
drained or was overloaded), :meth:`RoutedStream.retry` resubmits to another
replica, up to the pool's ``retries``, and the consumer starts over on the new
stream. A request still waiting for its first token can also be *moved* to a
replica that became ready (:meth:`RoutedStream.move`, called by the pool's
rebalance): a restart or scale-out relieves a queue at once.

After the first token, a stream whose replica is lost (it died, drained or failed
its engine step: the same retryable errors) *resumes* on another one (mid-stream
failover): the tokens the client has -- what the lost streams received
(``RequestStream.received``), joined across failovers in ``_cont`` -- go to a
replica that lists the ``"continuation"`` capability as ``Submit.continuation``,
and the consumer reads on from the new stream as if nothing happened. Within the
same ``retries`` and retry budget; no other replica, or a stream whose history the
connection forgot, and the error goes to the client, as before the first token
with no replica left. Nothing of this exists until a stream is lost.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from transport.api import RequestStream, WorkerConnection
from transport.errors import ConnectionClosed
from transport.messages import Continuation, Error, ErrorCode, Submit

from .errors import NoReplica, Unroutable
from .health import RetryBudget

__all__ = ["RoutedStream", "Replicas", "RETRYABLE", "SubmitFactory"]

log = logging.getLogger("quicserve.routing")

# Worker-side errors that mean "this worker could not take it", not "bad request"; INTERNAL too
# (a failed engine step): before the first token nothing was sent, so another replica may answer.
RETRYABLE = frozenset({ErrorCode.CONNECTION_LOST, ErrorCode.SHUTTING_DOWN, ErrorCode.OVERLOADED, ErrorCode.INTERNAL})
# ... of those, the ones that count against the replica's health (not load, not a drain)
_FAILURES = frozenset({ErrorCode.CONNECTION_LOST, ErrorCode.INTERNAL})
# ... and the ones the retry budget bounds: a replica that did the work and failed, or refused it
# (a dead or draining one does no work: moving its requests adds no load, and is always done)
_BUDGETED = frozenset({ErrorCode.INTERNAL, ErrorCode.OVERLOADED})

SubmitFactory = Callable[[int], Submit]
_RESUMES = "continuation"  # the Hello capability of a worker that takes Submit.continuation


class Replicas(Protocol):
    """What a routed stream asks of its pool (:class:`~gateway.routing.pool.ModelPool`)."""

    retries: int
    on_retry: Callable[[], None] | None
    budget: RetryBudget
    active: Callable[[], int]
    unstarted: dict[WorkerConnection, dict[RoutedStream, None]]  # per replica: its requests with no token yet

    def choose(self, model: str, subject: object, exclude: tuple[WorkerConnection, ...],
               make_submit: SubmitFactory | None) -> WorkerConnection | None: ...


    def failed(self, conn: WorkerConnection | None, model: str) -> None:
        """``conn`` failed a request (before its first token, or lost it mid-stream): its breaker counts it."""
        ...


class RoutedStream:
    """One request's current stream and the replicas it has tried."""

    __slots__ = ("_pool", "model", "subject", "_make", "stream", "_tried", "_retries_left", "started", "_cancelled",
                 "conn", "on_moved", "_waiting", "_retry_token", "_cont")

    def __init__(self, pool: Replicas, model: str, subject: object, make_submit: SubmitFactory) -> None:
        self._pool = pool
        self.model = model
        self.subject = subject  # the pipeline's request, opaque here (the pool describes it to a policy)
        self._make = make_submit
        self.stream: RequestStream | None = None
        self._tried: tuple[WorkerConnection, ...] = ()
        self._retries_left = pool.retries
        self.started = False  # a token (or the finish) arrived: the request can no longer move
        self._cancelled = False
        self.conn: WorkerConnection | None = None
        self.on_moved: Callable[[], None] | None = None  # the consumer reads :attr:`stream` again
        self._waiting: dict[RoutedStream, None] | None = None  # the pool's not-started set it is in
        self._retry_token = False  # holds one of the retry budget's tokens (until close)
        self._cont: Continuation | None = None  # what the client had when the request last resumed

    def submit(self, cont: Continuation | None = None) -> None:
        """Open the stream on the replica the policy picks (``cont``: resume there from it, on a
        replica that can); raises a RoutingError if none takes it."""
        pool = self._pool
        make = self._make if cont is None else _resumed(self._make, cont)
        while True:
            conn = pool.choose(self.model, self.subject, self._tried, make)
            if conn is None:
                raise NoReplica(self.model)
            self._tried += (conn,)
            if cont is not None and _RESUMES not in conn.peer_hello.capabilities:
                continue  # an older worker would ignore the continuation and start over
            try:
                self.stream = conn.submit(make(conn.next_request_id()))
            except ConnectionClosed as e:  # closed, draining or full under our feet: try another worker
                log.info("submit to a worker failed (%s); trying another", e)
                continue
            except ValueError as e:  # the request breaks a wire rule (an encoder check): no worker can take it
                raise Unroutable(str(e)) from None
            self.conn = conn
            if cont is None:
                self._wait_on(conn)
            return

    def _wait_on(self, conn: WorkerConnection) -> None:
        """Join ``conn``'s set of requests that have no token yet (what a rebalance may move)."""
        waiting = self._pool.unstarted
        w = waiting.get(conn)
        if w is None:
            w = waiting[conn] = {}
        w[self] = None
        self._waiting = w

    def start(self) -> None:
        """The first token (or the finish) arrived: the request stays where it is."""
        self.started = True
        self._unwait()

    def _unwait(self) -> None:
        w = self._waiting
        if w is not None:
            self._waiting = None
            w.pop(self, None)

    def move(self, conn: WorkerConnection) -> bool:
        """Move a request that has not started to ``conn`` (a replica that became ready): the old
        worker's request is cancelled and whatever it sends is ignored; the consumer is told to
        read the new stream. False (nothing changed) if ``conn`` refuses it."""
        assert not self.started and self.on_moved is not None
        old_stream, old_conn = self.stream, self.conn
        try:
            stream = conn.submit(self._make(conn.next_request_id()))
        except (ConnectionClosed, ValueError):
            return False
        self._unwait()
        if old_stream is not None:
            old_stream.unlisten()
            old_stream.cancel()
        self.stream, self.conn = stream, conn
        self._tried = tuple(c for c in self._tried if c is not old_conn) + (conn,)
        self._wait_on(conn)
        self.on_moved()
        return True

    def retry(self, final: object) -> bool:
        """``final`` ended the stream: True if it was a retryable error and the request moved to
        another replica (read :attr:`stream` again) -- before its first token to start over there,
        after it to resume from what the client has -- False if ``final`` is the answer."""
        if self._cancelled or type(final) is not Error or final.code not in RETRYABLE:
            return False
        cont = self._continuation() if self.started else None
        if self.started and cont is None:
            return False  # the lost stream's history is gone: it cannot resume
        pool = self._pool
        if final.code in _FAILURES:
            pool.failed(self.conn, self.model)
        if self._retries_left <= 0:
            return False
        if final.code in _BUDGETED and not self._retry_token:
            if not pool.budget.acquire(pool.active()):
                return False  # the gateway's retry budget is spent: this error is the answer
            self._retry_token = True
        pool.budget.retries += 1
        self._retries_left -= 1
        if self._pool.on_retry is not None:
            self._pool.on_retry()
        self._unwait()
        try:
            self.submit(cont)
        except (NoReplica, Unroutable):
            return False  # no other replica: the client gets the original error
        if cont is None:
            log.info("worker failed before the first token (%s: %s); resubmitted", final.code.name, final.message)
        else:
            self._cont = cont
            pool.budget.failovers += 1
            log.info("worker lost after %d tokens (%s: %s); resumed on another replica", len(cont.token_ids),
                     final.code.name, final.message)
        return True

    def _continuation(self) -> Continuation | None:
        """What the client has of this request: the tokens of earlier failovers, then those the
        lost stream received (None when its connection forgot them)."""
        got = self.stream.received() if self.stream is not None else None
        if got is None:
            return None
        prev = self._cont
        if prev is None:
            return Continuation(tuple(got.token_ids), got.text_bytes)
        return Continuation(prev.token_ids + tuple(got.token_ids), prev.text_bytes + got.text_bytes)

    def cancel(self) -> None:
        self._cancelled = True
        if self.stream is not None:
            self.stream.cancel()

    def close(self) -> None:
        """The request ended (its consumer is done with it): it leaves the waiting set, nothing
        moves it any more, and a worker request still open is cancelled."""
        self.on_moved = None
        if self._retry_token:
            self._retry_token = False
            self._pool.budget.release()
        w = self._waiting
        if w is not None:
            self._waiting = None
            w.pop(self, None)
        stream = self.stream
        if stream is not None and not stream.done:
            self._cancelled = True
            stream.cancel()


def _resumed(make: SubmitFactory, cont: Continuation) -> SubmitFactory:
    """``make``'s Submits, resuming from ``cont``."""

    def submit(request_id: int) -> Submit:
        sub = make(request_id)
        sub.continuation = cont
        return sub

    return submit
