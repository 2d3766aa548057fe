"""A TCP (or Unix) channel whose bytes pass through a :class:`~transport.tls.TlsSession`.

The endpoint comes in only once the handshake has verified the peer: a worker makes
its connection (and sends its HELLO) for a verified gateway alone, and a gateway's
HELLO waits for a verified worker. Every refusal is one log line on the worker
(``transport.tls``: the peer's address and :func:`~transport.tls.explain`'s reason);
on the gateway it ends the connection attempt with that reason
(:func:`~transport.client.connect` raises it, the supervisor logs it). A peer that
speaks plain quicserve frames is named as such, and a plain gateway is told in a
plain ERROR frame why it was refused, so its own log says it too.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable

from .channel import ChannelBase
from .endpoint import Endpoint
from .errors import TlsFailure
from .messages import Error, ErrorCode
from .tls import FIRST_READ, TlsSession, looks_like_frames
from .wire import FrameEncoder

__all__ = ["TlsChannel"]

log = logging.getLogger("transport.tls")

_PLAIN_REFUSAL = FrameEncoder().encode(Error(0, ErrorCode.PROTOCOL, (
    "this worker requires mutual TLS and the gateway connected in plain TCP: configure transport_tls_cert, "
    "transport_tls_key and transport_tls_ca on the gateway")))


def _nothing(data: bytes) -> bytes:
    return b""


def _drop(data: bytes) -> None:
    return None


def _nothing_read(size: int = 0) -> bytes:
    return b""


class TlsChannel(ChannelBase):
    """One TLS connection; plaintext to and from its endpoint (a :class:`~transport.endpoint.ByteSink`)."""

    def __init__(self, make_endpoint: Callable[[], Endpoint], session: Callable[[], TlsSession],
                 server_side: bool, handshake_timeout: float = 10.0) -> None:
        self._make_endpoint = make_endpoint
        self._new_session = session
        self._server_side = server_side
        self._handshake_timeout = handshake_timeout
        self.session: TlsSession | None = None
        self.endpoint: Endpoint | None = None
        self.peer = ""
        self._timer: asyncio.TimerHandle | None = None
        self._seen_bytes = False
        self._failed = False
        self._open = False  # verified and attached: the hot paths below, bound methods cached
        self._feed: Callable[[bytes], object] = _drop
        self._read: Callable[[int], bytes] = _nothing_read
        self._encrypt: Callable[[bytes], bytes] = _nothing
        self._deliver: Callable[[bytes], None] = _drop
        self._send: Callable[[bytes], object] = _drop
        self._live: TlsSession  # ``session`` once verified (read only while ``_open``)
        self._incoming: ssl.MemoryBIO  # its ``incoming``

    # --- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.peer = self._connected(transport)
        try:
            self.session = self._new_session()
            self.session.start()
        except Exception as exc:  # noqa: BLE001 - a context that fails here fails this connection alone
            self._fail(f"TLS unavailable: {exc}")
            return
        self._timer = asyncio.get_running_loop().call_later(self._handshake_timeout, self._handshake_late)
        self._transmit()

    def data_received(self, data: bytes) -> None:
        if self._open:  # per record: TlsSession.decrypt's usual case, in this frame; the rest in _read_more
            self._feed(data)
            try:
                plain = self._read(FIRST_READ)
            except ssl.SSLError as exc:
                self._read_more(b"", exc)
                return
            if 0 < len(plain) < FIRST_READ and not self._incoming.pending:
                self._deliver(plain)  # one whole record, all read, nothing after it
            else:
                self._read_more(plain, None)
            return
        session = self.session
        if session is None or self._failed:
            return
        if not self._seen_bytes:
            self._seen_bytes = True
            if looks_like_frames(data):
                self._refuse_plain()
                return
        try:
            plain, just = session.receive(data)
        except TlsFailure as exc:
            self._transmit()  # our alert, if OpenSSL wrote one
            self._fail(str(exc))
            return
        if just:
            self._verified()
        self._transmit()
        if plain and self.endpoint is not None:
            self.endpoint.data_received(plain)
        if session.closed and self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._open = False
        self._cancel_timer()
        if self.endpoint is not None:
            self.endpoint.channel_lost(f"connection lost: {exc}" if exc else "peer closed the connection")
        elif self._server_side and not self._seen_bytes:  # a TCP probe (Kubernetes tcpSocket): not a refusal
            self._failed = True
            log.debug("gateway at %s closed without a byte", self.peer)
        elif not self._failed:
            self._failed = True
            why = f"the connection was lost during the TLS handshake{f': {exc}' if exc else ''}"
            self._report(why + (" (the peer may require a pre-shared key or refuse this side's certificate)"
                                if not self._server_side else ""))

    # --- ByteSink -------------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if self._open:
            try:
                self._send(self._encrypt(data))
            except TlsFailure as exc:
                self._fail(str(exc))
            return
        if self.session is None or self.transport is None or self.transport.is_closing():
            return
        try:
            self.session.send(data)
        except TlsFailure as exc:
            self._fail(str(exc))
            return
        self._transmit()

    def close(self) -> None:
        self._open = False
        if self.transport is not None and not self.transport.is_closing():
            if self.session is not None:
                self.session.close()
                self._transmit()
            self.transport.close()

    # --- internals ------------------------------------------------------------------------------

    def _read_more(self, first: bytes, exc: ssl.SSLError | None) -> None:
        """The verified connection's reads beyond one whole small record: its rest and the records after
        it, a record not whole yet, the peer's close_notify, a failure. Bytes OpenSSL wrote while reading
        (an alert, a reply to a post-handshake message) go out here, and from the usual case with the
        next write (:meth:`TlsSession.encrypt` sends all that waits)."""
        live = self._live
        try:
            plain = live.read_failed(exc) if exc is not None else live.rest(first)
        except TlsFailure as failure:
            self._transmit()  # our alert, if OpenSSL wrote one
            self._fail(str(failure))
            return
        if plain:
            self._deliver(plain)
        if live.outgoing.pending:
            self._transmit()
        if live.closed and self.transport is not None:  # the peer's close_notify
            self._open = False
            self.transport.close()

    def _transmit(self) -> None:
        if self.session is not None and self.transport is not None and not self.transport.is_closing():
            out = self.session.data_to_send()
            if out:
                self.transport.write(out)

    def _verified(self) -> None:
        self._cancel_timer()
        assert self.session is not None
        if self._server_side:
            log.info("gateway %s: TLS verified (%s) over %s %s", self.peer, self.session.peer_subject() or "no subject",
                     self.session.version(), self.session.suite())
        self.endpoint = ep = self._make_endpoint()
        ep.peer = self.peer
        assert self.transport is not None
        self._live = self.session
        self._feed, self._read, self._incoming = self.session.feed, self.session.read, self.session.incoming
        self._encrypt = self.session.encrypt
        self._deliver, self._send = ep.data_received, self.transport.write
        self._open = True
        ep.attach(self)

    def _refuse_plain(self) -> None:
        if self._server_side:
            if self.transport is not None:
                self.transport.write(_PLAIN_REFUSAL)  # in plain frames, so the gateway can log why
            self._fail("the gateway spoke plain TCP and this worker requires mutual TLS: configure "
                       "transport_tls_cert, transport_tls_key and transport_tls_ca on the gateway")
        else:
            self._fail("the worker speaks plain TCP and this gateway requires mutual TLS: configure "
                       "transport_tls_cert, transport_tls_key and transport_tls_ca on the worker")

    def _handshake_late(self) -> None:
        self._timer = None
        if self.endpoint is None:
            self._fail(f"no TLS handshake within {self._handshake_timeout:g}s")

    def _fail(self, why: str) -> None:
        self._open = False
        if self._failed:
            return
        self._failed = True
        self._cancel_timer()
        self._report(why)
        if self.transport is not None:
            self.transport.close()

    def _report(self, why: str) -> None:
        if self._server_side and self.endpoint is None:
            log.warning("TLS handshake with the gateway at %s failed: %s", self.peer, why)
        elif self._server_side:
            log.warning("gateway %s: %s; disconnected", self.peer, why)
        else:  # the gateway's connect() raises it, and the supervisor logs it
            self._make_endpoint().channel_lost(f"TLS: {why}")

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
