"""HTTP/2 adapter driven by an h2 client connection in memory (fake transport)."""

from __future__ import annotations

import asyncio
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import orjson
import pytest
from h2.errors import ErrorCodes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.http.common import HttpLimits, ServerState, task_entrance
from gateway.http.h2 import H2Protocol

from .conftest import FAST_LIMITS, FakeTransport, Recorder, error_of, make_entrance, settle


class Client:
    """An h2 client core wired to an H2Protocol through a fake transport."""

    def __init__(
        self, limits: HttpLimits = FAST_LIMITS, window: int | None = None, connect: bool = True
    ) -> None:
        self.rec = Recorder()
        self.events: list[Any] = []
        self.state = ServerState(make_entrance(self.rec), limits, self.events.append)
        self.proto = H2Protocol(self.state)
        self.t = FakeTransport()
        self.t.protocol = self.proto
        self.proto.connection_made(self.t)  # type: ignore[arg-type]
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        self.responses: dict[int, dict[str, Any]] = {}
        self.resets: dict[int, int] = {}
        self.goaway: list[h2.events.ConnectionTerminated] = []
        self.ack_data = True
        if connect:
            self.h2.initiate_connection()
            if window is not None:
                self.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
            self.pump()

    def pump(self) -> None:
        """Move bytes both ways until neither side has anything to say."""
        for _ in range(100):
            out = self.h2.data_to_send()
            if out:
                self.proto.data_received(out)
            got = self.t.take()
            if got and not self.goaway:
                for ev in self.h2.receive_data(got):
                    self.on_event(ev)
            if not out and not got:
                return

    def on_event(self, ev: Any) -> None:
        if isinstance(ev, h2.events.ResponseReceived):
            self.responses[ev.stream_id] = {"headers": dict(ev.headers), "body": bytearray(), "ended": False}
        elif isinstance(ev, h2.events.DataReceived):
            self.responses[ev.stream_id]["body"] += ev.data
            if self.ack_data and ev.flow_controlled_length:
                self.open_window(ev.flow_controlled_length, ev.stream_id)
        elif isinstance(ev, h2.events.StreamEnded):
            self.responses[ev.stream_id]["ended"] = True
        elif isinstance(ev, h2.events.StreamReset):
            self.resets[ev.stream_id] = ev.error_code
        elif isinstance(ev, h2.events.ConnectionTerminated):
            self.goaway.append(ev)

    def open_window(self, n: int, sid: int) -> None:
        # explicit WINDOW_UPDATEs: h2's automatic ones batch up to half a 64 KiB window
        try:
            self.h2.increment_flow_control_window(n)
            self.h2.increment_flow_control_window(n, sid)
        except h2.exceptions.ProtocolError:  # stream (or, after GOAWAY, connection) closed
            pass

    def request(
        self,
        path: str,
        body: bytes | None = None,
        extra: list[tuple[bytes, bytes]] | None = None,
        end: bool = True,
        method: bytes | None = None,
    ) -> int:
        sid = self.h2.get_next_available_stream_id()
        headers = [
            (b":method", method or (b"POST" if body is not None else b"GET")),
            (b":path", path.encode() if isinstance(path, str) else path),
            (b":scheme", b"http"),
            (b":authority", b"example"),
            *(extra or []),
        ]
        self.h2.send_headers(sid, headers, end_stream=body is None and end)
        if body is not None:
            self.h2.send_data(sid, body, end_stream=end)
        self.pump()
        return sid

    async def wait(self, cond: Any, timeout: float = 3.0) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while not cond():
            if loop.time() > end:
                raise AssertionError("condition not reached")
            await asyncio.sleep(0.001)
            self.pump()

    def done(self, sid: int) -> bool:
        return sid in self.resets or (sid in self.responses and self.responses[sid]["ended"])

    def status(self, sid: int) -> int:
        return int(self.responses[sid]["headers"][b":status"])

    def close(self) -> None:
        self.proto.connection_lost(None)


async def test_get_post_and_stream() -> None:
    c = Client()
    a = c.request("/echo?x=1")
    b = c.request("/echo", b"hello")
    s = c.request("/stream?n=3")
    await c.wait(lambda: all(c.done(i) for i in (a, b, s)))
    doc = orjson.loads(c.responses[a]["body"])
    assert c.responses[a]["headers"][b"date"].endswith(b" GMT")
    assert doc["protocol"] == "h2" and doc["query"] == "x=1" and doc["host"] == "example"
    assert orjson.loads(c.responses[b]["body"])["body_len"] == 5
    assert bytes(c.responses[s]["body"]) == b"line 0\nline 1\nline 2\n"
    c.close()


