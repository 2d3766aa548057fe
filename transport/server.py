"""Worker side: :func:`serve` returns a :class:`~transport.api.Server`.

Who may connect is :mod:`transport.security`'s: ``serve`` refuses to listen beyond loopback
without authentication (default deny), wraps each connection in TLS when certificates are
configured and hands each new core the pre-shared key. A gateway refused or disconnected
for breaking the protocol is one warning here (``transport.server``; TLS refusals:
``transport.tls``), with its address and the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import stat
from typing import Any

from .api import WorkerHandler
from .endpoint import Endpoint
from .errors import SecurityConfigError
from .flow import (
    CancelReceived,
    ConnectionEnded,
    CreditResumed,
    Event,
    FlowConnection,
    KvSubscribed,
    PeerHello,
    SubmitReceived,
    SubmitRefused,
)
from .hold import ResultHold
from .messages import Error, ErrorCode, Finish, Hello, KvEvents, Stats, TokenBatch
from .security import NO_SECURITY, PskKeys, TlsContexts, TransportSecurity
from .select import choose
from .tcp import SessionFactory, listen_stream
from .tls import TlsSession

__all__ = ["serve", "WorkerServer", "ServerConnectionImpl"]

log = logging.getLogger("transport.server")


class ServerConnectionImpl:
    """A worker's view of one gateway connection (implements ``ServerConnection``). Its sends go
    through :class:`~transport.hold.ResultHold`, which holds whole results (``Submit.buffered``)."""

    def __init__(self, server: WorkerServer, core: FlowConnection, loop: asyncio.AbstractEventLoop) -> None:
        self.core = core
        self.hold = ResultHold(core)
        self.endpoint = Endpoint(core, loop, self._on_events, self.hold.flush)
        self.peer_hello: Hello = Hello()
        self.closed = False
        self._server = server
        self._handler = server.handler

    def send_tokens(self, batch: TokenBatch) -> None:
        self.hold.send_tokens(batch)
        self.endpoint.flush_soon()

    def send_finish(self, finish: Finish) -> None:
        self.hold.send_finish(finish)
        self.endpoint.flush_soon()

    def send_error(self, error: Error) -> None:
        self.hold.send_error(error)
        self.endpoint.flush_soon()
        self.endpoint.deliver([])

    def send_stats(self, stats: Stats) -> None:
        self.hold.send_stats(stats)
        self.endpoint.flush_soon()

    def send_kv_events(self, events: KvEvents) -> None:
        self.core.send_kv_events(events)
        self.endpoint.flush_soon()

    def credit(self, request_id: int) -> int:
        return self.core.credit(request_id)

    def goodbye(self, reason: str = "") -> None:
        """Tell the gateway we are draining (new Submits get SHUTTING_DOWN)."""
        self.core.goodbye(reason)
        self.endpoint.flush_soon()

    @property
    def in_flight(self) -> int:
        return self.core.in_flight

    def close(self) -> None:
        self.hold.flush()  # results already produced go out before the end
        self.endpoint.close("worker closed the connection")

    def _on_events(self, events: list[Event]) -> None:
        self.hold.observe(events)  # before the engine sees them: a held request opens held
        h = self._handler
        for ev in events:
            if isinstance(ev, SubmitReceived):
                try:
                    h.on_submit(self, ev.submit)
                except Exception as exc:  # a handler bug must still end the request once
                    log.exception("on_submit failed for request %d", ev.submit.request_id)
                    self.hold.send_error(
                        Error(ev.submit.request_id, ErrorCode.INTERNAL, f"worker error: {exc}")
                    )
            elif isinstance(ev, CancelReceived):
                h.on_cancel(self, ev.request_id)
            elif isinstance(ev, SubmitRefused):
                log.warning("request %d refused, its SUBMIT did not decode: %s", ev.request_id, ev.reason)
            elif isinstance(ev, CreditResumed):
                h.on_credit(self, ev.request_id, ev.available)
            elif isinstance(ev, KvSubscribed):
                h.on_kv_subscribe(self)
            elif isinstance(ev, PeerHello):
                self.peer_hello = ev.hello
            elif isinstance(ev, ConnectionEnded):
                self._log_end(ev.error)
                self.closed = True
                self._server._forget(self)
                h.on_disconnect(self, ev.open_requests)


    def _log_end(self, error: Error) -> None:
        peer = self.endpoint.peer or "?"
        if self.core.peer_hello is None:
            if error.code == ErrorCode.PROTOCOL:
                log.warning("refused the gateway at %s: %s", peer, error.message)
            else:
                log.debug("gateway at %s left before the handshake: %s", peer, error.message)
        elif error.code == ErrorCode.PROTOCOL:
            log.warning("gateway %s (%s): %s; disconnected", peer, self.peer_hello.identity or "?", error.message)


class WorkerServer:
    """Listens on one URL; one :class:`ServerConnectionImpl` per gateway connection."""

    def __init__(
        self, handler: WorkerHandler, identity: str, heartbeat_interval: float, dead_after: float,
        psk: PskKeys | None = None,
    ) -> None:
        self.handler = handler
        self.psk = psk
        self.identity = identity
        self.heartbeat_interval = heartbeat_interval
        self.dead_after = dead_after
        self.connections: set[ServerConnectionImpl] = set()
        self._address = ""
        self._listener: Any = None
        self._unix_path: str | None = None
        self._loop = asyncio.get_running_loop()

    @property
    def address(self) -> str:
        return self._address

    def _new_endpoint(self) -> Endpoint:
        hello = self.handler.hello()
        if self.identity:  # everything else (capacity included) is the handler's
            hello = dataclasses.replace(hello, role="worker", identity=self.identity)
        core = FlowConnection(
            "worker",
            hello,
            self._loop.time(),
            heartbeat_interval=self.heartbeat_interval,
            dead_after=self.dead_after,
            psk=self.psk.get() if self.psk is not None else None,
        )
        conn = ServerConnectionImpl(self, core, self._loop)
        self.connections.add(conn)
        return conn.endpoint

    def _forget(self, conn: ServerConnectionImpl) -> None:
        self.connections.discard(conn)

    async def drain(self, timeout: float) -> None:
        """Stop accepting, say Goodbye to every gateway, wait (bounded) for in-flight requests."""
        if isinstance(self._listener, asyncio.Server):
            self._listener.close()  # existing connections stay open
        for conn in list(self.connections):
            conn.goodbye("worker draining")
        deadline = self._loop.time() + timeout
        while any(c.in_flight for c in self.connections) and self._loop.time() < deadline:
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            if isinstance(self._listener, asyncio.Server):
                await self._listener.wait_closed()
            self._listener = None
        for conn in list(self.connections):
            conn.close()
        if self._unix_path:
            with contextlib.suppress(OSError):
                os.unlink(self._unix_path)
            self._unix_path = None
        await asyncio.sleep(0)


async def serve(
    url: str,
    handler: WorkerHandler,
    *,
    identity: str = "",
    heartbeat_interval: float = 1.0,
    dead_after: float = 5.0,
    rdma_required: bool = False,
    security: TransportSecurity | None = None,
) -> WorkerServer:
    """Listen on ``url`` (port 0 allowed; see ``server.address``). ``security``: who may connect
    (:mod:`transport.security`); :class:`~transport.errors.SecurityConfigError` when it refuses to
    run as configured (the message says what to set)."""
    sec = security or NO_SECURITY
    problems = sec.problems(url)
    if problems:
        raise SecurityConfigError("; ".join(f"{key}: {why}" for key, why in problems))
    choice = choose(url, rdma_required=rdma_required)
    refusal = sec.refusal(choice.target, "worker")
    if refusal:
        raise SecurityConfigError(refusal)
    psk = PskKeys(sec.psk_file) if sec.psk else None
    if psk is not None:
        psk.get()  # a key that does not load stops us here, not at the first gateway
    tls: SessionFactory | None = None
    if sec.tls:
        contexts = TlsContexts(sec, server_side=True)
        contexts.get()

        def tls() -> TlsSession:
            return TlsSession(contexts.get(), server_side=True)

    server = WorkerServer(handler, identity, heartbeat_interval, dead_after, psk)
    t = choice.target
    if choice.kind == "rdma":
        from .rdma import rdma_listen

        server._listener = await rdma_listen(t.host, t.port, server._new_endpoint)
        server._address = f"rdma://{t.host}:{t.port}"
        log.info("listening on %s (transport authentication: %s)", server._address, sec.mode)
        return server
    if t.scheme == "unix":
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.stat(t.path).st_mode):
                os.unlink(t.path)  # a stale socket from a previous run
        server._unix_path = t.path
    server._listener, server._address = await listen_stream(
        t.scheme, t.host, t.port, t.path, server._new_endpoint, tls
    )
    log.info("listening on %s (transport authentication: %s)", server._address, sec.mode)
    return server
