"""Whole results (Submit.buffered, transport.hold): the option's meaning lives above the flow core.

Gateway and worker cores wired in memory (test_flow's Pair); the worker's sends go through
:class:`ResultHold`, and the gateway opens a request with :func:`window`, as the real
``ServerConnectionImpl`` and ``ClientConnection`` do."""

from __future__ import annotations

from array import array
from collections import Counter

from transport.flow import UNLIMITED, CancelReceived, RequestEnded, TokensReceived
from transport.hold import ResultHold, window
from transport.messages import Error, ErrorCode, Finish, FinishReason, SamplingParams, Submit, TokenBatch

from .test_flow import Pair, _tokens, batch, random_ops, run_random_ops


class HeldPair(Pair):
    """A Pair whose worker sends through a ResultHold (observing its core's events, flushed before
    its bytes are taken, as the worker's endpoint does)."""

    def __init__(self, credit: int = 8) -> None:
        self.ws: ResultHold | None = None
        super().__init__(credit)
        self.ws = ResultHold(self.wk)

    def submit(self, sub: Submit) -> None:
        self.gw.submit(sub, window(sub))

    @property
    def sender(self) -> ResultHold:
        assert self.ws is not None
        return self.ws

    def kill(self) -> None:
        self.gw_events += self.gw.connection_lost("killed")
        evs = self.wk.connection_lost("killed")
        self.sender.observe(evs)
        self.wk_events += evs

    def pump(self) -> None:
        while True:
            if self.ws is not None:
                self.ws.flush()
            if not (self.gw.has_data_to_send or self.wk.has_data_to_send):
                return
            if self.gw.has_data_to_send:
                evs = self.wk.receive_data(self.gw.data_to_send(), self.now)
                if self.ws is not None:
                    self.ws.observe(evs)
                self.wk_events += evs
            if self.wk.has_data_to_send:
                self.gw_events += self.gw.receive_data(self.wk.data_to_send(), self.now)


def test_the_flow_core_carries_the_option_without_holding() -> None:
    """Bare cores: a buffered Submit is an ordinary request to them (credit applies, tokens flow per
    step); only the layer above gives the option its meaning."""
    p = Pair(credit=4)
    p.gw.submit(Submit(1, "m", prompt="a", buffered=True))
    p.pump()
    assert p.wk.credit(1) == 4
    p.wk.send_tokens(batch([1], 2))
    p.pump()
    assert _tokens(p.gw_events) == [(1, [7, 7], b"xx")]


def test_buffered_request_arrives_in_one_entry_right_before_its_end() -> None:
    p = HeldPair(credit=4)
    assert window(Submit(1, "m", buffered=True)) == UNLIMITED and window(Submit(1, "m")) is None
    p.submit(Submit(1, "m", prompt="a", buffered=True))
    p.submit(Submit(2, "m", SamplingParams(logprobs=True, top_logprobs=1), prompt="b"))
    p.pump()
    assert p.wk.credit(1) == UNLIMITED and p.wk.credit(2) == 4  # credit does not apply to a buffered stream
    assert p.ws is not None
    start = len(p.gw_events)
    for step in range(10):  # more than the 4-token window: fine for the buffered one
        rids = [1, 2] if step < 3 else [1]
        k = len(rids)
        lp = array("f", [-0.5]) if 2 in rids else array("f")
        top = array("I", [step]) if 2 in rids else array("I")
        toplp = array("f", [-0.25]) if 2 in rids else array("f")
        p.ws.send_tokens(TokenBatch(array("I", rids), array("I", [1] * k), array("I", [100 + step] * k),
                                    array("I", [1] * k), bytes([97 + step]) * k, logprobs=lp, top_ids=top,
                                    top_logprobs=toplp))
        p.pump()
        if step == 2:
            p.ws.send_finish(Finish(2, FinishReason.LENGTH, 1, 3))
            p.pump()
    got = _tokens(p.gw_events[start:])
    assert got == [(2, [100], b"a"), (2, [101], b"b"), (2, [102], b"c")]  # only the streaming one so far
    entries = [x for e in p.gw_events[start:] if isinstance(e, TokensReceived) for x in e.batch.entries()]
    assert [list(x.top_ids) for x in entries] == [[0], [1], [2]]  # its logprobs passed through intact
    p.ws.send_finish(Finish(1, FinishReason.LENGTH, 1, 10))
    assert p.ws.holding == 1 and not p.wk.has_data_to_send  # ended, waiting for the flush
    p.pump()
    tail = p.gw_events[-2:]
    assert isinstance(tail[0], TokensReceived) and isinstance(tail[1], RequestEnded)
    assert _tokens(tail) == [(1, list(range(100, 110)), b"abcdefghij")]
    assert p.ends() == Counter({1: 1, 2: 1}) and p.ws.holding == 0