async def test_many_concurrent_streams() -> None:
    c = Client()
    c.rec.release.clear()
    ids = [c.request(f"/echo/{i}", b"x" * i) for i in range(100)]
    await c.wait(lambda: all(c.done(i) for i in ids))
    for n, sid in enumerate(ids):
        assert c.status(sid) == 200
        doc = orjson.loads(c.responses[sid]["body"])
        assert doc["path"] == f"/echo/{n}" and doc["body_len"] == n
    c.close()


async def test_flow_control_is_honoured() -> None:
    """A 20 kB response against a 1 kB stream window arrives whole, only as
    fast as the client opens the window."""
    c = Client(window=1024)
    c.ack_data = False
    sid = c.request("/big?n=20000")
    await c.wait(lambda: sid in c.responses and len(c.responses[sid]["body"]) >= 1024)
    await asyncio.sleep(0.05)
    c.pump()
    assert len(c.responses[sid]["body"]) == 1024  # window exhausted: the sender waits
    c.ack_data = True
    c.open_window(1024, sid)
    await c.wait(lambda: c.done(sid))
    assert bytes(c.responses[sid]["body"]) == bytes(i % 251 for i in range(20000))
    c.close()


@pytest.mark.parametrize(
    ("path", "body", "extra", "status"),
    [
        ("/echo", b"x" * 5000, [], 413),
        ("/echo", None, [(b"content-length", b"999999")], 413),
        ("/echo", None, [(b"x-big", b"a" * 3000)], 431),
        ("/echo", None, [(b"x-bad", b"\xc3\x28")], 400),
        (b"/\xff\xfe", None, [], 400),
    ],
    ids=["body-413", "content-length-413", "headers-431", "utf8-header", "utf8-path"],
)
async def test_bad_stream_gets_error_connection_lives(
    path: Any, body: bytes | None, extra: Any, status: int
) -> None:
    c = Client()
    sid = (
        c.request(path, body, extra, end=not extra or extra[0][0] != b"content-length")
        if body is None or len(body) < 4096
        else None
    )
    if sid is None:  # larger than one frame: send in pieces
        sid = c.h2.get_next_available_stream_id()
        c.h2.send_headers(
            sid, [(b":method", b"POST"), (b":path", b"/echo"), (b":scheme", b"http"), (b":authority", b"x")]
        )
        assert body is not None
        for i in range(0, len(body), 1000):
            c.h2.send_data(sid, body[i : i + 1000])
            c.pump()
    await c.wait(lambda: sid in c.responses and c.responses[sid]["ended"])
    assert c.status(sid) == status
    assert c.responses[sid]["headers"][b"content-type"] == b"application/json"
    error_of(bytes(c.responses[sid]["body"]))
    assert [e.status for e in c.events] == [status] and c.events[0].protocol == "h2"
    assert not c.rec.seen
    ok = c.request("/echo")  # same connection keeps serving
    await c.wait(lambda: c.done(ok))
    assert c.status(ok) == 200
    c.close()


async def test_stalled_body_408() -> None:
    c = Client()
    sid = c.request("/echo", b"abc", end=False)
    await c.wait(lambda: c.done(sid), timeout=FAST_LIMITS.body_timeout + 2)
    assert c.status(sid) == 408
    assert "body" in error_of(bytes(c.responses[sid]["body"]))["message"]
    c.close()


async def test_rst_stream_cancels_handler() -> None:
    c = Client()
    sid = c.request("/hold")
    await c.rec.started.wait()
    other = c.request("/echo")
    c.h2.reset_stream(sid, ErrorCodes.CANCEL)
    c.pump()
    await c.wait(lambda: c.rec.cancelled == ["/hold"] and c.done(other))
    assert c.state.in_flight == 0 and c.status(other) == 200
    c.close()


async def test_connection_loss_cancels_all_streams() -> None:
    c = Client()
    c.request("/hold")
    c.request("/hold")
    await c.wait(lambda: len(c.rec.seen) == 2)
    c.close()
    await settle(lambda: c.state.in_flight == 0)
    assert c.rec.cancelled == ["/hold", "/hold"]


