"""Flow control core: a gateway core wired to a worker core in memory, fake clock."""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transport.errors import ConnectionClosed, CreditExceeded
from transport.flow import (
    CancelReceived,
    ConnectionEnded,
    CreditResumed,
    Event,
    FlowConnection,
    GoodbyeReceived,
    PeerHello,
    RequestEnded,
    StatsReceived,
    SubmitReceived,
    SubmitRefused,
    TokensReceived,
)
from transport.messages import (
    Error,
    ErrorCode,
    Finish,
    FinishReason,
    Hello,
    Stats,
    Submit,
    TokenBatch,
)
from transport.wire import FrameEncoder


class Pair:
    """Gateway and worker cores connected by an in-memory pipe (test double network)."""

    def __init__(self, credit: int = 8, interval: float = 1.0, dead_after: float = 5.0) -> None:
        self.now = 0.0
        self.gw = FlowConnection(
            "gateway", Hello(initial_credit=credit), 0.0, heartbeat_interval=interval, dead_after=dead_after
        )
        self.wk = FlowConnection(
            "worker", Hello(models=("m",)), 0.0, heartbeat_interval=interval, dead_after=dead_after
        )
        self.gw_events: list[Event] = []
        self.wk_events: list[Event] = []
        self.pump()

    def pump(self) -> None:
        while self.gw.has_data_to_send or self.wk.has_data_to_send:
            if self.gw.has_data_to_send:
                self.wk_events += self.wk.receive_data(self.gw.data_to_send(), self.now)
            if self.wk.has_data_to_send:
                self.gw_events += self.gw.receive_data(self.wk.data_to_send(), self.now)

    def ends(self) -> Counter[int]:
        return Counter(e.result.request_id for e in self.gw_events if isinstance(e, RequestEnded))

    # what the random-operations test drives (a HeldPair sends through its ResultHold)
    def submit(self, sub: Submit) -> None:
        self.gw.submit(sub)

    @property
    def sender(self) -> Any:
        return self.wk

    def kill(self) -> None:
        self.gw_events += self.gw.connection_lost("killed")
        self.wk_events += self.wk.connection_lost("killed")


# Hypothesis: lists of (operation, request id) for run_random_ops (s submit, d drain, c cancel,
# f finish, e error, k a token, x kill the connection), as a test decorator.
random_ops = settings(database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                      max_examples=80, deadline=None)(
    given(st.lists(st.tuples(st.sampled_from("sdcfexk"), st.integers(1, 6)), max_size=60)))


def run_random_ops(p: Pair, ops: list[tuple[str, int]], buffered: Callable[[int], bool] = lambda rid: False
                   ) -> tuple[set[int], set[int]]:
    """Random submits, drains, cancels, finishes, errors and a kill (rid 6), then close: the ids
    submitted and those cancelled."""
    submitted: set[int] = set()
    cancelled: set[int] = set()
    for op, rid in ops:
        if p.gw.closed:
            break
        if op == "s" and not p.gw.is_open(rid) and rid not in submitted:
            p.submit(Submit(rid, "m", prompt="x", buffered=buffered(rid)))
            submitted.add(rid)
        elif op == "d":
            p.gw.consumed(rid, 2)
        elif op == "c":
            p.gw_events += p.gw.cancel(rid)
            cancelled.add(rid)
        elif op in "fe" and p.wk.is_open(rid):
            if op == "f":
                p.sender.send_finish(Finish(rid, FinishReason.STOP, 1, 1))
            else:
                p.sender.send_error(Error(rid, ErrorCode.INTERNAL, "x"))
        elif op == "k" and p.wk.is_open(rid) and p.wk.credit(rid):
            p.sender.send_tokens(batch([rid]))
        elif op == "x" and rid == 6:
            p.kill()
        p.pump()
    p.gw_events += p.gw.close()
    return submitted, cancelled


def batch(rids: list[int], n: int = 1) -> TokenBatch:
    k = len(rids)
    return TokenBatch(
        array("I", rids), array("I", [n] * k), array("I", [7] * (n * k)), array("I", [n] * k), b"x" * (n * k)
    )


