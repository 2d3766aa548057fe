"""Hostile peers at the worker's and the gateway's transport decoders (Hypothesis over frame types,
lengths and fields, plus random bytes; tests/transport/hostile.py): no crash, nothing held beyond
one frame before it is complete, every request ends once, the bad peer disconnected and logged,
the other peers served as if nothing happened."""

from __future__ import annotations

import asyncio
import logging
import random
import tracemalloc
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.transport.doubles import EchoWorker
from tests.transport.hostile import (
    HypothesisDraw,
    RandomDraw,
    gateway_hello,
    hostile_stream,
    hostile_worker,
    send_to_worker,
    worker_hello,
)
from tests.transport.test_integration import LOOPS, run
from tests.transport.test_psk import KEY
from transport.api import WorkerConnection
from transport.client import ClientConnection, connect
from transport.errors import TransportError
from transport.flow import ConnectionEnded, Event, FlowConnection, RequestEnded
from transport.messages import Error, ErrorCode, Finish, Hello, SamplingParams, Submit
from transport.server import serve
from transport.wire import DEFAULT_MAX_FRAME, HANDSHAKE_MAX_FRAME, HEADER, HEADER_SIZE, FrameType

fuzz = settings(max_examples=400, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def feed(core: FlowConnection, data: bytes, cuts: list[int]) -> list[Event]:
    """``data`` in pieces; after each, nothing is held beyond one frame of the limit in force."""
    events: list[Event] = []
    pos = i = 0
    while pos < len(data):
        n = cuts[i % len(cuts)] if cuts else len(data)
        i += 1
        events += core.receive_data(data[pos : pos + n], 0.0)
        pos += n
        assert core.buffered <= HEADER_SIZE + core.frame_limit
        if core.peer_hello is None:
            assert core.frame_limit == HANDSHAKE_MAX_FRAME
    assert sum(isinstance(e, ConnectionEnded) for e in events) <= 1
    return events


cuts_st = st.lists(st.integers(1, 64), max_size=6)


@fuzz
@given(data=st.data(), cuts=cuts_st, hello=st.booleans(), psk=st.booleans())
def test_a_worker_core_survives_any_bytes(data: st.DataObject, cuts: list[int], hello: bool, psk: bool) -> None:
    core = FlowConnection("worker", Hello(models=("tiny",)), 0.0, psk=KEY if psk else None)
    stream = hostile_stream(HypothesisDraw(data), data.draw(st.integers(1, 25)), gateway_hello() if hello else None)
    events = feed(core, stream, cuts)
    if core.closed:
        assert isinstance(events[-1], ConnectionEnded)
        assert core.receive_data(stream, 0.0) == []  # a closed core takes nothing more


@fuzz
@given(data=st.data(), cuts=cuts_st)
def test_a_gateway_core_survives_any_bytes_and_ends_each_request_once(data: st.DataObject, cuts: list[int]) -> None:
    core = FlowConnection("gateway", Hello(initial_credit=8), 0.0)
    events = core.receive_data(worker_hello(), 0.0)
    for rid in range(1, 5):
        core.submit(Submit(rid, "tiny", SamplingParams(max_tokens=4), prompt="x", buffered=rid == 4))
    core.data_to_send()
    events += feed(core, hostile_stream(HypothesisDraw(data), data.draw(st.integers(1, 25)), None), cuts)
    events += core.close()
    ends = Counter(e.result.request_id for e in events if isinstance(e, RequestEnded))
    assert ends == Counter({1: 1, 2: 1, 3: 1, 4: 1})


def test_nothing_is_held_before_a_frame_is_complete_beyond_what_arrived() -> None:
    """A header announcing the largest frame allocates nothing for it: what is held grows with what
    arrives, and a length past the limit is refused at its header."""
    core = FlowConnection("worker", Hello(models=("tiny",)), 0.0)
    core.receive_data(gateway_hello(), 0.0)
    tracemalloc.start()
    try:
        core.receive_data(HEADER.pack(1, FrameType.SUBMIT, 0, 1, DEFAULT_MAX_FRAME), 0.0)
        chunk = bytes(1 << 16)
        for _ in range(16):
            core.receive_data(chunk, 0.0)
        assert core.buffered == HEADER_SIZE + 16 * len(chunk)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * core.buffered  # a bytearray's growth, not the announced 16 MiB
    core = FlowConnection("worker", Hello(models=("tiny",)), 0.0)
    core.receive_data(gateway_hello(), 0.0)
    events = core.receive_data(HEADER.pack(1, FrameType.SUBMIT, 0, 1, DEFAULT_MAX_FRAME + 1), 0.0)
    assert core.closed and core.buffered == 0 and "exceeds max_frame" in events[-1].error.message  # type: ignore[union-attr]


# --- real sockets: the bad peer goes, the others stay --------------------------------------------

HONEST_TOKENS = 60


async def honest_load(conn: WorkerConnection, rounds: int) -> None:
    for _ in range(rounds):
        streams = [conn.submit(Submit(conn.next_request_id(), "tiny", SamplingParams(max_tokens=HONEST_TOKENS),
                                      prompt="x")) for _ in range(4)]
        for s in streams:
            got = await s.collect()  # type: ignore[attr-defined]
            assert isinstance(got.final, Finish) and got.tokens == HONEST_TOKENS
            assert got.text == b"".join(f"t{i}".encode() for i in range(HONEST_TOKENS))


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_hostile_gateways_are_cut_off_and_logged_while_an_honest_one_is_served(
        loop_kind: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "transport.server")
    rng = random.Random(36)

    async def body() -> None:
        srv = await serve("tcp://127.0.0.1:0", EchoWorker())
        host, port = srv.address.removeprefix("tcp://").rsplit(":", 1)
        honest = await connect(srv.address)
        load = asyncio.create_task(honest_load(honest, 8))
        cut = 0
        for _ in range(6):  # ten at a time
            streams = [hostile_stream(RandomDraw(rng), rng.randint(1, 40), gateway_hello() if i % 4 else None)
                       for i in range(10)]
            cut += sum(await asyncio.gather(*(send_to_worker(host, int(port), data, 1.0) for data in streams)))
        await load
        assert not honest.closed and cut >= 40
        warned = [r for r in caplog.records if "refused the gateway at" in r.message or "disconnected" in r.message]
        assert len(warned) >= cut - 2  # the few a peer ended itself (its ERROR) are not protocol errors of its own
        await honest.close()
        await srv.close()

    run(loop_kind, body, limit=60)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_a_gateway_drops_a_hostile_worker_ends_its_requests_once_and_keeps_the_others(
        loop_kind: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "transport.client")
    rng = random.Random(3636)

    async def body() -> None:
        srv = await serve("tcp://127.0.0.1:0", EchoWorker())
        honest = await connect(srv.address)
        load = asyncio.create_task(honest_load(honest, 8))
        refused = dropped = 0
        for _ in range(40):
            data = worker_hello() + hostile_stream(RandomDraw(rng), rng.randint(1, 40), None)
            bad, url = await hostile_worker(lambda: data)  # noqa: B023 - used before the next turn
            try:
                conn = await connect(url, timeout=2)
            except TransportError:  # it broke the protocol before or with its HELLO
                refused += 1
                bad.close()
                continue
            assert isinstance(conn, ClientConnection)
            streams = [conn.submit(Submit(conn.next_request_id(), "tiny", prompt="x")) for _ in range(3)
                       if not conn.closed and not conn.draining]
            async with asyncio.timeout(10):
                ends = [(await s.collect()).final for s in streams]  # type: ignore[attr-defined]
                if not conn.closed:
                    await conn.close()
            assert all(isinstance(e, (Finish, Error)) for e in ends)  # each request ended, once
            dropped += conn.core.close_error is not None and conn.core.close_error.code == ErrorCode.PROTOCOL
            bad.close()
        await load
        assert not honest.closed and refused + dropped >= 30
        # every worker dropped after its HELLO is one warning (those refused at connect: the caller's error)
        assert sum("; disconnected" in r.message for r in caplog.records) >= refused + dropped - 5
        await honest.close()
        await srv.close()

    run(loop_kind, body, limit=90)
