"""A bad network in user space: asyncio UDP and TCP relays adding delay, jitter and loss.

This machine has no netem, so tests and benchmarks put a relay between client
and server. ``Link(delay, jitter, loss)`` applies to each direction: a packet
leaves ``delay`` seconds (one way) plus a uniform jitter in ``[-jitter, jitter]``
after it arrived, or is lost with probability ``loss``. The RNG is seeded, so a
run's losses are the same on every machine.

* :class:`UdpRelay` is what QUIC sees: datagrams are delayed (jitter reorders
  them, as on a real path) and dropped independently. It also works as a NAT:
  one upstream socket per client, and :meth:`UdpRelay.rebind` gives every
  client a new one, so the server sees the client's address change (NAT
  rebinding) mid-connection. ``record`` keeps what clients sent, for replays.
* :class:`TcpRelay` is what TCP sees. Bytes cannot be dropped from a byte
  stream, so loss is modelled by its effect: a lost segment (one read) arrives
  after the retransmission, ``rto = max(0.2 s, 2 * RTT)`` later (Linux's minimum
  RTO; a lost retransmission doubles it), and everything behind it waits
  (head-of-line blocking). ``rto`` is the relay's model, said here so a
  benchmark's reader can weigh it. The client's connect completes at once (on
  the relay's port), so the TCP handshake is modelled too: the first bytes
  reach the server one RTT later than their own lag (SYN, SYN-ACK), plus Linux's
  1 s initial RTO for each lost SYN or SYN-ACK (doubling).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Link", "UdpRelay", "TcpRelay"]

Addr = tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Link:
    """One direction's impairment: one-way ``delay`` and ``jitter`` in seconds, ``loss`` in [0, 1)."""

    delay: float = 0.0
    jitter: float = 0.0
    loss: float = 0.0

    @classmethod
    def rtt(cls, rtt: float, loss: float = 0.0, jitter: float = 0.0) -> Link:
        """The link of each direction for a round trip of ``rtt`` seconds."""
        return cls(rtt / 2, jitter, loss)

    def lag(self, rng: random.Random) -> float:
        return max(0.0, self.delay + (rng.uniform(-self.jitter, self.jitter) if self.jitter else 0.0))


class _Upstream(asyncio.DatagramProtocol):
    """The relay's socket toward the server for one client (server -> client direction)."""

    def __init__(self, relay: UdpRelay, client: Addr) -> None:
        self.relay = relay
        self.client = client
        self.transport: asyncio.DatagramTransport | None = None
        self.backlog: list[bytes] = []  # client datagrams that came while the socket was being opened

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = t = transport  # type: ignore[assignment]
        for data in self.backlog:
            self.relay._forward(t.sendto, data, self.relay.target, up=True)
        self.backlog.clear()

    def datagram_received(self, data: bytes, addr: Addr) -> None:
        if self.relay.front is not None:
            self.relay._forward(self.relay.front.sendto, data, self.client, up=False)


