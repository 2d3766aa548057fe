"""The QUIC listener: HTTP/3 on a UDP port, with the listener methods of the TCP ones.

aioquic's :class:`~aioquic.asyncio.server.QuicServer` routes datagrams to
connections by connection ID (so a client keeps its connection when its address
changes: migration, with path validation done by aioquic) and sends Retry
packets when address validation is on. We give it our connection protocol
(:class:`~gateway.http.h3.H3Protocol`), our session-ticket store, and stop it
creating connections while draining.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, cast

from aioquic._buffer import Buffer
from aioquic.asyncio.server import QuicServer
from aioquic.h3.connection import H3_ALPN
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.packet import pull_quic_header
from aioquic.tls import SessionTicket

from gateway.http.common import EventHook
from gateway.http.h3 import protocol_factory
from gateway.http.h3_state import H3ServerState
from gateway.http.quic_settings import QuicSettings
from gateway.http.quic_tickets import TicketStore
from gateway.http.ticket_dir import SharedTickets
from gateway.http.types import Entrance, StreamsBody
from gateway.multiproc import inherited

from .. import clock

__all__ = ["QuicListener", "start_quic_listener"]


class _Server(QuicServer):
    """aioquic's server, which creates no connection while draining."""

    draining = False

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        if self.draining:
            try:
                header = pull_quic_header(Buffer(data=cast(bytes, data)), host_cid_length=8)
            except ValueError:
                return
            if header.destination_cid not in self._protocols:  # aioquic's connection table
                return
        super().datagram_received(data, addr)


class QuicListener:
    """A running HTTP/3 listener. Create with :func:`start_quic_listener`."""

    def __init__(self, server: _Server, transport: asyncio.DatagramTransport, state: H3ServerState,
                 tickets: TicketStore) -> None:
        self._server = server
        self._transport = transport
        self.state = state
        self.tickets = tickets
        host, port = transport.get_extra_info("sockname")[:2]
        self.address: tuple[str, int] = (host, port)
        # one timer for the listener, not one per request: incomplete requests -> 408
        self._sweep_every = min(1.0, state.settings.body_timeout / 4)
        self._loop = asyncio.get_running_loop()
        self._sweeper = self._loop.call_later(self._sweep_every, self._sweep)

    def _sweep(self) -> None:
        now = self._loop.time()
        for conn in list(self.state.connections):
            conn.expire_requests(now)
        self._sweeper = self._loop.call_later(self._sweep_every, self._sweep)

    @property
    def url(self) -> str:
        """``https://host:port`` (HTTP/3 over UDP on that port)."""
        return f"https://{self.address[0]}:{self.address[1]}"

    @property
    def in_flight(self) -> int:
        """Requests in the pipeline now."""
        return self.state.in_flight

    @property
    def connections(self) -> int:
        return len(self.state.connections)

    def stop_accepting(self) -> None:
        """New connections are ignored; connections close once their requests have ended."""
        if self.state.draining:
            return
        self.state.draining = self._server.draining = True
        for conn in list(self.state.connections):
            conn.drain()

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no request is in flight; False if ``timeout`` passed first."""
        try:
            await asyncio.wait_for(self.state.wait_idle(), timeout)
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        """Stop accepting and close every connection (their requests are cancelled)."""
        self.stop_accepting()
        for conn in list(self.state.connections):
            conn.abort()
        await self.wait_idle(1.0)
        self._sweeper.cancel()
        self._transport.close()


async def start_quic_listener(entrance: Entrance, host: str, port: int, certfile: str, keyfile: str,
                              settings: QuicSettings | None = None, on_event: EventHook | None = None,
                              streams_body: StreamsBody | None = None,
                              shared: SharedTickets | None = None) -> QuicListener:
    """Bind UDP ``host:port`` (0 picks a free port) and serve HTTP/3 into ``entrance``; ``on_event``
    hears of requests the adapter answered itself (App.on_http_event: metrics); ``streams_body``
    picks the requests whose body the entrance reads as it arrives; ``shared``: the session-ticket
    keys and single-use store of every gateway process on this host (gateway/multiproc)."""
    settings = settings or QuicSettings()
    config = QuicConfiguration(is_client=False, alpn_protocols=H3_ALPN, idle_timeout=settings.idle_timeout)
    config.load_cert_chain(certfile, keyfile)
    state = H3ServerState(entrance, settings, on_event, streams_body)
    tickets = TicketStore(lifetime=settings.ticket_lifetime, rotation=settings.ticket_key_rotation,
                          capacity=settings.max_tickets, single_use=settings.replay_protection, shared=shared)

    def issue(ticket: SessionTicket) -> None:
        tickets.issue(ticket, clock.wall())

    def take(identity: bytes) -> SessionTicket | None:
        return tickets.take(identity, clock.wall())

    server = _Server(configuration=config, create_protocol=protocol_factory(state),
                     session_ticket_fetcher=take, session_ticket_handler=issue, retry=settings.retry)
    loop = asyncio.get_running_loop()
    sock = inherited.take("udp", port)  # one of several processes: the supervisor's socket, steered to us
    transport, _ = await (loop.create_datagram_endpoint(lambda: server, sock=sock) if sock is not None
                          else loop.create_datagram_endpoint(lambda: server, local_addr=(host, port)))
    return QuicListener(server, transport, state, tickets)


if TYPE_CHECKING:  # mypy holds QuicListener to the listener interface serve.py drains

    from gateway.http.listeners import Listener

    def _is_a_listener(q: QuicListener) -> Listener:
        return q
