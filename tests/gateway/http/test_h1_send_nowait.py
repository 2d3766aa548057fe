"""``_H1Sink.send_nowait``: the optional no-wait write used by push-mode SSE streams."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.http.common import ServerState, task_entrance
from gateway.http.h1 import H1Protocol
from gateway.http.types import Request, ResponseSink

from .conftest import FAST_LIMITS, FakeTransport, settle
from .test_h1_bytes import parse_responses

GET = b"GET /s HTTP/1.1\r\nHost: x\r\n\r\n"
HTTP10 = b"GET /s HTTP/1.0\r\nHost: x\r\n\r\n"


def serve(handler: Any) -> tuple[H1Protocol, FakeTransport]:
    proto = H1Protocol(ServerState(task_entrance(handler), FAST_LIMITS, None))
    t = FakeTransport()
    t.protocol = proto
    proto.connection_made(t)  # type: ignore[arg-type]
    return proto, t


async def test_send_nowait_chunks_in_order_with_send() -> None:
    async def handler(req: Request, sink: ResponseSink) -> None:
        sink.start(200, [(b"content-type", b"text/plain")])
        assert sink.send_nowait(b"a")
        await sink.send(b"bb")
        assert sink.send_nowait(b"ccc")
        await asyncio.sleep(0)
        assert sink.send_nowait(b"dddd")
        assert sink.send_nowait(b"")
        sink.end()

    proto, t = serve(handler)
    proto.data_received(GET + GET)
    await settle(lambda: bytes(t.out).count(b"\r\n0\r\n\r\n") == 2)
    for status, headers, body in parse_responses(bytes(t.out)):
        assert status == 200 and headers[b"transfer-encoding"] == b"chunked"
        assert body == b"abbcccdddd"


async def test_send_nowait_refuses_while_paused_and_outside_the_body() -> None:
    seen: list[object] = []

    async def handler(req: Request, sink: ResponseSink) -> None:
        try:
            sink.send_nowait(b"x")
        except RuntimeError as e:
            seen.append(e)
        sink.start(200, [])
        proto.pause_writing()
        seen.append(sink.send_nowait(b"held"))
        proto.resume_writing()
        seen.append(sink.send_nowait(b"ok"))
        sink.end()
        try:
            sink.send_nowait(b"late")
        except RuntimeError as e:
            seen.append(e)

    proto, t = serve(handler)
    proto.data_received(GET)
    await settle(lambda: len(seen) == 4)
    await settle(lambda: bytes(t.out).endswith(b"\r\n0\r\n\r\n"))
    assert isinstance(seen[0], RuntimeError) and seen[1] is False and seen[2] is True
    assert isinstance(seen[3], RuntimeError)
    assert parse_responses(bytes(t.out))[0][2] == b"ok"  # the refused chunk was not written


async def test_send_nowait_http10_unframed_body() -> None:
    async def handler(req: Request, sink: ResponseSink) -> None:
        sink.start(200, [])
        assert sink.send_nowait(b"one ")
        assert sink.send_nowait(b"two")
        sink.end()

    proto, t = serve(handler)
    proto.data_received(HTTP10)
    await settle(lambda: t.closed)
    head, _, body = bytes(t.out).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and body == b"one two"


async def test_end_after_a_direct_chunk_writes_at_once() -> None:
    """A stream's last chunk went straight to the transport: ``end()`` writes the terminating
    chunk then too, not from a flush a loop iteration later; with output queued it stays behind it."""
    seen: list[bytes] = []

    async def handler(req: Request, sink: ResponseSink) -> None:
        sink.start(200, [])
        await asyncio.sleep(0)  # the head is flushed: nothing queued
        assert sink.send_nowait(b"x")
        sink.end()
        seen.append(bytes(t.out))
        assert not proto._flush_scheduled

    proto, t = serve(handler)
    proto.data_received(GET)
    await settle(lambda: len(seen) == 1)
    assert seen[0].endswith(b"\r\n\r\n1\r\nx\r\n0\r\n\r\n")

    async def queued(req: Request, sink: ResponseSink) -> None:
        sink.start(200, [])  # the head is queued: the last chunk goes behind it
        sink.end()

    proto, t = serve(queued)
    proto.data_received(GET + GET)
    await settle(lambda: bytes(t.out).count(b"\r\n0\r\n\r\n") == 2)
    assert [body for _, _, body in parse_responses(bytes(t.out))] == [b"", b""]
