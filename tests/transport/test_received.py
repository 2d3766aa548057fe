"""What a stream that ended in an error had received (transport.received, for mid-stream failover
#30): the log sans-I/O against a brute-force reading, then over real loopback sockets -- a worker
that dies and one that fails a request, in each consumption mode."""

from __future__ import annotations

import asyncio
from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.transport.doubles import EchoWorker
from tests.transport.test_integration import LOOPS, run
from transport.api import Received
from transport.client import ClientStream, connect
from transport.messages import Error, ErrorCode, Finish, SamplingParams, Submit, TokenBatch
from transport.received import MAX_BATCHES, TRIM_EVERY, ReceivedLog


def batch(entries: list[tuple[int, list[int], bytes]]) -> TokenBatch:
    return TokenBatch(array("I", [r for r, _, _ in entries]), array("I", [len(t) for _, t, _ in entries]),
                      array("I", [x for _, t, _ in entries for x in t]), array("I", [len(x) for _, _, x in entries]),
                      b"".join(x for _, _, x in entries))


entries_st = st.lists(st.tuples(st.integers(1, 4), st.lists(st.integers(0, 99), min_size=0, max_size=3),
                                st.binary(max_size=4)), max_size=4, unique_by=lambda e: e[0])


@given(st.lists(entries_st, max_size=12), st.integers(1, 4), st.integers(0, 12))
def test_a_slice_is_the_streams_entries_since_its_mark(steps: list[list[tuple[int, list[int], bytes]]], rid: int,
                                                       mark: int) -> None:
    log = ReceivedLog()
    for e in steps:
        log.add(batch(e))
    mark = min(mark, len(steps))
    want_ids = [x for e in steps[mark:] for r, t, _ in e if r == rid for x in t]
    want_bytes = sum(len(x) for e in steps[mark:] for r, _, x in e if r == rid)
    got = log.slice(rid, mark)
    assert got == Received(array("I", want_ids), want_bytes)
    assert log.frozen_slice(rid, mark) == got


def test_a_request_id_used_again_is_told_apart_by_its_mark() -> None:
    log = ReceivedLog()
    log.add(batch([(1, [10, 11], b"ab")]))  # an earlier stream 1, ended
    mark = log.position
    log.add(batch([(2, [5], b"x"), (1, [20], b"c")]))  # the new stream 1
    log.add(batch([(1, [21], b"de")]))
    assert log.slice(1, mark) == log.frozen_slice(1, mark) == Received(array("I", [20, 21]), 3)


def test_the_log_keeps_what_its_open_streams_need_and_no_more_than_its_bound() -> None:
    log = ReceivedLog()
    old = log.position
    for i in range(TRIM_EVERY - 1):
        assert not log.add(batch([(1, [i], b"")]))
    young = log.position
    assert log.add(batch([(2, [7], b"y")]))  # time to trim
    log.trim([old, young])
    assert log.base == 0 and len(log.batches) == TRIM_EVERY  # the oldest stream still needs them all
    log.trim([young])
    assert log.base == young and log.slice(2, young) == Received(array("I", [7]), 1)
    assert log.slice(1, old) is None  # forgotten: that stream cannot resume
    while log.position < young + MAX_BATCHES + TRIM_EVERY:
        if log.add(batch([(2, [1], b"")])):
            log.trim([young])
    assert len(log.batches) <= MAX_BATCHES + TRIM_EVERY
    assert log.slice(2, young) is None  # older than the bound


def _submit(conn: object, max_tokens: int) -> ClientStream:
    c = conn  # a ClientConnection
    return c.submit(Submit(c.next_request_id(), "tiny", SamplingParams(max_tokens=max_tokens),  # type: ignore[attr-defined]
                           prompt="x"))


def _echoed(n: int) -> Received:
    """EchoWorker's first ``n`` tokens: ids 0..n-1, text "t0t1..."."""
    return Received(array("I", range(n)), sum(len(f"t{i}") for i in range(n)))


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_streams_of_a_dead_worker_say_what_they_received(loop_kind: str) -> None:
    async def body() -> None:
        from transport.server import serve

        worker = EchoWorker(step_delay=0.002)
        srv = await serve("tcp://127.0.0.1:0", worker)
        conn = await connect(srv.address)
        pushed: list[bytes] = []
        push, pull, finished = _submit(conn, 1000), _submit(conn, 1000), _submit(conn, 3)
        heard = push.listen(lambda text: pushed.append(text) or True)
        assert push.received() is None  # not ended
        pulled = 0
        while pulled < 12:
            pulled += sum(len(e.token_ids) for e in await pull.next_events())  # type: ignore[union-attr]
        assert isinstance((await finished.collect()).final, Finish)
        await srv.close()  # the worker goes away mid-stream
        end = await heard
        assert isinstance(end, Error) and end.code is ErrorCode.CONNECTION_LOST
        while not pull.done:
            await asyncio.sleep(0.001)
        for ev in pull.take_events():
            pulled += len(getattr(ev, "token_ids", ()))
        assert push.received() == _echoed(len(pushed)) and len(pushed) >= 12
        assert b"".join(pushed) == _echoed_text(len(pushed))
        assert pull.received() == _echoed(pulled)
        assert finished.received() is None  # it finished: nothing to resume
        await conn.close()

    run(loop_kind, body)


def _echoed_text(n: int) -> bytes:
    return b"".join(f"t{i}".encode() for i in range(n))


def test_a_stream_failed_by_a_live_worker_keeps_what_it_received() -> None:
    """The connection lives on (and its log with it): the failed stream's part is kept at its end."""
    async def body() -> None:
        from transport.server import serve

        worker = EchoWorker(step_delay=0.002)
        srv = await serve("tcp://127.0.0.1:0", worker)
        conn = await connect(srv.address)
        failing, other, cancelled = _submit(conn, 1000), _submit(conn, 1000), _submit(conn, 1000)
        got = 0
        while got < 5:
            got += sum(len(e.token_ids) for e in await failing.next_events())  # type: ignore[union-attr]
        key = next(k for k in worker.active if k[1] == failing.request_id)
        wconn, _, done = worker.active.pop(key)
        wconn.send_error(Error(failing.request_id, ErrorCode.INTERNAL, "engine step failed"))
        cancelled.cancel()
        for _ in range(TRIM_EVERY + 10):  # the log moves on and trims past the failed stream's mark
            await other.next_events()
        while not failing.done:
            await asyncio.sleep(0.001)
        assert failing.received() == _echoed(done)
        assert cancelled.done and cancelled.received() is None
        await conn.close()
        await srv.close()

    run("asyncio", body)
