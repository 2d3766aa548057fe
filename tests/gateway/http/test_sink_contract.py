"""The adapter side of the Entrance contract (gateway/http/types.py), on HTTP/1.1 and HTTP/2
alike, driven by a no-task entrance as the pipeline is: it answers through the sink from
callbacks (inline in the entrance call, too), calls ``done()`` once, never from inside the
entrance; the adapter cancels the call when the client goes away; ``abort()`` cuts a started
response; ``send`` raises ``ClientDisconnected`` once the client is gone."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from h2.errors import ErrorCodes

from gateway.http.common import ClientDisconnected, ServerState
from gateway.http.h1 import H1Protocol
from gateway.http.types import Request, ResponseSink

from .conftest import FAST_LIMITS, FakeTransport, settle
from .test_h1_bytes import parse_responses
from .test_h2_memory import Client

Script = Callable[[Request, ResponseSink, Callable[[], None], "Call"], None]


class Call:
    """A callback-driven call: records cancel()."""

    def __init__(self) -> None:
        self.cancelled = 0

    def cancel(self) -> None:
        self.cancelled += 1


class Entrance:
    """Runs ``script`` for each request; checks done() comes once and never inside the call."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.calls: list[Call] = []
        self.done_count = 0
        self.inside = False

    def __call__(self, req: Request, sink: ResponseSink, done: Callable[[], None]) -> Call:
        call = Call()
        self.calls.append(call)

        def once() -> None:
            assert not self.inside, "done() from inside the entrance call"
            self.done_count += 1
            done()

        self.inside = True
        try:
            self.script(req, sink, once, call)
        finally:
            self.inside = False
        return call


class H1:
    def __init__(self, entrance: Entrance) -> None:
        self.state = ServerState(entrance, FAST_LIMITS, None)
        self.proto = H1Protocol(self.state)
        self.t = FakeTransport()
        self.t.protocol = self.proto
        self.proto.connection_made(self.t)  # type: ignore[arg-type]

    def get(self, n: int = 1) -> None:
        self.proto.data_received(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n" * n)

    def leave(self) -> None:
        self.proto.connection_lost(None)


def later(fn: Callable[[], Any]) -> None:
    asyncio.get_running_loop().call_soon(fn)


def inline_respond(req: Request, sink: ResponseSink, done: Callable[[], None], call: Call) -> None:
    sink.respond(200, [(b"content-type", b"text/plain")], b"hi")
    later(done)


def callback_stream(req: Request, sink: ResponseSink, done: Callable[[], None], call: Call) -> None:
    sink.start(200, [])

    def step(i: int) -> None:
        if i == 3:
            sink.end()
            done()
            return
        assert sink.send_nowait(b"%d" % i)
        later(lambda: step(i + 1))

    later(lambda: step(0))


def cut(req: Request, sink: ResponseSink, done: Callable[[], None], call: Call) -> None:
    sink.start(200, [])
    assert sink.send_nowait(b"partial")
    later(lambda: (sink.abort(), done()))


@pytest.mark.parametrize(("script", "body"), [(inline_respond, b"hi"), (callback_stream, b"012")])
async def test_h1_no_task_pipeline(script: Script, body: bytes) -> None:
    e = Entrance(script)
    c = H1(e)
    c.get(3)
    await settle(lambda: e.done_count == 3 and c.state.in_flight == 0)
    await settle()
    assert [(s, b) for s, _, b in parse_responses(c.t.take())] == [(200, body)] * 3
    assert not c.t.closed and not any(call.cancelled for call in e.calls)


@pytest.mark.parametrize(("script", "body"), [(inline_respond, b"hi"), (callback_stream, b"012")])
async def test_h2_no_task_streams(script: Script, body: bytes) -> None:
    e = Entrance(script)
    c = Client()
    c.state.entrance = e
    ids = [c.request("/x") for _ in range(3)]
    await c.wait(lambda: all(c.done(i) for i in ids) and c.state.in_flight == 0)
    assert [(c.status(i), bytes(c.responses[i]["body"])) for i in ids] == [(200, body)] * 3
    assert e.done_count == 3 and not c.resets and not c.proto._streams
    c.close()


async def test_h1_abort_closes_without_the_last_chunk() -> None:
    e = Entrance(cut)
    c = H1(e)
    c.get(2)  # the second is never answered: the connection ends with the cut response
    await settle(lambda: c.t.closed)
    out = c.t.take()
    assert out.startswith(b"HTTP/1.1 200 OK\r\n") and out.endswith(b"7\r\npartial\r\n")  # no 0\r\n\r\n
    assert e.done_count == 1


async def test_h2_abort_resets_the_stream_only() -> None:
    e = Entrance(cut)
    c = Client()
    c.state.entrance = e
    sid = c.request("/x")
    await c.wait(lambda: sid in c.resets)
    assert c.resets[sid] == ErrorCodes.INTERNAL_ERROR and bytes(c.responses[sid]["body"]) == b"partial"
    c.state.entrance = Entrance(inline_respond)
    ok = c.request("/x")
    await c.wait(lambda: c.done(ok))
    assert c.status(ok) == 200 and not c.t.closed
    c.close()


def held_sender(sent: list[object]) -> Script:
    """Starts a stream and sends from its own task (not the Call), until the client goes."""

    def script(req: Request, sink: ResponseSink, done: Callable[[], None], call: Call) -> None:
        sink.start(200, [])

        async def pump() -> None:
            try:
                while True:
                    await sink.send(b"x" * 65536)
                    sent.append(1)
            except ClientDisconnected as e:
                sent.append(e)
            finally:
                done()

        asyncio.get_running_loop().create_task(pump())

    return script


async def test_h1_client_gone_cancels_and_send_raises() -> None:
    sent: list[object] = []
    e = Entrance(held_sender(sent))
    c = H1(e)
    c.proto.pause_writing()  # the client is not reading: the first send waits
    c.get()
    await settle()
    assert c.t.out and not sent
    c.leave()
    await settle(lambda: e.done_count == 1)
    assert len(sent) == 1 and isinstance(sent[0], ClientDisconnected)
    assert [call.cancelled for call in e.calls] == [1] and c.state.in_flight == 0


async def test_h2_reset_cancels_and_send_raises() -> None:
    sent: list[object] = []
    e = Entrance(held_sender(sent))
    c = Client(window=65535)
    c.state.entrance = e
    c.ack_data = False  # the window fills: send waits for a WINDOW_UPDATE
    sid = c.request("/x")
    await c.wait(lambda: sid in c.responses and len(c.responses[sid]["body"]) >= 65535)
    c.h2.reset_stream(sid, ErrorCodes.CANCEL)
    c.pump()
    await settle(lambda: e.done_count == 1)
    assert isinstance(sent[-1], ClientDisconnected)
    assert [call.cancelled for call in e.calls] == [1] and c.state.in_flight == 0 and not c.proto._streams
    c.close()