class UdpRelay(asyncio.DatagramProtocol):
    """Clients send to :attr:`address`; each client's datagrams go on to ``target`` from its own port."""

    def __init__(self, target: Addr, link: Link, seed: int = 0, back: Link | None = None) -> None:
        self.target = target
        self.up_link = link
        self.down_link = back or link
        self.rng = random.Random(seed)
        self.front: asyncio.DatagramTransport | None = None
        self.address: tuple[str, int] = ("", 0)
        self.upstreams: dict[Addr, _Upstream] = {}
        self.record: list[bytes] | None = None  # set to [] to keep client -> server datagrams
        self.dropped = 0
        self.sent = 0
        self._pending: set[asyncio.TimerHandle] = set()
        self._loop = asyncio.get_running_loop()

    @classmethod
    async def start(cls, target: Addr, link: Link, seed: int = 0, host: str = "127.0.0.1") -> UdpRelay:
        relay = cls(target, link, seed)
        await relay._loop.create_datagram_endpoint(lambda: relay, local_addr=(host, 0))
        return relay

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.front = transport  # type: ignore[assignment]
        self.address = transport.get_extra_info("sockname")[:2]

    def datagram_received(self, data: bytes, addr: Addr) -> None:
        if self.record is not None:
            self.record.append(data)
        up = self.upstreams.get(addr)
        if up is None:
            up = self.upstreams[addr] = _Upstream(self, addr)
            task = self._loop.create_task(self._open(up))
            task.add_done_callback(lambda t: t.exception())
        if up.transport is None:
            up.backlog.append(data)
        else:
            self._forward(up.transport.sendto, data, self.target, up=True)

    async def _open(self, up: _Upstream) -> None:
        await self._loop.create_datagram_endpoint(lambda: up, local_addr=(self.address[0], 0))

    def _forward(self, send: Callable[[bytes, Addr], None], data: bytes, to: Addr, up: bool) -> None:
        link = self.up_link if up else self.down_link
        if link.loss and self.rng.random() < link.loss:
            self.dropped += 1
            return
        self.sent += 1
        lag = link.lag(self.rng)
        if lag <= 0:
            send(data, to)
            return
        handle: asyncio.TimerHandle

        def deliver() -> None:
            self._pending.discard(handle)
            try:
                send(data, to)
            except (OSError, AttributeError, RuntimeError):
                pass  # a socket closed (rebinding, shutdown) while the packet was in flight
        handle = self._loop.call_later(lag, deliver)
        self._pending.add(handle)

    def rebind(self) -> None:
        """Every client's traffic now leaves from a new port (its old mapping is gone)."""
        old = list(self.upstreams.values())
        self.upstreams.clear()
        for up in old:
            if up.transport is not None:
                up.transport.close()

    def close(self) -> None:
        for h in self._pending:
            h.cancel()
        self._pending.clear()
        self.rebind()
        if self.front is not None:
            self.front.close()


class TcpRelay:
    """Clients connect to :attr:`address`; bytes go on to ``target`` with delay, jitter and modelled loss."""

    def __init__(self, target: tuple[str, int], link: Link, seed: int = 0) -> None:
        self.target = target
        self.link = link
        self.rng = random.Random(seed)
        self.rto = max(0.2, 4 * link.delay)  # 2 * RTT
        self.address: tuple[str, int] = ("", 0)
        self.lost = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    async def start(cls, target: tuple[str, int], link: Link, seed: int = 0, host: str = "127.0.0.1") -> TcpRelay:
        relay = cls(target, link, seed)
        relay._server = await asyncio.start_server(relay._accept, host, 0)
        relay.address = relay._server.sockets[0].getsockname()[:2]
        return relay

    async def _accept(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            sr, sw = await asyncio.open_connection(*self.target)
        except OSError:
            cw.close()
            return
        loop = asyncio.get_running_loop()
        established, rto = loop.time() + 2 * self.link.delay, 1.0  # when the client could first send: SYN, SYN-ACK
        while self.link.loss and self.rng.random() < 1 - (1 - self.link.loss) ** 2:
            self.lost += 1
            established += rto
            rto *= 2
        for r, w in ((cr, sw), (sr, cw)):
            task = loop.create_task(self._pump(r, w, established))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, established: float) -> None:
        """Deliver each read ``lag`` later, in order (a late segment holds back the ones behind it),
        nothing before the modelled handshake has ``established`` the connection."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            last = 0.0
            while True:
                due, data = await queue.get()
                last = max(last, due)  # in order: never before the segment ahead of it
                wait = last - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    writer.close()
                    return
                writer.write(data)

        out = loop.create_task(deliver())
        try:
            while True:
                data = await reader.read(65536)
                due = max(loop.time(), established) + self.link.lag(self.rng)
                rto = self.rto
                while data and self.link.loss and self.rng.random() < self.link.loss:
                    self.lost += 1
                    due += rto
                    rto *= 2
                queue.put_nowait((due, data))
                if not data:
                    break
            await out
        except (ConnectionError, asyncio.CancelledError):
            out.cancel()
            writer.close()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