def test_handshake_and_request_lifecycle() -> None:
    p = Pair()
    assert any(isinstance(e, PeerHello) for e in p.gw_events)
    assert p.gw.peer_hello is not None and p.gw.peer_hello.models == ("m",)
    p.gw.submit(Submit(1, "m", prompt="hi"))
    p.pump()
    assert [type(e) for e in p.wk_events[-1:]] == [SubmitReceived]
    p.wk.send_tokens(batch([1], 3))
    p.wk.send_stats(Stats(1, 1, 10, 20))
    p.wk.send_finish(Finish(1, FinishReason.STOP, 2, 3))
    p.pump()
    kinds = [type(e) for e in p.gw_events if not isinstance(e, PeerHello)]
    assert kinds == [TokensReceived, StatsReceived, RequestEnded]
    assert p.gw.in_flight == 0 and p.wk.in_flight == 0


def test_credit_bounds_what_a_slow_consumer_buffers() -> None:
    """The gateway consumer never drains: the worker can send exactly one window, then stalls."""
    p = Pair(credit=8)
    p.gw.submit(Submit(1, "m", prompt="hi"))
    p.pump()
    sent = 0
    for _ in range(100):
        if p.wk.credit(1) >= 1:
            p.wk.send_tokens(batch([1]))
            sent += 1
    p.pump()
    assert sent == 8
    with pytest.raises(CreditExceeded):
        p.wk.send_tokens(batch([1]))
    buffered = sum(e.batch.num_tokens for e in p.gw_events if isinstance(e, TokensReceived))
    assert buffered == 8
    # The consumer drains 3: not yet half a window, no grant. Then 1 more: grant of 4.
    p.gw.consumed(1, 3)
    p.pump()
    assert p.wk.credit(1) == 0
    p.gw.consumed(1, 1)
    p.pump()
    assert p.wk.credit(1) == 4
    assert any(isinstance(e, CreditResumed) and e.available == 4 for e in p.wk_events)


def test_tokens_beyond_credit_are_a_protocol_error() -> None:
    """A misbehaving worker (raw encoder, bypassing its core) is cut off, not buffered."""
    p = Pair(credit=2)
    p.gw.submit(Submit(1, "m", prompt="hi"))
    p.pump()
    rogue = FrameEncoder()
    rogue.encode(Submit(1, "m", prompt="hi"))  # mirror the stream state
    events = p.gw.receive_data(rogue.encode(batch([1], 3)), 0.0)
    ended = [e for e in events if isinstance(e, RequestEnded)]
    assert [e.result.code for e in ended] == [ErrorCode.PROTOCOL]  # type: ignore[union-attr]
    assert p.gw.closed and isinstance(events[-1], ConnectionEnded)


def test_peer_death_detected_within_timeout_fake_clock() -> None:
    p = Pair(interval=1.0, dead_after=3.0)
    p.gw.submit(Submit(1, "m", prompt="hi"))
    p.gw.submit(Submit(2, "m", prompt="hi"))
    p.pump()
    # Healthy: pings flow both ways, nobody dies over 10 s.
    for _ in range(20):
        p.now += 0.5
        for side, evs in ((p.gw, p.gw_events), (p.wk, p.wk_events)):
            t = side.get_timer()
            assert t is not None and t <= p.now + 3.0
            if t <= p.now:
                evs += side.handle_timer(p.now)
        p.pump()
    assert not p.gw.closed and not p.wk.closed
    # The worker goes silent (no more pumping). The gateway notices by dead_after.
    last_heard = p.now
    died_at = None
    while died_at is None:
        t = p.gw.get_timer()
        assert t is not None
        p.now = max(p.now, t)
        evs = p.gw.handle_timer(p.now)
        p.gw.data_to_send()  # pings into the void
        if any(isinstance(e, ConnectionEnded) for e in evs):
            died_at = p.now
            p.gw_events += evs
    assert last_heard + 3.0 <= died_at <= last_heard + 3.0 + 1e-9
    assert p.ends() == Counter({1: 1, 2: 1})
    codes = {e.result.code for e in p.gw_events if isinstance(e, RequestEnded)}  # type: ignore[union-attr]
    assert codes == {ErrorCode.CONNECTION_LOST}


def test_cancel_ends_once_and_swallows_the_late_reply() -> None:
    p = Pair()
    p.gw.submit(Submit(1, "m", prompt="hi"))
    p.pump()
    p.wk.send_tokens(batch([1]))  # in flight when the gateway cancels
    ev = p.gw.cancel(1)
    assert [e.result.code for e in ev] == [ErrorCode.CANCELLED]  # type: ignore[union-attr]
    p.gw_events += ev
    assert p.gw.cancel(1) == []  # idempotent
    p.pump()
    assert any(isinstance(e, CancelReceived) for e in p.wk_events)
    p.wk.send_finish(Finish(1, FinishReason.CANCELLED, 1, 1))
    p.pump()
    assert p.ends() == Counter({1: 1})
    assert p.gw.in_flight == 0