async def test_handler_errors() -> None:
    c = Client()
    ids = [c.request(p) for p in ("/apierror", "/boom", "/silent")]
    await c.wait(lambda: all(c.done(i) for i in ids))
    assert [c.status(i) for i in ids] == [404, 500, 500]
    assert error_of(bytes(c.responses[ids[0]]["body"]))["code"] == "model_not_found"
    c.close()


async def test_goaway_on_drain_finishes_open_streams() -> None:
    c = Client()
    held = c.request("/hold")
    await c.rec.started.wait()
    c.state.draining = True
    c.proto.drain()
    c.pump()
    assert c.goaway and c.goaway[0].last_stream_id == held and c.goaway[0].error_code == 0
    assert not c.t.closed
    c.rec.release.set()
    await c.wait(lambda: c.t.closed)
    await settle(lambda: c.state.in_flight == 0)
    assert c.rec.finished == ["/hold"]


async def test_head_has_no_body() -> None:
    c = Client()
    sid = c.request("/echo", method=b"HEAD")
    await c.wait(lambda: c.done(sid))
    assert c.status(sid) == 200 and int(c.responses[sid]["headers"][b"content-length"]) > 0
    assert c.responses[sid]["body"] == b""
    c.close()


async def test_idle_connection_gets_goaway() -> None:
    c = Client(HttpLimits(keepalive_timeout=0.2, body_timeout=5))
    sid = c.request("/echo")
    await c.wait(lambda: c.done(sid))
    assert not c.goaway
    await c.wait(lambda: c.t.closed, timeout=3)
    assert c.goaway and c.goaway[0].error_code == 0 and c.goaway[0].last_stream_id == sid


async def test_new_streams_refused_after_goaway() -> None:
    c = Client()
    held = c.request("/hold")
    await c.rec.started.wait()
    c.proto.drain()
    # the client has not seen the GOAWAY yet and opens another stream
    sid = c.h2.get_next_available_stream_id()
    c.h2.send_headers(
        sid,
        [(b":method", b"GET"), (b":path", b"/echo"), (b":scheme", b"http"), (b":authority", b"x")],
        end_stream=True,
    )
    c.proto.data_received(c.h2.data_to_send())
    assert [r.path for r in c.rec.seen] == ["/hold"]
    c.rec.release.set()
    await settle(lambda: c.state.in_flight == 0)
    assert c.rec.finished == ["/hold"] and held == 1
    c.close()


@settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(min_value=1, max_value=400), max_size=10))
def test_any_split_of_client_bytes(cuts: list[int]) -> None:
    """Preface, SETTINGS, three requests (one with a body) cut anywhere: same answers."""

    async def run() -> list[tuple[int, bytes]]:
        c = Client(connect=False)
        client = c.h2
        client.initiate_connection()
        base = [(b":scheme", b"http"), (b":authority", b"x")]
        client.send_headers(1, [(b":method", b"GET"), (b":path", b"/echo?a=1"), *base], end_stream=True)
        client.send_headers(3, [(b":method", b"POST"), (b":path", b"/echo"), *base])
        client.send_data(3, b"hello", end_stream=True)
        client.send_headers(5, [(b":method", b"GET"), (b":path", b"/stream?n=2"), *base], end_stream=True)
        data = client.data_to_send()
        pos = 0
        for cut in sorted({x for x in cuts if x < len(data)}) + [len(data)]:
            c.proto.data_received(data[pos:cut])
            pos = cut
            await asyncio.sleep(0)
        await c.wait(lambda: all(c.done(i) for i in (1, 3, 5)))
        out = [(c.status(i), bytes(c.responses[i]["body"])) for i in (1, 3, 5)]
        c.close()
        return out

    import uvloop

    (s1, b1), (s3, b3), (s5, b5) = uvloop.run(run())
    assert (s1, s3, s5) == (200, 200, 200)
    assert orjson.loads(b1)["query"] == "a=1" and orjson.loads(b3)["body_len"] == 5
    assert b5 == b"line 0\nline 1\n"


