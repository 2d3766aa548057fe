"""The waiting room (#35), sans-I/O but for its futures: a request for a model with no replica waits
there, moves to the first replica that becomes ready and is answered from it; a full room, or one
whose replica would start too late, refuses at once (503 + Retry-After at the edge); a request that
waits past the timeout ends with OVERLOADED; a client that leaves takes its place with it."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from gateway.app import App
from gateway.http.types import Request
from gateway.routing.errors import NoReplica
from gateway.workers.elastic_pool import ElasticModelPool
from gateway.workers.waiting import WaitingRoom
from tests.gateway.doubles import RecordingSink, ScriptedWorkerConnection
from transport.api import Collected
from transport.messages import Error, ErrorCode, Finish, SamplingParams, Submit


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _pool(size: int = 4, timeout: float = 10.0) -> tuple[ElasticModelPool, WaitingRoom, Clock]:
    clock = Clock()
    pool = ElasticModelPool()
    pool.configure([("tiny", ())])
    room = pool.rooms["tiny"] = WaitingRoom("tiny", size, timeout, clock)
    pool.arrivals["tiny"] = 0
    return pool, room, clock


def _submit(rid: int) -> Submit:
    return Submit(rid, "tiny", SamplingParams(max_tokens=3), prompt="x")


async def test_a_request_waits_then_is_answered_by_the_first_replica_ready() -> None:
    pool, room, _ = _pool()
    arrived: list[int] = []
    room.on_arrival = lambda: arrived.append(len(room.streams))
    routed = pool.open("tiny", _submit)
    moved: list[bool] = []
    routed.on_moved = lambda: moved.append(True)
    assert routed.conn is room.conn and room.in_flight == 1 and arrived == [1]
    assert pool.arrivals["tiny"] == 1
    waiting = routed.stream
    assert waiting is not None
    pending = waiting.collect()
    assert not pending.done()
    replica = ScriptedWorkerConnection()
    pool.add(replica, ["tiny"])
    assert room.release(pool) == 1
    assert moved == [True] and routed.conn is replica and room.in_flight == 0
    assert routed.stream is not None
    res = await routed.stream.collect()
    assert res.text == b"abc" and type(res.final) is Finish
    stale = await pending  # the room's stream ended too (nobody reads it: the request moved)
    assert type(stale.final) is Error and stale.final.code == ErrorCode.CANCELLED
    routed.close()


async def test_a_full_room_or_a_start_too_slow_refuses_at_once() -> None:
    pool, room, _ = _pool(size=1, timeout=10.0)
    first = pool.open("tiny", _submit)
    with pytest.raises(NoReplica):
        pool.open("tiny", _submit)  # full: the edge answers 503 + Retry-After
    first.close()
    assert room.in_flight == 0
    room.eta = lambda: 12.0  # the replica starting now would be ready after the room's timeout
    with pytest.raises(NoReplica):
        pool.open("tiny", _submit)
    room.eta = lambda: 9.0
    pool.open("tiny", _submit).close()


async def test_a_request_that_waits_past_the_timeout_ends_overloaded() -> None:
    pool, room, clock = _pool(timeout=5.0)
    routed = pool.open("tiny", _submit)
    assert routed.stream is not None
    fut = routed.stream.collect()
    clock.t += 4.9
    assert room.expire(clock()) == 0 and not fut.done()
    assert room.oldest_wait(clock()) == pytest.approx(4.9)
    clock.t += 0.1
    assert room.expire(clock()) == 1
    res: Collected = await fut
    assert type(res.final) is Error and res.final.code == ErrorCode.OVERLOADED
    assert not routed.retry(res.final)  # no replica to retry on: the client gets the 503
    assert room.timed_out == 1 and room.in_flight == 0
    routed.close()


async def test_a_replica_in_the_pool_is_chosen_before_the_room() -> None:
    pool, room, _ = _pool()
    replica = ScriptedWorkerConnection()
    pool.add(replica, ["tiny"])
    routed = pool.open("tiny", _submit)
    assert routed.conn is replica and room.in_flight == 0
    routed.close()
    replica.draining = True  # the only replica drains: the room takes the next request
    routed = pool.open("tiny", _submit)
    assert routed.conn is room.conn
    routed.close()
    assert room.in_flight == 0


async def test_through_the_app_a_wait_past_the_timeout_is_a_503_with_retry_after() -> None:
    """The whole pipeline: a chat request waits in the room; at the timeout the client gets 503
    ``overloaded`` with Retry-After, and the request leaves the room."""
    pool, room, clock = _pool(timeout=5.0)
    app = App(pool)
    sink = RecordingSink()
    ended = asyncio.get_running_loop().create_future()
    body = orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
    app.handle(Request("POST", "/v1/chat/completions", "", [], body, "http/1.1", "http"), sink,
               lambda: ended.set_result(None))
    await asyncio.sleep(0)
    assert room.in_flight == 1 and not ended.done()
    clock.t += 5.0
    room.expire(clock())
    await asyncio.wait_for(ended, 5)
    assert sink.status == 503 and sink.json()["error"]["code"] == "overloaded"  # type: ignore[index]
    assert sink.header(b"retry-after") == b"1" and room.in_flight == 0