def test_worker_side_error_and_double_finish_end_once() -> None:
    p = Pair()
    p.gw.submit(Submit(1, "m", prompt="hi"))
    p.pump()
    p.wk.send_error(Error(1, ErrorCode.OVERLOADED, "busy"))
    p.wk.send_finish(Finish(1, FinishReason.STOP, 0, 0))  # ignored: already ended
    p.pump()
    assert p.ends() == Counter({1: 1})


def test_goodbye_drain_both_directions() -> None:
    p = Pair()
    p.gw.submit(Submit(1, "m", prompt="hi"))
    p.pump()
    p.wk.goodbye("restart")
    p.pump()
    assert any(isinstance(e, GoodbyeReceived) for e in p.gw_events)
    with pytest.raises(ConnectionClosed):
        p.gw.submit(Submit(2, "m", prompt="hi"))
    p.wk.send_finish(Finish(1, FinishReason.STOP, 1, 1))  # in-flight still finishes
    p.pump()
    assert p.ends() == Counter({1: 1})


def test_submit_crossing_worker_goodbye_gets_shutting_down() -> None:
    p = Pair()
    p.wk.goodbye()
    p.gw.submit(Submit(1, "m", prompt="hi"))  # sent before the gateway saw the Goodbye
    p.pump()
    ends = [e.result for e in p.gw_events if isinstance(e, RequestEnded)]
    assert [(e.request_id, e.code) for e in ends] == [(1, ErrorCode.SHUTTING_DOWN)]  # type: ignore[union-attr]
    assert not any(isinstance(e, SubmitReceived) for e in p.wk_events)


def test_protocol_errors_reach_the_peer() -> None:
    gw = FlowConnection("gateway", Hello(), 0.0)
    gw.data_to_send()
    evs = gw.receive_data(b"GET / HTTP/1.1\r\n\r\n", 0.0)
    assert isinstance(evs[-1], ConnectionEnded) and evs[-1].error.code == ErrorCode.PROTOCOL
    assert gw.data_to_send()  # an ERROR frame telling the peer why
    # Version mismatch and same-role peers are refused at HELLO.
    for hello in (Hello(version=2, role="worker"), Hello(role="gateway")):
        a = FlowConnection("gateway", Hello(), 0.0)
        evs = a.receive_data(FrameEncoder().encode(hello), 0.0)
        assert a.closed and isinstance(evs[-1], ConnectionEnded)
    # A frame before HELLO.
    w = FlowConnection("worker", Hello(), 0.0)
    enc = FrameEncoder()
    evs = w.receive_data(enc.encode(Submit(1, "m", prompt="x")), 0.0)
    assert w.closed and evs[-1].error.code == ErrorCode.PROTOCOL  # type: ignore[union-attr]


@random_ops
def test_every_request_ends_exactly_once(ops: list[tuple[str, int]]) -> None:
    """Random submits, drains, cancels, finishes, errors and a kill: each submit ends once."""
    p = Pair(credit=4)
    submitted, _ = run_random_ops(p, ops)
    ends = p.ends()
    assert set(ends) == submitted
    assert all(n == 1 for n in ends.values())


def _tokens(events: list[Event]) -> list[tuple[int, list[int], bytes]]:
    """(rid, token ids, text) of every entry the gateway received, in order."""
    out = []
    for e in events:
        if isinstance(e, TokensReceived):
            out += [(x.request_id, list(x.token_ids), bytes(x.text)) for x in e.batch.entries()]
    return out


def test_buffered_submit_rules_on_the_wire() -> None:
    import msgpack

    from transport.messages import SamplingParams
    from transport.wire import FrameDecoder, FrameType, SubmitRejected

    with pytest.raises(ValueError, match="buffered"):
        FrameEncoder().encode(Submit(1, "m", SamplingParams(logprobs=True), prompt="x", buffered=True))
    enc, dec = FrameEncoder(), FrameDecoder()
    (sub,) = dec.feed(enc.encode(Submit(3, "m", prompt="x", buffered=True)))
    assert sub.buffered is True
    # a SUBMIT from before the field existed (9 fields) decodes as not buffered
    body = msgpack.packb(["m", [1, 1.0, 1.0, 0, None, [], b"", False, False, 0], "x", None, None, 0, 0, None,
                          True])
    head = bytes([1, FrameType.SUBMIT, 0, 0]) + (4).to_bytes(4, "little") + len(body).to_bytes(4, "little")
    (old,) = FrameDecoder().feed(head + body)
    assert old.buffered is False
    body = msgpack.packb(["m", [1, 1.0, 1.0, 0, None, [], b"", False, True, 0], "x", None, None, 0, 0, None,
                          True, True])
    head = bytes([1, FrameType.SUBMIT, 0, 0]) + (5).to_bytes(4, "little") + len(body).to_bytes(4, "little")
    (bad,) = FrameDecoder().feed(head + body)  # one request refused, not the connection
    assert isinstance(bad, SubmitRejected) and bad.request_id == 5 and "buffered" in bad.reason


