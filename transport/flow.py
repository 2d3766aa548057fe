"""Connection state: handshake, multiplexing, credits, heartbeats (sans-I/O).

How it works
------------
One :class:`FlowConnection` per connection end, ``role`` "gateway" or
"worker". Bytes from the peer go into :meth:`receive_data`, which returns
events; bytes for the peer accumulate until :meth:`data_to_send`. The clock
is an argument (``now``); the adapter arms one timer at :meth:`get_timer` and
calls :meth:`handle_timer`. No sockets, no asyncio.

* Handshake: each side sends HELLO first; anything else first, a wire
  version other than ours, or a peer with our own role is a protocol error.
  An ERROR for the whole connection in its place is the peer refusing us (a
  worker that requires TLS tells a plain-TCP gateway so): the connection ends
  with its message. With a pre-shared key (``psk``) the first HELLO is a
  challenge, AUTH answers it, and the full HELLO follows only once the peer's
  AUTH proved the key (:mod:`transport.psk`); :class:`PeerHello` then means an
  authenticated peer. Until the peer's HELLO is accepted its frames are capped
  at ``HANDSHAKE_MAX_FRAME`` and the whole exchange at ``handshake_timeout``.
* Credits: the gateway's HELLO ``initial_credit`` is each request's token
  window. The worker spends it with every token it sends
  (:meth:`credit` says what is left; sending more raises ``CreditExceeded``)
  and the gateway refills it with CREDIT frames as its consumer drains
  (:meth:`consumed`, batched to half a window). Tokens beyond the window are a
  protocol error, so a slow consumer bounds what the gateway buffers to one
  window per request. The layer above may open a request with another window
  (:data:`UNLIMITED`: credit does not apply), on both sides alike: the gateway's
  :meth:`submit` takes it, the worker's :meth:`set_window` sets it when the
  Submit arrives. What a request's options mean (``Submit.buffered``: whole
  results, :mod:`transport.hold`) is that layer's business; the core carries them.
* Heartbeats: a PING every ``heartbeat_interval``; any frame from the peer
  proves it alive; silence for ``dead_after`` ends the connection with
  ``CONNECTION_LOST``.
* Every request ends exactly once on the gateway: :class:`RequestEnded`
  carries the worker's FINISH/ERROR, or a local ``CANCELLED`` when the gateway
  cancels (the worker's late reply is then swallowed), or ``CONNECTION_LOST``
  / the peer's connection error for everything open when the connection ends.
* A SUBMIT whose body does not decode (:class:`~transport.wire.SubmitRejected`)
  fails that request alone: the worker core answers ERROR ``INVALID_REQUEST``
  for it and reports :class:`SubmitRefused`; its other requests go on.
* KV events (the worker's Hello lists ``"kv_events"``): the gateway's
  :meth:`subscribe_kv` sends KV_SUBSCRIBE (again for a resync); from then on
  the worker may :meth:`send_kv_events` and the gateway reports each batch as
  :class:`KvEventsReceived`. Unasked KV_EVENTS, or KV_SUBSCRIBE to a worker
  without the capability, are protocol errors.
* GOODBYE: the sender is draining. A worker that said GOODBYE answers new
  SUBMITs with ``SHUTTING_DOWN``; a gateway that received one refuses to
  submit (``ConnectionClosed``).
"""

from __future__ import annotations

import math
from dataclasses import replace

from .errors import ConnectionClosed, CreditExceeded, WireError
from .flow_events import (
    CancelReceived,
    ConnectionEnded,
    CreditResumed,
    Event,
    GoodbyeReceived,
    KvEventsReceived,
    KvSubscribed,
    PeerHello,
    RequestEnded,
    StatsReceived,
    SubmitReceived,
    SubmitRefused,
    TokensReceived,
)
from .messages import (
    PROTOCOL_VERSION,
    Auth,
    Cancel,
    Credit,
    Error,
    ErrorCode,
    Finish,
    Goodbye,
    Hello,
    KvEvents,
    KvSubscribe,
    Message,
    Ping,
    Pong,
    Stats,
    Submit,
    TokenBatch,
)
from .psk import PskHandshake
from .wire import (
    DEFAULT_MAX_FRAME,
    HANDSHAKE_MAX_FRAME,
    FrameDecoder,
    FrameEncoder,
    StreamTable,
    SubmitRejected,
)