async def test_send_nowait_frames_within_windows_and_refuses_beyond() -> None:
    """Push-mode writes: a chunk that fits the windows is framed at once; one that does not is
    refused whole (nothing framed) and then goes out through ``send``, in order."""
    seen: list[object] = []

    async def handler(req: Any, sink: Any) -> None:
        with pytest.raises(RuntimeError):
            sink.send_nowait(b"early")
        sink.start(200, [(b"content-type", b"text/plain")])
        seen.append(sink.send_nowait(b"a" * 600))
        seen.append(sink.send_nowait(b"b" * 600))  # 1024-byte stream window: does not fit
        await sink.send(b"b" * 600)  # waits for the client to open the window
        seen.append(sink.send_nowait(b""))
        c.proto.pause_writing()
        seen.append(sink.send_nowait(b"c"))
        c.proto.resume_writing()
        sink.end()
        with pytest.raises(RuntimeError):
            sink.send_nowait(b"late")

    c = Client(window=1024)
    c.state.entrance = task_entrance(handler)
    sid = c.request("/s")
    await c.wait(lambda: c.done(sid))
    assert seen == [True, False, True, False]
    assert c.status(sid) == 200 and bytes(c.responses[sid]["body"]) == b"a" * 600 + b"b" * 600
    c.close()


@pytest.mark.parametrize(
    ("extra", "body"),
    [
        ([(b"connection", b"keep-alive")], None),
        ([(b"te", b"gzip")], None),
        ([(b"X-Upper", b"1")], None),
        ([(b"content-length", b"abc")], None),
        ([(b"content-length", b"3")], b"hello"),  # the body is longer
        ([(b"content-length", b"500")], b"hello"),  # the body is shorter
        ([(b":foo", b"b")], None),
        ([(b"host", b"y")], None),  # differs from :authority
    ],
    ids=[
        "connection",
        "te",
        "uppercase",
        "cl-not-a-number",
        "cl-short",
        "cl-long",
        "unknown-pseudo",
        "host-not-authority",
    ],
)
async def test_malformed_request_is_a_400_on_its_stream(extra: Any, body: bytes | None) -> None:
    """RFC 9113 8.1.1: a malformed request is a stream error; the stream beside it runs on."""
    c = Client()
    c.h2.config.validate_outbound_headers = c.h2.config.normalize_outbound_headers = False
    running = c.request("/hold")
    await c.rec.started.wait()
    sid = c.h2.get_next_available_stream_id()
    base = [(b":method", b"POST"), (b":path", b"/echo"), (b":scheme", b"http"), (b":authority", b"x")]
    c.h2.send_headers(sid, base + extra, end_stream=body is None)
    if body is not None:  # in two DATA frames: a length error may show on each
        c.h2.send_data(sid, body[:2])
        c.h2.send_data(sid, body[2:], end_stream=True)
    c.pump()
    await c.wait(lambda: c.done(sid))
    assert (
        c.status(sid) == 400 and "malformed request" in error_of(bytes(c.responses[sid]["body"]))["message"]
    )
    assert [e.status for e in c.events] == [400] and [r.path for r in c.rec.seen] == ["/hold"]
    ok = c.request("/echo")
    await c.wait(lambda: c.done(ok))
    assert c.status(ok) == 200 and not c.done(running) and not c.rec.cancelled
    c.close()


@pytest.mark.parametrize("path", ["/apierror", "/echo-413"])
async def test_error_larger_than_the_window_waits_for_it(path: str) -> None:
    """An error body (the route's 404, the adapter's own 413) that does not fit the client's
    16-byte stream window arrives whole once the window opens: respond() never waits, the
    adapter holds the rest back."""
    c = Client(window=16)
    c.ack_data = False
    if path == "/apierror":
        sid = c.request(path)
    else:
        sid = c.request("/echo", extra=[(b"content-length", b"999999")], end=False)
    await c.wait(lambda: sid in c.responses and len(c.responses[sid]["body"]) == 16)
    await asyncio.sleep(0.05)
    c.pump()
    assert not c.responses[sid]["ended"] and len(c.responses[sid]["body"]) == 16
    c.ack_data = True
    c.open_window(4096, sid)
    await c.wait(lambda: c.done(sid))
    assert c.status(sid) == (404 if path == "/apierror" else 413)
    body = bytes(c.responses[sid]["body"])
    assert int(c.responses[sid]["headers"][b"content-length"]) == len(body) and error_of(body)
    assert c.state.in_flight == 0 and not c.proto._streams  # forgotten once sent
    c.close()
