"""Model pools: which ready workers serve which model, and which one gets a request.

How it works: the supervisor :meth:`ModelPool.add`\\ s a connected worker under
the model names it announced in its Hello and :meth:`ModelPool.remove`\\ s it when
it dies. :meth:`ModelPool.open` picks the least-loaded ready worker serving the
model (:func:`load_score`: the larger of what this gateway has in flight there
and what the worker last reported running, plus its queue) and returns a
:class:`RoutedStream`. If that worker dies, drains or is overloaded *before the
first token*, the stream resubmits on another worker, transparently, up to
``retries`` times; after the first token the error goes to the client.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeGuard

from transport.api import RequestStream, StreamEvent, WorkerConnection
from transport.client import Collected
from transport.errors import ConnectionClosed
from transport.messages import Error, ErrorCode, Finish, Submit, TokenEntry

from ..errors import APIError

__all__ = ["ModelPool", "RoutedStream", "load_score", "RETRYABLE"]

log = logging.getLogger("quicserve.routing")

# Worker-side errors that mean "this worker could not take it", not "bad request".
RETRYABLE = frozenset({ErrorCode.CONNECTION_LOST, ErrorCode.SHUTTING_DOWN, ErrorCode.OVERLOADED})

SubmitFactory = Callable[[int], Submit]


def load_score(conn: WorkerConnection) -> int:
    """Lower is better. Uses this gateway's in-flight count and the worker's Stats."""
    s = conn.latest_stats
    if s is None:
        return conn.in_flight
    return max(conn.in_flight, s.running + s.queue_depth) + s.queue_depth


class ModelPool:
    """Ready worker connections by served model name."""

    def __init__(self, retries: int = 1, on_retry: Callable[[], None] | None = None) -> None:
        self.retries = retries
        self.on_retry = on_retry
        self._by_model: dict[str, list[WorkerConnection]] = {}
        self._known: set[str] = set()  # every model ever announced (404 vs 503)

    # -- membership (supervisor) ------------------------------------------------
    def add(self, conn: WorkerConnection, models: Iterable[str] | None = None) -> None:
        names = tuple(models) if models is not None else tuple(conn.peer_hello.models)
        for name in names:
            self._known.add(name)
            conns = self._by_model.setdefault(name, [])
            if conn not in conns:
                conns.append(conn)

    def remove(self, conn: WorkerConnection) -> None:
        for name in list(self._by_model):
            conns = self._by_model[name]
            if conn in conns:
                conns.remove(conn)
            if not conns:
                del self._by_model[name]

    def connections(self) -> list[WorkerConnection]:
        seen: dict[int, WorkerConnection] = {}
        for conns in self._by_model.values():
            for c in conns:
                seen.setdefault(id(c), c)
        return list(seen.values())

    # -- queries (handlers) --------------------------------------------------------
    def models(self) -> list[str]:
        """Models with at least one ready (open) worker, sorted."""
        return sorted(m for m, conns in self._by_model.items() if any(not c.closed for c in conns))

    def ready_workers(self) -> int:
        return sum(1 for c in self.connections() if not c.closed)

    def choose(self, model: str, exclude: tuple[WorkerConnection, ...] = ()) -> WorkerConnection | None:
        conns = self._by_model.get(model)
        if not conns:
            return None
        if len(conns) == 1 and not exclude:  # the common single-worker case: no scoring
            c = conns[0]
            return None if c.closed or getattr(c, "draining", False) else c
        best: WorkerConnection | None = None
        best_score = 0
        for c in conns:
            if c.closed or c in exclude or getattr(c, "draining", False):  # draining: sent us Goodbye
                continue
            score = load_score(c)
            if best is None or score < best_score:
                best, best_score = c, score
        return best

    def open(self, model: str, make_submit: SubmitFactory) -> RoutedStream:
        """Submit to the least-loaded worker serving ``model``.

        Raises APIError 404 if no worker has ever announced the model (and
        some worker has announced something), 503 if none serving it is ready.
        """
        if model not in self._known and self._known:
            raise APIError(404, f"The model `{model}` does not exist.", "invalid_request_error",
                           "model", "model_not_found")
        routed = RoutedStream(self, model, make_submit)
        routed._submit_next()
        return routed


def _unavailable(model: str) -> APIError:
    return APIError(503, f"No worker serving `{model}` is ready; try again shortly.", "server_error",
                    None, "no_worker_available", retry_after=1.0)


class RoutedStream:
    """A request's stream that may move to another worker before its first token."""

    __slots__ = ("_pool", "_model", "_make", "_stream", "_tried", "_retries_left", "_started",
                 "_cancelled", "conn")

    def __init__(self, pool: ModelPool, model: str, make_submit: SubmitFactory) -> None:
        self._pool = pool
        self._model = model
        self._make = make_submit
        self._stream: RequestStream | None = None
        self._tried: tuple[WorkerConnection, ...] = ()
        self._retries_left = pool.retries
        self._started = False
        self._cancelled = False
        self.conn: WorkerConnection | None = None

    def _submit_next(self) -> None:
        while True:
            conn = self._pool.choose(self._model, self._tried)
            if conn is None:
                raise _unavailable(self._model)
            self._tried += (conn,)
            try:
                self._stream = conn.submit(self._make(conn.next_request_id()))
            except ConnectionClosed as e:  # closed, draining or full under our feet: try another worker
                log.info("submit to a worker failed (%s); trying another", e)
                continue
            except ValueError as e:  # the request breaks a wire rule (an encoder check): no worker can take it
                raise APIError(400, f"The request cannot be sent to a worker: {e}", "invalid_request_error",
                               None, "invalid_value") from None
            except Exception:  # a bug, not the worker's state: not a retryable 503
                log.exception("submit to a worker failed")
                raise APIError(500, "Internal server error.", "server_error", None, "internal_error") from None
            self.conn = conn
            return

    @property
    def done(self) -> bool:
        return self._stream is None or self._stream.done

    @property
    def started(self) -> bool:
        """A token (or the finish) has arrived: the request can no longer move."""
        return self._started

    @property
    def stream(self) -> RequestStream | None:
        """The current worker's stream (for consumers that use its optional push API)."""
        return self._stream

    def direct_next_events(self) -> Callable[[], Awaitable[list[StreamEvent]]]:
        """After :attr:`started`, the underlying stream's ``next_events`` (one call layer less)."""
        assert self._started and self._stream is not None
        return self._stream.next_events

    def _retryable(self, ev: object) -> TypeGuard[Error]:
        """An error before the first token that another worker may not have, with retries left."""
        return (type(ev) is Error and ev.code in RETRYABLE and not self._cancelled
                and self._retries_left > 0)

    def _resubmit(self, ev: Error) -> bool:
        """Move the request to another worker; False when there is none."""
        self._retries_left -= 1
        if self._pool.on_retry is not None:
            self._pool.on_retry()
        log.info("worker failed before the first token (%s: %s); resubmitting", ev.code.name, ev.message)
        try:
            self._submit_next()
        except APIError:
            return False
        return True

    async def next_events(self) -> list[StreamEvent]:
        assert self._stream is not None
        events = await self._stream.next_events()
        if self._started:
            return events
        ev = events[0]
        if self._retryable(ev):
            if self._resubmit(ev):
                return await self.next_events()
            return events  # no other worker: the client gets the original error
        if type(ev) is TokenEntry or type(ev) is Finish:
            self._started = True
        return events

    async def collect(self) -> Collected:
        """The whole request at once (text only, no logprobs), waking the caller once.

        Uses the stream's own ``collect()`` when it has one (the transport
        client buffers text deltas without waking anyone per engine step), else
        drains :meth:`next_events`. A retryable error before any token moves
        the request to another worker, as :meth:`next_events` does.
        """
        while True:
            res = await self.collect_nowait()
            if not self.retry(res):
                return res

    def collect_nowait(self) -> Awaitable[Collected]:
        """The current stream's whole result as a future (no retry: see :meth:`retry`)."""
        stream = self._stream
        assert stream is not None
        own = getattr(stream, "collect", None)
        if own is not None:
            return own()  # type: ignore[no-any-return]
        return asyncio.ensure_future(_collect_events(stream))

    def retry(self, res: Collected) -> bool:
        """After a collected result: True if it was a retryable error before any token and the
        request moved to another worker (collect again); False if ``res`` is the answer."""
        ev = res.final
        if not res.tokens and self._retryable(ev):
            if self._resubmit(ev):
                return True
            return False  # no other worker: the client gets the original error
        self._started = True
        return False

    def cancel(self) -> None:
        self._cancelled = True
        if self._stream is not None:
            self._stream.cancel()


async def _collect_events(stream: RequestStream) -> Collected:
    """:meth:`RoutedStream.collect` for a stream without its own ``collect()``."""
    parts: list[bytes] = []
    ntok = 0
    t_first = 0.0
    while True:
        for ev in await stream.next_events():
            if type(ev) is TokenEntry:
                parts.append(bytes(ev.text))
                ntok += len(ev.token_ids)
                t_first = t_first or time.perf_counter()
            else:
                return Collected(b"".join(parts), ntok, t_first, ev)  # type: ignore[arg-type]