__all__ = [
    "FlowConnection",
    "UNLIMITED",
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
    "KV_EVENTS",
]

KV_EVENTS = "kv_events"  # the Hello capability of a worker that publishes its prefix cache's changes




UNLIMITED = 1 << 62
"""A request window that credit does not bound (its consumer takes everything at once)."""


class _GatewayRequest:
    __slots__ = ("window", "unacked", "cancelled")

    def __init__(self, window: int) -> None:
        self.window = window  # tokens the worker may still send
        self.unacked = 0  # consumed but not yet granted back
        self.cancelled = False


class FlowConnection:
    """Sans-I/O state of one connection end (see the module docstring)."""

    def __init__(
        self,
        role: str,
        hello: Hello,
        now: float,
        *,
        heartbeat_interval: float = 1.0,
        dead_after: float = 5.0,
        max_streams: int = 1 << 16,
        psk: bytes | None = None,
        nonce: bytes | None = None,
        handshake_timeout: float = 10.0,
    ) -> None:
        if role not in ("gateway", "worker"):
            raise ValueError("role must be 'gateway' or 'worker'")
        if heartbeat_interval <= 0 or dead_after <= 0 or handshake_timeout <= 0:
            raise ValueError("heartbeat_interval, dead_after and handshake_timeout must be positive")
        self.role = role
        # Every field of the caller's Hello (a worker's capacity included), with our role and frame limit.
        self.local_hello = replace(hello, role=role, max_frame=hello.max_frame or DEFAULT_MAX_FRAME)
        self.peer_hello: Hello | None = None
        self.closed = False
        self.close_error: Error | None = None
        self.goodbye_sent = False
        self.goodbye_received = False
        self.heartbeat_interval = heartbeat_interval
        self.dead_after = dead_after
        streams = StreamTable(max_streams)
        self._enc = FrameEncoder(streams)
        self._dec = FrameDecoder(streams, min(HANDSHAKE_MAX_FRAME, self.local_hello.max_frame))
        self._dec.stop_after_hello = True  # the frames after the peer's HELLO get the limit it leads to
        self._out: list[bytes] = []
        self._last_rx = now
        self._next_ping = now + heartbeat_interval
        self.handshake_timeout = handshake_timeout
        self._handshake_deadline = now + handshake_timeout
        self._nonce = 0
        self._gw: dict[int, _GatewayRequest] = {}  # gateway: open requests
        self._credit: dict[int, int] = {}  # worker: open requests -> remaining credit
        self._psk = PskHandshake(psk, role, nonce) if psk is not None else None
        self._peer_role = ""
        self.kv_subscribed = False  # gateway: it sent KV_SUBSCRIBE; worker: it received one
        if self._psk is None:
            self._send(self.local_hello)
        else:  # the challenge: nothing about us until the peer proved the key
            self._send(Hello(role=role, max_frame=self.local_hello.max_frame, challenge=self._psk.nonce))

    # --- bytes in / out --------------------------------------------------------------------

    def data_to_send(self) -> bytes:
        out = b"".join(self._out)
        self._out.clear()
        return out

    @property
    def has_data_to_send(self) -> bool:
        return bool(self._out)

    def receive_data(self, data: bytes | bytearray | memoryview, now: float) -> list[Event]:
        if self.closed:
            return []
        self._last_rx = now
        try:
            msgs = self._dec.feed(data)
        except WireError as exc:
            return self._fail(str(exc))
        events: list[Event] = []
        if self.peer_hello is not None:  # the usual case: the handshake is over
            for msg in msgs:
                self._handle(msg, events)
                if self.closed:
                    break
            return events
        while True:
            for msg in msgs:
                self._handle(msg, events)
                if self.closed:
                    return events
            if not (msgs and type(msgs[-1]) is Hello and self._dec.buffered):
                return events
            try:  # the decoder stopped after a HELLO (handshake): the rest, under the limit now in force
                msgs = self._dec.feed(b"")
            except WireError as exc:
                events.extend(self._fail(str(exc)))
                return events

    def connection_lost(self, reason: str = "connection lost") -> list[Event]:
        """The byte stream ended or broke."""
        return self._terminate(Error(0, ErrorCode.CONNECTION_LOST, reason))

    def close(self, reason: str = "connection closed") -> list[Event]:
        """Local close: every open request ends with ``CONNECTION_LOST``."""
        return self._terminate(Error(0, ErrorCode.CONNECTION_LOST, reason))

    # --- timers ------------------------------------------------------------------------------

    @property
    def buffered(self) -> int:
        """Bytes held for the peer's incomplete frame: at most a header plus :attr:`frame_limit`."""
        return self._dec.buffered

    @property
    def frame_limit(self) -> int:
        """The largest frame body accepted from the peer now (small until its HELLO is accepted)."""
        return self._dec.max_frame

    @property
    def psk_verified(self) -> bool:
        """The peer proved the pre-shared key (False when none is configured)."""
        return self._psk is not None and self._psk.verified

    def get_timer(self) -> float | None:
        if self.closed:
            return None
        return min(self._next_ping, self._last_rx + self.dead_after, self._handshake_deadline)  # (inf once done)

    def handle_timer(self, now: float) -> list[Event]:
        if self.closed:
            return []
        if self.peer_hello is None and now >= self._handshake_deadline:
            return self._fail(f"no complete handshake within {self.handshake_timeout:g}s")
        if now >= self._last_rx + self.dead_after:
            return self._terminate(
                Error(0, ErrorCode.CONNECTION_LOST, f"peer silent for {now - self._last_rx:.1f}s (dead)")
            )
        if now >= self._next_ping:
            self._nonce += 1
            self._send(Ping(self._nonce))
            self._next_ping = now + self.heartbeat_interval
        return []

    # --- either side -------------------------------------------------------------------------

    @property
    def open_requests(self) -> tuple[int, ...]:
        return tuple(self._gw) if self.role == "gateway" else tuple(self._credit)

    def is_open(self, request_id: int) -> bool:
        return request_id in (self._gw if self.role == "gateway" else self._credit)

    @property
    def in_flight(self) -> int:
        """Requests not yet ended on the wire (gateway: includes cancelled, awaiting reply)."""
        return len(self._gw) if self.role == "gateway" else len(self._credit)

    def goodbye(self, reason: str = "") -> None:
        """Announce draining (idempotent)."""
        if self.closed or self.goodbye_sent:
            return
        self.goodbye_sent = True
        self._send(Goodbye(reason))

    # --- gateway side ------------------------------------------------------------------------

    def submit(self, submit: Submit, window: int | None = None) -> None:
        """Open a request; its token window is ``window``, or the initial credit when None."""
        self._need("gateway")
        if self.closed:
            raise ConnectionClosed(self.close_error.message if self.close_error else "connection closed")
        if self.peer_hello is None:
            raise ConnectionClosed("handshake not complete")
        if self.goodbye_received or self.goodbye_sent:
            raise ConnectionClosed("connection is draining (Goodbye)")
        if submit.request_id in self._gw:
            raise ValueError(f"request id {submit.request_id} is in use")
        limit = self._enc.streams.max_streams
        if len(self._gw) >= limit:
            raise ConnectionClosed(f"connection has {limit} requests open (max_streams)")
        self._send(submit)
        self._gw[submit.request_id] = _GatewayRequest(self.local_hello.initial_credit if window is None else window)

    def cancel(self, request_id: int) -> list[Event]:
        """Cancel an open request: it ends now (``CANCELLED``); the worker is told."""
        self._need("gateway")
        req = self._gw.get(request_id)
        if req is None or req.cancelled or self.closed:
            return []
        req.cancelled = True
        self._send(Cancel(request_id))
        return [RequestEnded(Error(request_id, ErrorCode.CANCELLED, "cancelled"))]

    def consumed(self, request_id: int, tokens: int) -> None:
        """The gateway's consumer drained ``tokens``; grant them back in batches."""
        self._need("gateway")
        req = self._gw.get(request_id)
        if req is None or req.cancelled or self.closed or tokens <= 0:
            return
        req.unacked += tokens
        if req.unacked >= max(1, self.local_hello.initial_credit // 2):
            self._send(Credit(request_id, req.unacked))
            req.window += req.unacked
            req.unacked = 0

    def subscribe_kv(self) -> None:
        """Ask the worker for its whole prefix cache, then every change (again: a resync). Only to a
        worker whose Hello lists :data:`KV_EVENTS`."""
        self._need("gateway")
        if self.closed:
            return
        if self.peer_hello is None or KV_EVENTS not in self.peer_hello.capabilities:
            raise ValueError("the worker does not publish KV events")
        self.kv_subscribed = True
        self._send(KvSubscribe())

    # --- worker side -------------------------------------------------------------------------

    def credit(self, request_id: int) -> int:
        """Tokens the worker may still send for this request (0 when not open)."""
        return self._credit.get(request_id, 0)

    def set_window(self, request_id: int, tokens: int) -> None:
        """An open request's window, as the gateway opened it (the layer above knows which: the
        Submit's options say so); before any token of it is sent."""
        self._need("worker")
        if request_id in self._credit:
            self._credit[request_id] = tokens

    def send_tokens(self, batch: TokenBatch) -> None:
        """One engine step's tokens, within each request's credit."""
        self._need("worker")
        if self.closed:
            return
        credit = self._credit
        counts = batch.counts
        for i, rid in enumerate(batch.request_ids):
            c = credit.get(rid)
            if c is None:
                raise ValueError(f"tokens for request {rid} that is not open")
            if counts[i] > c:
                raise CreditExceeded(f"request {rid}: {counts[i]} tokens, credit {c}")
        self._send(batch)
        for i, rid in enumerate(batch.request_ids):
            credit[rid] -= counts[i]

    def send_finish(self, finish: Finish) -> None:
        self._end_worker_request(finish)

    def send_error(self, error: Error) -> None:
        if error.request_id == 0:
            if not self.closed:
                self._send(error)
                self._terminate(error)
            return
        self._end_worker_request(error)

    def send_stats(self, stats: Stats) -> None:
        self._need("worker")
        if not self.closed:
            self._send(stats)

    def send_kv_events(self, events: KvEvents) -> None:
        """A batch of the prefix cache's changes, to a gateway that subscribed."""
        self._need("worker")
        if not self.kv_subscribed:
            raise ValueError("KV events for a gateway that did not subscribe")
        if not self.closed:
            self._send(events)

    def _end_worker_request(self, msg: Finish | Error) -> None:
        self._need("worker")
        if self.closed or msg.request_id not in self._credit:
            return  # already ended (or the connection is gone): ends exactly once
        del self._credit[msg.request_id]
        self._send(msg)

    # --- internals ---------------------------------------------------------------------------

    def _need(self, role: str) -> None:
        if self.role != role:
            raise RuntimeError(f"only the {role} side may do this")

    def _send(self, msg: Message) -> None:
        self._out.append(self._enc.encode(msg))

    def _fail(self, message: str) -> list[Event]:
        """Protocol violation by the peer: tell it, then end."""
        err = Error(0, ErrorCode.PROTOCOL, message)
        if not self.closed:
            try:
                self._send(err)
            except ValueError:  # pragma: no cover - encoding a plain Error cannot fail
                pass
        return self._terminate(err)

    def _terminate(self, error: Error) -> list[Event]:
        if self.closed:
            return []
        self.closed = True
        self.close_error = error
        events: list[Event] = []
        if self.role == "gateway":
            open_ids = tuple(self._gw)
            for rid, req in self._gw.items():
                if not req.cancelled:
                    events.append(RequestEnded(Error(rid, error.code, error.message)))
            self._gw.clear()
        else:
            open_ids = tuple(self._credit)
            self._credit.clear()
        events.append(ConnectionEnded(error, open_ids))
        return events

    def _handle(self, msg: Message | SubmitRejected, events: list[Event]) -> None:
        t = type(msg)
        if (t is Finish or t is TokenBatch) and self.role == "gateway" and self.peer_hello is not None:
            self._handle_gateway(msg, events)  # the common case, without the checks below
            return
        if self.peer_hello is None:
            self._handshake(msg, events)
            return
        if isinstance(msg, Ping):
            self._send(Pong(msg.nonce))
        elif isinstance(msg, Pong):
            pass
        elif isinstance(msg, Goodbye):
            self.goodbye_received = True
            events.append(GoodbyeReceived(msg.reason))
        elif isinstance(msg, Error) and msg.request_id == 0:
            events.extend(self._terminate(msg))
        elif self.role == "gateway":
            self._handle_gateway(msg, events)
        else:
            self._handle_worker(msg, events)

    def _handshake(self, msg: Message | SubmitRejected, events: list[Event]) -> None:
        """Before the peer's full HELLO: its HELLOs and AUTH, or the ERROR that refuses us."""
        if type(msg) is Error and msg.request_id == 0:
            events.extend(self._terminate(Error(0, msg.code, f"the peer refused the connection: {msg.message}")))
            return
        psk = self._psk
        if type(msg) is Auth:
            if psk is None or psk.peer_nonce is None or psk.verified:
                events.extend(self._fail("unexpected AUTH"))
            elif not psk.check(self._peer_role, msg.proof):
                events.extend(self._fail(f"pre-shared key authentication failed: the {self._peer_role}'s proof does "
                                         "not match this side's key (do both sides read the same transport_psk_file?)"))
            else:
                self._send(self.local_hello)  # the full one, now that the peer is known
            return
        if not isinstance(msg, Hello):
            events.extend(self._fail(f"expected HELLO first, got {type(msg).__name__}"))
            return
        if msg.version != PROTOCOL_VERSION:
            events.extend(self._fail(f"peer speaks version {msg.version}, we speak {PROTOCOL_VERSION}"))
            return
        if msg.role == self.role:
            events.extend(self._fail(f"peer has our own role {msg.role!r}"))
            return
        if psk is None:
            if msg.challenge:
                events.extend(self._fail(f"the {msg.role} requires a pre-shared key and this {self.role} has none: "
                                         "configure the same transport_psk_file on both sides"))
                return
        elif psk.peer_nonce is None:  # its challenge
            if not msg.challenge:
                events.extend(self._fail(f"this {self.role} requires a pre-shared key and the {msg.role} offered "
                                         "none: configure the same transport_psk_file on both sides"))
                return
            self._peer_role = msg.role
            self._send(Auth(psk.answer(msg.challenge)))
            return
        elif not psk.verified or msg.challenge or msg.role != self._peer_role:
            events.extend(self._fail("HELLO out of order in the pre-shared key exchange"))
            return
        self.peer_hello = msg
        self._enc.max_frame = msg.max_frame
        self._dec.max_frame = self.local_hello.max_frame
        self._dec.stop_after_hello = False
        self._handshake_deadline = math.inf
        events.append(PeerHello(msg))

    def _handle_gateway(self, msg: Message | SubmitRejected, events: list[Event]) -> None:
        if isinstance(msg, (Finish, Error)):
            req = self._gw.pop(msg.request_id)
            if not req.cancelled:
                events.append(RequestEnded(msg))
        elif isinstance(msg, TokenBatch):
            gw = self._gw
            counts = msg.counts
            for i, rid in enumerate(msg.request_ids):
                req = gw[rid]  # the decoder checked the stream is open
                req.window -= counts[i]
                if req.window < 0 and not req.cancelled:
                    events.extend(self._fail(f"request {rid}: worker sent tokens beyond its credit"))
                    return
            events.append(TokensReceived(msg))
        elif isinstance(msg, Stats):
            events.append(StatsReceived(msg))
        elif isinstance(msg, KvEvents) and self.kv_subscribed:
            events.append(KvEventsReceived(msg))
        else:
            name = "Submit" if isinstance(msg, SubmitRejected) else type(msg).__name__
            events.extend(self._fail(f"a worker may not send {name}"))

    def _handle_worker(self, msg: Message | SubmitRejected, events: list[Event]) -> None:
        if isinstance(msg, SubmitRejected):
            why = f"the worker could not decode the request: {msg.reason}"
            self._send(Error(msg.request_id, ErrorCode.INVALID_REQUEST, why))  # closes the stream
            events.append(SubmitRefused(msg.request_id, msg.reason))
        elif isinstance(msg, Submit):
            assert self.peer_hello is not None
            self._credit[msg.request_id] = self.peer_hello.initial_credit  # the layer above may set another
            if self.goodbye_sent:
                self._end_worker_request(Error(msg.request_id, ErrorCode.SHUTTING_DOWN, "worker is draining"))
            else:
                events.append(SubmitReceived(msg))
        elif isinstance(msg, Cancel):
            if msg.request_id in self._credit:
                events.append(CancelReceived(msg.request_id))
        elif isinstance(msg, Credit):
            old = self._credit.get(msg.request_id)
            if old is not None:
                self._credit[msg.request_id] = old + msg.tokens
                if old == 0:
                    events.append(CreditResumed(msg.request_id, old + msg.tokens))
        elif isinstance(msg, KvSubscribe) and KV_EVENTS in self.local_hello.capabilities:
            self.kv_subscribed = True
            events.append(KvSubscribed())
        else:
            events.extend(self._fail(f"a gateway may not send {type(msg).__name__}"))