def test_results_ending_together_share_one_tokens_frame_in_send_order() -> None:
    p = HeldPair()
    assert p.ws is not None
    for rid in (1, 2, 3):
        p.submit(Submit(rid, "m", prompt="a", buffered=rid != 2))
    p.pump()
    start = len(p.gw_events)
    p.ws.send_tokens(batch([1, 2, 3], 2))
    p.ws.send_finish(Finish(1, FinishReason.STOP, 1, 2))
    p.ws.send_finish(Finish(3, FinishReason.STOP, 1, 2))
    p.ws.send_finish(Finish(2, FinishReason.STOP, 1, 2))  # not held: the held ends go out before it
    p.pump()
    kinds = [(type(e).__name__, e.result.request_id if isinstance(e, RequestEnded) else None)
             for e in p.gw_events[start:]]
    assert kinds == [("TokensReceived", None), ("TokensReceived", None), ("RequestEnded", 1),
                     ("RequestEnded", 3), ("RequestEnded", 2)]
    assert _tokens(p.gw_events[start:]) == [(2, [7, 7], b"xx"), (1, [7, 7], b"xx"), (3, [7, 7], b"xx")]


def test_buffered_tokens_go_out_before_an_error_and_cancel_swallows_them() -> None:
    p = HeldPair()
    assert p.ws is not None
    p.submit(Submit(1, "m", prompt="a", buffered=True))
    p.submit(Submit(2, "m", prompt="b", buffered=True))
    p.pump()
    p.ws.send_tokens(batch([1, 2], 2))
    p.pump()
    assert _tokens(p.gw_events) == []
    p.ws.send_error(Error(1, ErrorCode.INTERNAL, "boom"))
    p.pump()
    assert _tokens(p.gw_events) == [(1, [7, 7], b"xx")]
    assert p.gw_events[-1] == RequestEnded(Error(1, ErrorCode.INTERNAL, "boom"))
    p.gw_events.clear()
    p.gw.cancel(2)  # the gateway ended it already; the worker's late Finish is swallowed
    p.pump()
    assert p.wk_events[-1] == CancelReceived(2)
    p.ws.send_tokens(batch([2], 2))
    p.ws.send_finish(Finish(2, FinishReason.CANCELLED, 1, 2))
    p.pump()
    assert _tokens(p.gw_events) == []  # a cancelled buffered result is not sent at all
    assert not any(isinstance(e, RequestEnded) for e in p.gw_events)
    assert p.ends() == Counter() and 2 not in p.wk.open_requests


def test_a_connection_error_sends_the_ended_results_first() -> None:
    p = HeldPair()
    assert p.ws is not None
    p.submit(Submit(1, "m", prompt="a", buffered=True))
    p.pump()
    p.ws.send_tokens(batch([1], 3))
    p.ws.send_finish(Finish(1, FinishReason.STOP, 1, 3))
    p.ws.send_error(Error(0, ErrorCode.INTERNAL, "worker going down"))
    p.pump()
    assert _tokens(p.gw_events) == [(1, [7, 7, 7], b"xxx")]
    assert p.ends() == Counter({1: 1}) and p.gw.closed


@random_ops
def test_every_request_ends_exactly_once_and_held_tokens_come_right_before_their_end(
        ops: list[tuple[str, int]]) -> None:
    """Random submits (even ids buffered), drains, cancels, finishes, errors and a kill."""
    p = HeldPair(credit=4)
    submitted, cancelled = run_random_ops(p, ops, buffered=lambda rid: rid % 2 == 0)
    ends = p.ends()
    for i, e in enumerate(p.gw_events):  # a buffered request's tokens come right before its end
        if isinstance(e, TokensReceived):
            for rid in e.batch.request_ids:
                if rid % 2 == 0 and rid not in cancelled:
                    nxt = p.gw_events[i + 1]
                    assert isinstance(nxt, RequestEnded) and nxt.result.request_id == rid
    assert set(ends) == submitted
    assert all(n == 1 for n in ends.values())
