"""An HTTP/3 test client on aioquic's own client, and a gateway on the real pipeline to point it at.

:func:`h3_connect` yields an :class:`H3Client` (aioquic's asyncio protocol with an
:class:`~aioquic.h3.connection.H3Connection`); :meth:`H3Client.start` opens a
request stream and returns an :class:`H3Response` that fills as events arrive.
Sending before the handshake (``wait_connected=False`` with a session ticket)
puts the request in 0-RTT packets; ``client.early_data_accepted`` says, from the
client's side, whether the server took them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import HandshakeCompleted, QuicEvent, StopSendingReceived, StreamReset
from aioquic.tls import SessionTicket

from gateway.app import App
from gateway.http.quic_listener import QuicListener, start_quic_listener
from gateway.http.quic_settings import QuicSettings
from gateway.http.tls import SELF_SIGNED_CERT, SELF_SIGNED_KEY, load_or_create_tls
from gateway.http.types import Call, Request, ResponseSink
from gateway.routing.pool import ModelPool
from tests.gateway.doubles import ScriptedWorkerConnection

__all__ = ["H3Client", "H3Response", "Gateway", "h3_gateway", "h3_connect", "client_config", "chat_body",
           "make_cert"]


@dataclass
class H3Response:
    stream_id: int
    status: int = 0
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    chunks: list[bytes] = field(default_factory=list)
    first_byte_at: float | None = None  # perf_counter of the first response DATA
    reset: bool = False
    stop_sending: bool = False  # the server asked us to stop sending the request body
    done: asyncio.Event = field(default_factory=asyncio.Event)
    got_data: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def json(self) -> Any:
        return orjson.loads(self.body)

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k == name), None)


class H3Client(QuicConnectionProtocol):
    """aioquic client protocol speaking HTTP/3 (one H3Connection, many streams)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic)
        self.responses: dict[int, H3Response] = {}
        self.early_data_accepted: bool | None = None
        self.session_resumed: bool | None = None

    def start(self, method: str, path: str, body: bytes = b"", headers: list[tuple[bytes, bytes]] | None = None,
              *, transmit: bool = True) -> H3Response:
        sid = self._quic.get_next_available_stream_id()
        self.h3.send_headers(sid, [(b":method", method.encode()), (b":scheme", b"https"),
                                   (b":authority", b"127.0.0.1"), (b":path", path.encode()),
                                   *(headers or [])], end_stream=not body)
        if body:
            self.h3.send_data(sid, body, end_stream=True)
        resp = self.responses[sid] = H3Response(sid)
        if transmit:
            self.transmit()
        return resp

    async def request(self, method: str, path: str, body: bytes = b"",
                      headers: list[tuple[bytes, bytes]] | None = None, timeout: float = 10.0) -> H3Response:
        resp = self.start(method, path, body, headers)
        await asyncio.wait_for(resp.done.wait(), timeout)
        return resp

    def cancel(self, resp: H3Response) -> None:
        """Reset the request stream (the user closed the tab)."""
        self._quic.reset_stream(resp.stream_id, 0x10C)  # H3_REQUEST_CANCELLED
        self._quic.stop_stream(resp.stream_id, 0x10C)
        self.transmit()

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, HandshakeCompleted):
            self.early_data_accepted = event.early_data_accepted
            self.session_resumed = event.session_resumed
        elif isinstance(event, StopSendingReceived):
            resp = self.responses.get(event.stream_id)
            if resp is not None:
                resp.stop_sending = True
        elif isinstance(event, StreamReset):
            resp = self.responses.get(event.stream_id)
            if resp is not None:
                resp.reset = True
                resp.done.set()
        for ev in self.h3.handle_event(event):
            self._h3_event(ev)

    def _h3_event(self, ev: H3Event) -> None:
        if not isinstance(ev, (HeadersReceived, DataReceived)):
            return
        resp = self.responses.get(ev.stream_id)
        if resp is None:
            return
        if isinstance(ev, HeadersReceived):
            for k, v in ev.headers:
                if k == b":status":
                    resp.status = int(v)
                else:
                    resp.headers.append((k, v))
        elif ev.data:
            if resp.first_byte_at is None:
                resp.first_byte_at = time.perf_counter()
            resp.chunks.append(ev.data)
            resp.got_data.set()
        if ev.stream_ended:
            resp.done.set()


def make_cert(state_dir: Path) -> tuple[str, str]:
    load_or_create_tls(None, None, state_dir)
    return str(state_dir / SELF_SIGNED_CERT), str(state_dir / SELF_SIGNED_KEY)


def client_config(ticket: SessionTicket | None = None, idle_timeout: float = 10.0) -> QuicConfiguration:
    config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, idle_timeout=idle_timeout,
                               verify_mode=0)  # ssl.CERT_NONE: the self-signed test certificate
    config.session_ticket = ticket
    return config


@asynccontextmanager
async def h3_connect(port: int, *, ticket: SessionTicket | None = None, tickets: list[SessionTicket] | None = None,
                     wait_connected: bool = True, host: str = "127.0.0.1",
                     idle_timeout: float = 10.0) -> AsyncIterator[H3Client]:
    """A connected :class:`H3Client`; ``tickets`` collects the session tickets the server sends."""
    handler = tickets.append if tickets is not None else None
    async with connect(host, port, configuration=client_config(ticket, idle_timeout), create_protocol=H3Client,
                       session_ticket_handler=handler, wait_connected=wait_connected) as client:
        assert isinstance(client, H3Client)
        yield client


@dataclass
class Gateway:
    listener: QuicListener
    worker: ScriptedWorkerConnection
    app: App
    seen: list[Request]  # every request that reached the pipeline, as the handlers saw it

    @property
    def port(self) -> int:
        return self.listener.address[1]


@asynccontextmanager
async def h3_gateway(cert: tuple[str, str], settings: QuicSettings | None = None,
                     worker: ScriptedWorkerConnection | None = None, port: int = 0) -> AsyncIterator[Gateway]:
    """The real pipeline (App over a scripted worker) behind a QUIC listener on 127.0.0.1."""
    pool = ModelPool()
    w = worker or ScriptedWorkerConnection()
    pool.add(w)
    app = App(pool)
    seen: list[Request] = []

    def entrance(req: Request, sink: ResponseSink, done: Callable[[], None]) -> Call:
        seen.append(req)
        return app.handle(req, sink, done)

    listener = await start_quic_listener(entrance, "127.0.0.1", port, cert[0], cert[1], settings,
                                         on_event=app.on_http_event)
    try:
        yield Gateway(listener, w, app, seen)
    finally:
        await listener.close()


def chat_body(max_tokens: int = 8, stream: bool = False) -> bytes:
    return orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": max_tokens, "stream": stream})