def test_a_submit_that_cannot_be_framed_leaves_nothing_open() -> None:
    """Too big for the peer's max_frame: ValueError, and the request id is free again (the encoder
    frames before it opens the stream, the core registers after it sends)."""
    p = Pair()
    big = Submit(1, "m", prompt="x" * (p.gw.peer_hello.max_frame + 1))  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="max_frame"):
        p.gw.submit(big)
    assert not p.gw.is_open(1) and p.gw.in_flight == 0
    p.gw.submit(Submit(1, "m", prompt="hi"))
    p.pump()
    assert [e.submit.request_id for e in p.wk_events if isinstance(e, SubmitReceived)] == [1]


def test_a_connection_with_max_streams_open_refuses_as_closed() -> None:
    """A full connection is one the pool should pass over (ConnectionClosed), not a bad request."""
    gw = FlowConnection("gateway", Hello(), 0.0, max_streams=2)
    wk = FlowConnection("worker", Hello(models=("m",)), 0.0)
    wk.receive_data(gw.data_to_send(), 0.0)
    gw.receive_data(wk.data_to_send(), 0.0)
    gw.submit(Submit(1, "m", prompt="a"))
    gw.submit(Submit(2, "m", prompt="b"))
    with pytest.raises(ConnectionClosed, match="max_streams"):
        gw.submit(Submit(3, "m", prompt="c"))
    wk.receive_data(gw.data_to_send(), 0.0)
    wk.send_finish(Finish(1, FinishReason.STOP, 1, 1))
    gw.receive_data(wk.data_to_send(), 0.0)
    gw.submit(Submit(3, "m", prompt="c"))  # room again
    assert gw.in_flight == 2


def corrupt_submit(frame_bytes: bytes) -> bytes:
    """One encoded SUBMIT frame with its body swapped for a list that is not a SUBMIT body."""
    import msgpack

    body = msgpack.packb(["m", "not params"])
    return frame_bytes[:8] + len(body).to_bytes(4, "little") + body


def test_a_bad_submit_fails_its_request_alone() -> None:
    """The worker core answers INVALID_REQUEST for the bad one; the request beside it runs on,
    and the connection takes new requests."""
    p = Pair()
    p.gw.submit(Submit(1, "m", prompt="a"))
    p.pump()
    p.gw.submit(Submit(2, "m", prompt="b"))
    p.wk_events += p.wk.receive_data(corrupt_submit(p.gw.data_to_send()), p.now)
    (refused,) = [e for e in p.wk_events if isinstance(e, SubmitRefused)]
    assert refused.request_id == 2 and "SUBMIT" in refused.reason
    assert not p.wk.closed and p.wk.open_requests == (1,)
    p.pump()
    (ended,) = [e.result for e in p.gw_events if isinstance(e, RequestEnded)]
    assert isinstance(ended, Error) and (ended.request_id, ended.code) == (2, ErrorCode.INVALID_REQUEST)
    assert "could not decode" in ended.message
    p.wk.send_tokens(batch([1]))
    p.wk.send_finish(Finish(1, FinishReason.STOP, 1, 1))
    p.gw.submit(Submit(2, "m", prompt="c"))  # its id is free again
    p.pump()
    assert [t[0] for t in _tokens(p.gw_events)] == [1]
    assert [e.submit.request_id for e in p.wk_events if isinstance(e, SubmitReceived)] == [1, 2]
    assert p.ends() == Counter({1: 1, 2: 1}) and not p.gw.closed and p.gw.open_requests == (2,)


def test_a_bad_submit_from_a_worker_still_ends_the_connection() -> None:
    p = Pair()
    evs = p.gw.receive_data(corrupt_submit(FrameEncoder().encode(Submit(3, "m", prompt="x"))), 0.0)
    assert p.gw.closed and isinstance(evs[-1], ConnectionEnded) and evs[-1].error.code == ErrorCode.PROTOCOL
    assert "may not send Submit" in evs[-1].error.message
