"""Routing: the pool's policy seam and the rebalance of requests that have not started
(ScriptedWorkerConnection doubles, no sockets)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import orjson
import pytest

from gateway.app import App
from gateway.http.types import Request
from gateway.routing.policy import LeastLoaded, RouteRequest
from gateway.routing.pool import ModelPool
from transport.api import WorkerConnection
from transport.messages import Stats

from .doubles import RecordingSink, ScriptedWorkerConnection, sse_events

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5}


def post(body: object) -> Request:
    return Request("POST", "/v1/chat/completions", "", [], orjson.dumps(body), "http/1.1", "http")


class Recording:
    """A policy that records what it was shown and picks the last replica."""

    uses_prefix_hashes = False

    def __init__(self) -> None:
        self.seen: list[tuple[RouteRequest, int]] = []

    def choose(self, req: RouteRequest, replicas: Sequence[WorkerConnection]) -> WorkerConnection | None:
        self.seen.append((req, len(replicas)))
        return replicas[-1]


async def test_a_policy_sees_the_parsed_request_and_the_open_replicas() -> None:
    a, b, closed = ScriptedWorkerConnection(), ScriptedWorkerConnection(), ScriptedWorkerConnection()
    closed.closed = True
    policy = Recording()
    pool = ModelPool(policy=policy)
    for c in (a, closed, b):
        pool.add(c)
    app = App(pool)
    done = asyncio.get_running_loop().create_future()
    sink = RecordingSink()
    app.handle(post({**CHAT, "max_tokens": 3}), sink, lambda: done.set_result(None))
    await done
    assert sink.status == 200 and b.submits and not a.submits
    req, n = policy.seen[0]
    assert (req.model, req.max_tokens, n) == ("tiny", 3, 2)  # the closed replica is never offered
    assert req.prompt_tokens > 0


async def test_a_single_replica_is_taken_without_describing_the_request() -> None:
    """The policy's view (RouteRequest: prompt estimate, max_tokens) is built only when there is a
    choice: one open replica takes the request as it is."""
    only = ScriptedWorkerConnection()
    pool = ModelPool(policy=Recording())
    pool.add(only)
    app = App(pool)
    described: list[str] = []
    describe = pool.describe
    pool.describe = lambda model, g: (described.append(model), describe(model, g))[1]
    done = asyncio.get_running_loop().create_future()
    app.handle(post(CHAT), RecordingSink(), lambda: done.set_result(None))
    await done
    assert only.submits and described == []
    pool.add(ScriptedWorkerConnection())
    done = asyncio.get_running_loop().create_future()
    app.handle(post(CHAT), RecordingSink(), lambda: done.set_result(None))
    await done
    assert described == ["tiny"]


def test_least_loaded_uses_worker_stats_and_in_flight() -> None:
    a, b = ScriptedWorkerConnection(), ScriptedWorkerConnection()
    a.latest_stats = Stats(queue_depth=4, running=8, kv_blocks_free=1, kv_blocks_total=1)
    b._open.update(range(5))  # 5 in flight from this gateway, nothing reported
    assert LeastLoaded().choose(RouteRequest("tiny"), [a, b]) is b
    b._open.update(range(5, 20))
    assert LeastLoaded().choose(RouteRequest("tiny"), [a, b]) is a


@pytest.mark.parametrize("body", [CHAT, {**CHAT, "stream": True}, {**CHAT, "logprobs": True}],
                         ids=["whole", "stream", "logprobs"])
async def test_a_replica_that_becomes_ready_takes_half_the_waiting_requests(body: dict[str, object]) -> None:
    stuck = ScriptedWorkerConnection(hang_after=0)  # queued there: no token ever comes
    pool = ModelPool()
    pool.add(stuck)
    app = App(pool)
    moved: list[int] = []
    pool.on_move = moved.append
    sinks = [RecordingSink() for _ in range(6)]
    ended: list[int] = []
    for i, sink in enumerate(sinks):
        app.handle(post(body), sink, lambda i=i: ended.append(i))
    await asyncio.sleep(0.01)
    assert pool.waiting(stuck) == 6 and not ended
    fresh = ScriptedWorkerConnection()  # a restarted or new replica
    pool.add(fresh)  # the supervisor adds it when it is ready
    assert moved == [3] and pool.waiting(stuck) == 3
    for _ in range(50):
        await asyncio.sleep(0)
    assert sorted(ended) == [3, 4, 5]  # the newest three (queued last), served by the new replica
    assert len(fresh.submits) == 3 and sorted(stuck.cancels) == [4, 5, 6]
    for sink in sinks[3:]:
        assert sink.status == 200
        if sink.streamed:
            assert sse_events(sink.body)[-1] == "[DONE]"
        else:
            assert sink.json()["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
    assert all(s.status is None for s in sinks[:3])  # still waiting on the old replica
    assert pool.waiting(fresh) == 0


async def test_started_requests_never_move() -> None:
    slow = ScriptedWorkerConnection(hang_after=2)  # two tokens, then nothing: started
    pool = ModelPool()
    pool.add(slow)
    app = App(pool)
    sinks = [RecordingSink() for _ in range(4)]
    for sink in sinks:
        app.handle(post({**CHAT, "stream": True}), sink, lambda: None)
    await asyncio.sleep(0.01)
    assert pool.waiting(slow) == 0
    fresh = ScriptedWorkerConnection()
    pool.add(fresh)
    assert not fresh.submits and not slow.cancels
