"""HTTP/2 request bodies handed to the entrance at HEADERS (``streams_body``), read as they
arrive: the stream window reopens only as the handler reads, the body limit holds, a reset
fails the read, ``done`` comes once; requests the predicate does not pick are read whole.
A real listener on 127.0.0.1 port 0 and the raw h2 client of tests/gateway/grpc/h2_client.py."""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import AsyncIterator

import h2.events
import pytest

from gateway.errors import APIError
from gateway.http.common import HttpLimits, task_entrance
from gateway.http.listeners import ListenerSpec, StreamListener, start_listener
from gateway.http.types import Request, ResponseSink
from tests.gateway.grpc.h2_client import RawH2

pytestmark = pytest.mark.timeout(30)

WINDOW = 65535  # the stream window the server advertises here (HttpLimits.h2_initial_window_size)


class Reader:
    """A handler that reads its body only when told to, and records what happened."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.got = bytearray()
        self.streamed: list[bool] = []
        self.error: BaseException | None = None
        self.ended = asyncio.Event()

    async def __call__(self, req: Request, sink: ResponseSink) -> None:
        self.streamed.append(req.stream is not None)
        try:
            if req.stream is None:
                self.got += req.body
            else:
                await self.go.wait()
                while chunk := await req.stream.read():
                    self.got += chunk
        except (ConnectionError, APIError) as e:
            self.error = e
            raise
        finally:
            self.ended.set()
        sink.respond(200, [], b"%d" % len(self.got))


@pytest.fixture
async def served() -> AsyncIterator[tuple[StreamListener, Reader]]:
    reader = Reader()
    listener = await start_listener(task_entrance(reader), ListenerSpec("tcp", "127.0.0.1", 0),
                                    limits=HttpLimits(h2_initial_window_size=WINDOW, max_body_bytes=200_000),
                                    streams_body=lambda req: req.path == "/stream")
    try:
        yield listener, reader
    finally:
        await listener.close()


def _window_updates(c: RawH2, sid: int) -> int:
    return sum(1 for e in c.events if isinstance(e, h2.events.WindowUpdated) and e.stream_id == sid)


async def test_the_window_reopens_only_as_the_handler_reads(served: tuple[StreamListener, Reader]) -> None:
    listener, reader = served
    async with RawH2(listener.port) as c:
        sid = c.request("/stream", [])
        c.data(sid, b"x" * WINDOW)  # the whole stream window, nothing read yet
        assert c.conn.local_flow_control_window(sid) == 0
        await c.until(lambda: reader.streamed == [True])  # the call runs before the body has ended
        await asyncio.sleep(0.2)  # what the server would have acknowledged by now, had it not waited
        assert _window_updates(c, sid) == 0 and c.conn.local_flow_control_window(sid) == 0
        reader.go.set()
        await c.until(lambda: _window_updates(c, sid) > 0)
        assert c.conn.local_flow_control_window(sid) > 0
        c.data(sid, b"y" * 1000, end=True)
        await c.until(lambda: c.ended(sid))
        assert c.headers(sid)[0][b":status"] == b"200" and c.body(sid) == b"%d" % (WINDOW + 1000)
    assert listener.in_flight == 0


async def test_the_body_limit_holds_for_a_streamed_body(served: tuple[StreamListener, Reader]) -> None:
    listener, reader = served
    reader.go.set()
    async with RawH2(listener.port) as c:
        sid = c.request("/stream", [])
        sent = 0
        while sent <= 200_000:  # past the limit, as fast as the reads reopen the window
            await c.until(lambda: c.conn.local_flow_control_window(sid) > 0)
            n = min(c.conn.local_flow_control_window(sid), 16384)
            c.data(sid, b"z" * n)
            sent += n
        await c.until(lambda: c.ended(sid))
        assert c.headers(sid)[0][b":status"] == b"413"
    assert isinstance(reader.error, APIError) and reader.error.status == 413
    assert listener.in_flight == 0


async def test_a_reset_fails_the_read_and_done_comes_once(served: tuple[StreamListener, Reader]) -> None:
    listener, reader = served
    async with RawH2(listener.port) as c:
        sid = c.request("/stream", [])
        c.data(sid, b"abc")
        await c.until(lambda: reader.streamed == [True])
        c.reset(sid)
        reader.go.set()
        await asyncio.wait_for(reader.ended.wait(), 10)
        await c.until(lambda: listener.in_flight == 0)
        assert listener.in_flight == 0  # not below: done() came once
        sid2 = c.request("/other", [])  # not picked: read whole, as before
        c.data(sid2, b"q" * 10, end=True)
        await c.until(lambda: c.ended(sid2))
        assert c.body(sid2) == b"10" and reader.streamed == [True, False]
    assert reader.error is None or isinstance(reader.error, ConnectionError)


async def test_a_body_ended_by_the_client_reads_to_its_end(served: tuple[StreamListener, Reader]) -> None:
    listener, reader = served
    reader.go.set()
    async with RawH2(listener.port) as c:
        sid = c.request("/stream", [])
        for piece in (b"a", b"", b"bc", b"def"):
            c.data(sid, piece)
        c.end(sid)
        await c.until(lambda: c.ended(sid))
        assert c.body(sid) == b"6" and reader.got == b"abcdef"


def _one_byte_frames(sid: int, n: int) -> bytes:
    """``n`` DATA frames of one byte each, built by hand (h2 would send them too, but slowly)."""
    return (b"\x00\x00\x01\x00\x00" + sid.to_bytes(4, "big") + b"x") * n


@pytest.mark.parametrize("path", ["/stream", "/whole"])
async def test_a_body_sent_a_byte_a_frame_costs_about_a_byte_a_byte(served: tuple[StreamListener, Reader],
                                                                    path: str) -> None:
    """Unread (streamed) or not yet ended (read whole), a body held as one object per DATA frame
    cost ~100 (streamed) or ~40 (whole) bytes of memory per byte of window or body limit: with
    the 16 MiB connection window, GBs a connection. Small frames are joined as they arrive."""
    listener, reader = served
    n = 20_000  # under the stream window and the body limit
    async with RawH2(listener.port, window=1 << 20) as c:
        sid = c.request(path, [])
        await asyncio.sleep(0.05)
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            frames = _one_byte_frames(sid, 5_000)
            for _ in range(n // 5_000):
                c.raw(frames)
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)
            grown = tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
        assert grown < 8 * n, f"{grown / n:.0f} bytes of memory per byte held"
        reader.go.set()
        c.end(sid)
        await c.until(lambda: c.ended(sid))
        assert c.body(sid) == b"%d" % n and bytes(reader.got) == b"x" * n
    assert listener.in_flight == 0
