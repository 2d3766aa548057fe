"""Gateway side: :func:`connect` returns a :class:`~transport.api.WorkerConnection`.

``security`` (:mod:`transport.security`) decides how: over TLS when certificates are
configured, with the pre-shared key in the HELLO exchange when one is; an unauthenticated
URL beyond loopback is refused (default deny). Every refusal ends ``connect`` with an error
that says which side refused what; a worker that breaks the protocol later is one warning
(``transport.client``) before the connection ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from .api import Received, RequestStream, WorkerConnection
from .client_stream import ClientStream, Collected, deliver_tokens
from .endpoint import Endpoint
from .errors import ConnectError, ConnectionClosed, ProtocolError, SecurityConfigError
from .flow import (
    ConnectionEnded,
    Event,
    FlowConnection,
    GoodbyeReceived,
    KvEventsReceived,
    PeerHello,
    RequestEnded,
    StatsReceived,
    TokensReceived,
)
from .hold import window
from .messages import Error, ErrorCode, Hello, KvEvents, Stats, Submit
from .psk import read_key_file
from .received import ReceivedLog
from .security import NO_SECURITY, TlsContexts, TransportSecurity
from .select import choose
from .tcp import SessionFactory, open_stream
from .tls import TlsSession

__all__ = ["connect", "ClientConnection", "ClientStream", "Collected"]

log = logging.getLogger("transport.client")
_CANCELLED = ErrorCode.CANCELLED  # a stream we cancelled goes nowhere else: what it received is not kept


class ClientConnection:
    """A gateway's connection to one worker (implements ``WorkerConnection``)."""

    def __init__(self, core: FlowConnection, loop: asyncio.AbstractEventLoop) -> None:
        self.core = core
        self.loop = loop
        self.endpoint = Endpoint(core, loop, self._on_events)
        self.peer_hello: Hello = Hello()
        self.latest_stats: Stats | None = None
        self.closed = False
        self.draining = False
        self._hello: asyncio.Future[None] = loop.create_future()
        self._streams: dict[int, ClientStream] = {}
        self._next_id = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.history = ReceivedLog()  # what a stream that ends in an error had received (failover)
        self._lost: set[int] = set()  # the streams open when the connection ended (their part is in history)
        self._resumable = 0  # open streams that may resume elsewhere (not buffered): history is kept for them
        # Consumed tokens are handed to the core in batches of this size; the core
        # itself grants Credit at half a window, so this sends exactly the same frames.
        self.grant_batch = max(1, core.local_hello.initial_credit // 2)
        self.kv_listener: Callable[[KvEvents], None] | None = None  # who reads the worker's KV events

    def subscribe_kv(self, listener: Callable[[KvEvents], None]) -> None:
        """Ask the worker (its Hello lists ``"kv_events"``) for its whole prefix cache, then every
        change, each batch to ``listener``; again: a resync."""
        self.kv_listener = listener
        self.core.subscribe_kv()
        self.endpoint.flush_soon()

    # --- WorkerConnection --------------------------------------------------------------------

    def next_request_id(self) -> int:
        while True:
            self._next_id = self._next_id % 0xFFFF_FFFF + 1
            if self._next_id not in self._streams and not self.core.is_open(self._next_id):
                return self._next_id

    def submit(self, submit: Submit) -> RequestStream:
        if self.closed:
            raise ConnectionClosed("connection to worker is closed")
        self.core.submit(submit, window(submit))  # a whole result (Submit.buffered): credit does not apply
        p = submit.params
        if submit.buffered:  # a whole result starts over if lost: no mark, nothing kept for it
            mark = -1
        else:  # the log's position (ReceivedLog.position, written out): the stream's mark
            h = self.history
            mark = h.base + len(h.batches)
            self._resumable += 1
        stream = ClientStream(self, submit.request_id, bool(p.logprobs or p.top_logprobs), mark)
        streams = self._streams
        if not streams:
            self._idle.clear()
        streams[submit.request_id] = stream
        self.endpoint.flush_soon()
        return stream

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    async def drain(self, timeout: float) -> None:
        self.core.goodbye("gateway draining")
        self.endpoint.flush_soon()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        await self.close()

    async def close(self) -> None:
        self.endpoint.close("connection closed by the gateway")
        await self.wait_closed()
        await asyncio.sleep(0)  # the channel itself closes on the next loop iteration

    async def wait_closed(self) -> None:
        await self.endpoint.closed_event.wait()

    # --- internals ---------------------------------------------------------------------------

    def consumed(self, rid: int, tokens: int) -> None:
        self.core.consumed(rid, tokens)
        if self.core.has_data_to_send:
            self.endpoint.flush_soon()

    def cancel_request(self, rid: int) -> None:
        if rid in self._streams:
            self.endpoint.deliver(self.core.cancel(rid))

    def received(self, rid: int, mark: int) -> Received | None:
        """What stream ``rid`` (opened at ``mark``) had received, from the log of a connection that
        ended (it no longer changes); None while it lives (an error then keeps its own at once)."""
        return self.history.frozen_slice(rid, mark) if rid in self._lost else None

    def _on_events(self, events: list[Event]) -> None:
        streams = self._streams
        for ev in events:
            t = type(ev)  # exact types: the events are final dataclasses, and this runs per frame
            if t is RequestEnded:
                res = ev.result  # type: ignore[union-attr]
                st = streams.pop(res.request_id, None)
                if st is not None:
                    if st.mark >= 0:
                        if type(res) is Error and res.code != _CANCELLED:
                            if self.core.closed:  # history no longer changes: read later, if asked
                                self._lost.add(st.request_id)
                            else:  # history moves on: keep its part now
                                st._received = self.history.slice(st.request_id, st.mark)
                        self._resumable -= 1
                        if not self._resumable and not self.core.closed:
                            self.history.forget()
                    st._end(res)
                if not streams:
                    self._idle.set()
            elif t is TokensReceived:
                batch = ev.batch  # type: ignore[union-attr]
                deliver_tokens(streams, batch, self.grant_batch)
                if self._resumable:  # ReceivedLog.add, written out (once per engine step)
                    kept = self.history.batches
                    kept.append(batch)
                    if len(kept) >= self.history.trim_at:
                        self.history.trim([s.mark for s in streams.values() if s.mark >= 0])
            elif t is KvEventsReceived:
                if self.kv_listener is not None:
                    self.kv_listener(ev.events)  # type: ignore[union-attr]
            elif isinstance(ev, StatsReceived):
                self.latest_stats = ev.stats
            elif isinstance(ev, PeerHello):
                self.peer_hello = ev.hello
                if not self._hello.done():
                    self._hello.set_result(None)
            elif isinstance(ev, GoodbyeReceived):
                self.draining = True
            elif isinstance(ev, ConnectionEnded):
                if ev.error.code == ErrorCode.PROTOCOL and self._hello.done():
                    log.warning("worker %s (%s): %s; disconnected", self.endpoint.peer or "?",
                                self.peer_hello.identity or "?", ev.error.message)
                self.closed = True
                for st in list(streams.values()):  # the core ended them; belt and braces
                    st._end(Error(st.request_id, ErrorCode.CONNECTION_LOST, ev.error.message))
                streams.clear()
                self._idle.set()
                if not self._hello.done():
                    exc_type = ProtocolError if ev.error.code == ErrorCode.PROTOCOL else ConnectError
                    self._hello.set_exception(exc_type(ev.error.message))


async def connect(
    url: str,
    *,
    identity: str = "",
    timeout: float = 10.0,
    heartbeat_interval: float = 1.0,
    dead_after: float = 5.0,
    rdma_required: bool = False,
    initial_credit: int = 256,
    security: TransportSecurity | None = None,
) -> WorkerConnection:
    """Connect to a worker at ``url`` and complete the HELLO exchange (authenticated as ``security``
    says; :class:`~transport.errors.SecurityConfigError` when it refuses to, or cannot load its files)."""
    sec = security or NO_SECURITY
    problems = sec.problems(url)
    if problems:
        raise SecurityConfigError("; ".join(f"{key}: {why}" for key, why in problems))
    choice = choose(url, rdma_required=rdma_required)
    refusal = sec.refusal(choice.target, "gateway")
    if refusal:
        raise SecurityConfigError(refusal)
    try:
        psk = read_key_file(sec.psk_file) if sec.psk else None
    except ValueError as exc:
        raise SecurityConfigError(str(exc)) from None
    tls: SessionFactory | None = None
    if sec.tls:
        ctx = TlsContexts(sec, server_side=False).get()

        def tls() -> TlsSession:
            return TlsSession(ctx, server_side=False)

    loop = asyncio.get_running_loop()
    hello = Hello(role="gateway", identity=identity, initial_credit=initial_credit)
    core = FlowConnection(
        "gateway", hello, loop.time(), heartbeat_interval=heartbeat_interval, dead_after=dead_after, psk=psk,
        handshake_timeout=timeout,
    )
    conn = ClientConnection(core, loop)
    t = choice.target
    try:
        async with asyncio.timeout(timeout):
            if choice.kind == "rdma":
                from .rdma import rdma_connect

                await rdma_connect(t.host, t.port, lambda: conn.endpoint)
            else:
                await open_stream(t.scheme, t.host, t.port, t.path, lambda: conn.endpoint, tls)
            await conn._hello
            if conn.closed:  # the worker broke the protocol right after its HELLO (logged above)
                assert conn.core.close_error is not None
                raise ProtocolError(conn.core.close_error.message)
    except TimeoutError:
        _abandon(conn, "connect timeout")
        raise ConnectError(f"{url}: no HELLO from the worker within {timeout}s") from None
    except OSError as exc:
        _abandon(conn, "connect failed")
        raise ConnectError(f"{url}: {exc.strerror or exc}") from exc
    except BaseException:  # protocol error at HELLO, or the caller gave up: leave nothing open
        _abandon(conn, "connect aborted")
        raise
    return conn


def _abandon(conn: ClientConnection, why: str) -> None:
    """Close a connection that never got going; the HELLO future it fails is the error raised
    here, so it is read (not left for asyncio to log as "never retrieved")."""
    conn.endpoint.close(why)
    if conn._hello.done() and not conn._hello.cancelled():
        conn._hello.exception()
