"""HTTP/1.1 adapter fed raw bytes through a fake transport (test double):
whole, one byte at a time, and in random splits; limits and bad input."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import h11
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.http.common import HttpLimits, ServerState
from gateway.http.h1 import H1Protocol

from .conftest import FAST_LIMITS, FakeTransport, Recorder, error_of, make_entrance, settle


def make_conn(
    limits: HttpLimits = FAST_LIMITS,
) -> tuple[H1Protocol, FakeTransport, Recorder, ServerState, list[Any]]:
    rec = Recorder()
    events: list[Any] = []
    state = ServerState(make_entrance(rec), limits, events.append)
    proto = H1Protocol(state)
    t = FakeTransport()
    t.protocol = proto
    proto.connection_made(t)  # type: ignore[arg-type]
    return proto, t, rec, state, events


def parse_responses(
    data: bytes, methods: list[bytes] | None = None
) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    """Parse every complete response in ``data`` with h11 (an independent parser)."""
    conn = h11.Connection(h11.CLIENT)
    out: list[tuple[int, dict[bytes, bytes], bytes]] = []
    methods = list(methods or [])
    conn.receive_data(data)
    while True:
        if conn.our_state is h11.IDLE:
            method = methods.pop(0) if methods else b"GET"
            conn.send(h11.Request(method=method, target="/", headers=[("host", "x")]))
            conn.send(h11.EndOfMessage())
        ev = conn.next_event()
        if ev is h11.NEED_DATA or ev is h11.PAUSED and conn.their_state is not h11.DONE:
            return out
        if isinstance(ev, h11.Response):
            status, headers, body = ev.status_code, dict(ev.headers), bytearray()
        elif isinstance(ev, h11.Data):
            body += ev.data
        elif isinstance(ev, h11.EndOfMessage):
            out.append((status, headers, bytes(body)))
            if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                return out
            conn.start_next_cycle()
        elif isinstance(ev, h11.ConnectionClosed) or ev is h11.PAUSED:
            return out


GET = b"GET /echo?a=1 HTTP/1.1\r\nHost: example\r\n\r\n"
POST = b"POST /echo HTTP/1.1\r\nHost: example\r\nContent-Length: 5\r\n\r\nhello"
CHUNKED = b"POST /echo HTTP/1.1\r\nHost: example\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nhel\r\n2\r\nlo\r\n0\r\n\r\n"
STREAM = b"GET /stream?n=3 HTTP/1.1\r\nHost: example\r\n\r\n"
HEAD = b"HEAD /echo HTTP/1.1\r\nHost: example\r\n\r\n"
PIPELINE = GET + POST + CHUNKED + STREAM + HEAD


def check_pipeline(out: bytes) -> None:
    res = parse_responses(out, [b"GET", b"POST", b"POST", b"GET", b"HEAD"])
    assert [r[0] for r in res] == [200, 200, 200, 200, 200]
    assert all(r[1][b"date"].endswith(b" GMT") for r in res)
    docs = [orjson.loads(r[2]) for r in res[:3]]
    assert docs[0]["query"] == "a=1" and docs[0]["method"] == "GET" and docs[0]["host"] == "example"
    assert docs[1]["body_len"] == 5 and docs[2]["body_len"] == 5
    assert docs[1]["body_sum"] == docs[2]["body_sum"] == sum(b"hello")
    assert res[3][1][b"transfer-encoding"] == b"chunked" and res[3][2] == b"line 0\nline 1\nline 2\n"
    assert res[4][2] == b"" and int(res[4][1][b"content-length"]) > 0  # HEAD: length, no body


async def feed(proto: H1Protocol, data: bytes, cuts: list[int]) -> None:
    pos = 0
    for cut in sorted(set(cuts)) + [len(data)]:
        if cut > pos:
            proto.data_received(data[pos:cut])
            pos = cut
            await asyncio.sleep(0)


@pytest.mark.parametrize("mode", ["whole", "bytewise"])
async def test_pipelined_requests_answered_in_order(mode: str) -> None:
    proto, t, rec, state, _ = make_conn()
    cuts = list(range(len(PIPELINE))) if mode == "bytewise" else []
    await feed(proto, PIPELINE, cuts)
    await settle(lambda: len(rec.finished) == 5 and state.in_flight == 0)
    await settle()
    check_pipeline(t.take())
    assert not t.closed


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(min_value=1, max_value=len(PIPELINE) - 1), max_size=12))
def test_any_split_gives_same_responses(cuts: list[int]) -> None:
    async def run() -> bytes:
        proto, t, rec, state, _ = make_conn()
        await feed(proto, PIPELINE, cuts)
        await settle(lambda: len(rec.finished) == 5 and state.in_flight == 0)
        await settle()
        return t.take()

    import uvloop

    check_pipeline(uvloop.run(run()))


async def test_pipelined_responses_never_interleave_with_streaming() -> None:
    proto, t, rec, state, _ = make_conn()
    proto.data_received(b"GET /stream?n=4&delay=0.01 HTTP/1.1\r\nHost: x\r\n\r\n" + GET)
    await settle(lambda: len(rec.finished) == 2 and state.in_flight == 0)
    await settle()
    res = parse_responses(t.take())
    assert res[0][2] == b"line 0\nline 1\nline 2\nline 3\n"
    assert orjson.loads(res[1][2])["path"] == "/echo"


async def test_expect_100_continue() -> None:
    proto, t, rec, _, _ = make_conn()
    proto.data_received(
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n"
    )
    await settle()
    assert t.take() == b"HTTP/1.1 100 Continue\r\n\r\n"
    proto.data_received(b"abc")
    await settle(lambda: rec.finished)
    await settle()
    ((status, _, body),) = parse_responses(t.take(), [b"POST"])
    assert status == 200 and orjson.loads(body)["body_len"] == 3


async def test_expect_100_continue_refused_when_too_large() -> None:
    proto, t, rec, _, events = make_conn()
    proto.data_received(
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 999999\r\nExpect: 100-continue\r\n\r\n"
    )
    await settle()
    out = t.take()
    assert b"100 Continue" not in out
    ((status, headers, body),) = parse_responses(out)
    assert status == 413 and headers[b"connection"] == b"close"
    assert error_of(body)["type"] == "invalid_request_error"
    assert [e.status for e in events] == [413] and not rec.seen


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
        (b"GET /\xff\xfe HTTP/1.1\r\nHost: x\r\n\r\n", 400),
        (b"GET /%ff%fe HTTP/1.1\r\nHost: x\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\nX-Name: \xc3\x28\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 3000 + b"\r\n\r\n", 431),
        (b"GET /" + b"a" * 3000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 431),
        (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n", 413),
        (
            b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"800\r\n"
            + b"a" * 2048
            + b"\r\n"
            + b"800\r\n"
            + b"a" * 2048
            + b"\r\n"
            + b"800\r\na",
            413,
        ),
    ],
    ids=[
        "garbage",
        "bad-content-length",
        "cl-and-te",
        "raw-utf8-target",
        "pct-utf8-target",
        "utf8-header",
        "big-header",
        "big-target",
        "content-length-413",
        "chunked-413",
    ],
)
async def test_bad_input_gets_json_error_and_close(raw: bytes, status: int) -> None:
    proto, t, rec, state, events = make_conn()
    proto.data_received(raw)
    await settle()
    ((got, headers, body),) = parse_responses(t.take())
    assert got == status
    assert headers[b"content-type"] == b"application/json" and headers[b"connection"] == b"close"
    error_of(body)
    assert t.eof  # write side shut; input drained until linger ends
    assert [e.status for e in events] == [status] and events[0].protocol == "http/1.1"
    assert not rec.seen
    proto.data_received(b"more junk the client was still sending")  # ignored, no crash
    await settle(lambda: t.closed, timeout=FAST_LIMITS.linger_timeout + 1)


def _req(version: bytes, *headers: bytes, body: bytes = b"") -> bytes:
    return b"POST /echo HTTP/%s\r\n%s\r\n%s" % (version, b"".join(h + b"\r\n" for h in headers), body)


CHUNKED_BODY = b"5\r\nhello\r\n0\r\n\r\n"
CL5 = b"Content-Length: 5"


@pytest.mark.parametrize(
    ("raw", "status", "code"),
    [
        (_req(b"1.1", CL5, body=b"hello"), 400, None),
        (_req(b"1.1", b"Host: a", b"Host: a", CL5, body=b"hello"), 400, None),
        (_req(b"1.0", b"Host: a", b"host: b", CL5, body=b"hello"), 400, None),
        (_req(b"1.1", b"Host: a b", CL5, body=b"hello"), 400, None),
        (_req(b"1.1", b"Host: user@evil", CL5, body=b"hello"), 400, None),
        (_req(b"1.1", b"Host: x/y", CL5, body=b"hello"), 400, None),
        (_req(b"1.1", b"Host: x", b"Transfer-Encoding: gzip, chunked", body=CHUNKED_BODY), 501,
         "unsupported_transfer_encoding"),
        (_req(b"1.1", b"Host: x", b"Transfer-Encoding: gzip", b"Transfer-Encoding: chunked", body=CHUNKED_BODY),
         501, "unsupported_transfer_encoding"),
        (_req(b"1.1", b"Host: x", b"Transfer-Encoding: x-custom;a=1 , Chunked", body=CHUNKED_BODY), 501,
         "unsupported_transfer_encoding"),
        (_req(b"1.1", b"Host: x", b"Transfer-Encoding: gzip", body=b"hello"), 400, None),
        (_req(b"1.1", b"Host: x", b"Transfer-Encoding: chunked, gzip", body=CHUNKED_BODY), 400, None),
        (_req(b"1.1", b"Host: x", b"Transfer-Encoding: chunked, chunked", body=CHUNKED_BODY), 400, None),
    ],
    ids=["1.1-no-host", "two-hosts", "1.0-two-hosts", "host-space", "host-userinfo", "host-slash",
         "gzip-chunked", "gzip-then-chunked-lines", "custom-chunked", "gzip-alone", "chunked-not-last",
         "chunked-twice"],
)
async def test_host_and_transfer_coding_rules(raw: bytes, status: int, code: str | None) -> None:
    """RFC 9112 3.2 (one valid Host; none only in 1.0) and 6.1/6.3 (a coding we do not decode is
    501, chunked missing, not last or twice is 400). The error closes the connection: nothing
    after it is run."""
    for pieces in ([raw + GET], [raw[i : i + 1] for i in range(len(raw))] + [GET]):
        proto, t, rec, state, events = make_conn()
        for piece in pieces:
            proto.data_received(piece)
        await settle()
        ((got, headers, body),) = parse_responses(t.take(), [b"POST", b"GET"])
        assert (got, headers[b"connection"]) == (status, b"close")
        assert error_of(body)["code"] == code
        assert [e.status for e in events] == [status] and not rec.seen and t.eof


@pytest.mark.parametrize(
    "raw",
    [
        _req(b"1.0", CL5, body=b"hello"),
        _req(b"1.1", b"Host:", CL5, body=b"hello"),
        _req(b"1.1", b"Host: [::1]:8080", CL5, body=b"hello"),
        _req(b"1.1", b"host: Example.COM:80", CL5, body=b"hello"),
        _req(b"1.1", b"Host: xn--bcher-kva.example", b"Transfer-Encoding: Chunked", body=CHUNKED_BODY),
    ],
    ids=["1.0-no-host", "empty-host", "ipv6-host", "host-port", "chunked-any-case"],
)
async def test_valid_host_and_transfer_coding_are_served(raw: bytes) -> None:
    proto, t, rec, state, events = make_conn()
    proto.data_received(raw)
    await settle(lambda: rec.finished)
    await settle()
    ((got, _, body),) = parse_responses(t.take(), [b"POST"])
    assert got == 200 and orjson.loads(body)["body_len"] == 5 and not events


async def test_header_flood_in_many_pieces_is_cut_off() -> None:
    """A header that never ends is refused before it is buffered without bound."""
    proto, t, _, _, _ = make_conn()
    proto.data_received(b"GET / HTTP/1.1\r\nX-A: ")
    for _ in range(40):
        if t.out:
            break
        proto.data_received(b"a" * 100)
    ((status, _, body),) = parse_responses(t.take())
    assert status == 431
    error_of(body)


async def test_error_after_pipelined_request_waits_its_turn() -> None:
    proto, t, rec, state, _ = make_conn()
    proto.data_received(b"GET /stream?n=3&delay=0.01 HTTP/1.1\r\nHost: x\r\n\r\nBROKEN\r\n\r\n")
    await settle(lambda: rec.finished)
    await settle()
    res = parse_responses(t.take())
    assert [r[0] for r in res] == [200, 400]
    assert res[0][2] == b"line 0\nline 1\nline 2\n"


async def test_header_timeout_408() -> None:
    proto, t, rec, _, events = make_conn()
    proto.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n")
    await asyncio.sleep(FAST_LIMITS.header_timeout + 0.2)
    ((status, headers, body),) = parse_responses(t.take())
    assert status == 408 and headers[b"connection"] == b"close"
    assert "header" in error_of(body)["message"]
    assert [e.status for e in events] == [408]


async def test_stalled_body_408() -> None:
    limits = HttpLimits(body_timeout=1.0)
    proto, t, rec, _, events = make_conn(limits)
    proto.data_received(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
    await asyncio.sleep(0.3)
    proto.data_received(b"de")  # progress resets the stall timer
    await asyncio.sleep(0.8)  # 1.1 s after the start, 0.8 s after the last byte
    assert not t.out
    await settle(lambda: t.out, timeout=2)
    ((status, _, body),) = parse_responses(t.take())
    assert status == 408 and "body" in error_of(body)["message"]
    assert not rec.seen and [e.status for e in events] == [408]


async def test_keepalive_idle_timeout_closes_quietly() -> None:
    limits = HttpLimits(keepalive_timeout=0.6, header_timeout=5, body_timeout=5)
    proto, t, rec, _, events = make_conn(limits)
    proto.data_received(GET)
    await settle(lambda: rec.finished)
    await asyncio.sleep(0.05)
    assert not t.closed
    await settle(lambda: t.closed, timeout=2)
    assert not events
    assert [r[0] for r in parse_responses(t.take())] == [200]


async def test_connection_close_and_http10() -> None:
    proto, t, rec, _, _ = make_conn()
    proto.data_received(b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" + GET)
    await settle(lambda: t.closed)
    res = parse_responses(t.take())
    assert len(res) == 1 and res[0][1][b"connection"] == b"close"
    assert len(rec.seen) == 1  # nothing after "connection: close" is read

    proto, t, rec, _, _ = make_conn()
    proto.data_received(b"GET /stream?n=2 HTTP/1.0\r\n\r\n")
    await settle(lambda: t.closed)
    out = t.take()
    assert out.startswith(b"HTTP/1.1 200 OK\r\n") and b"chunked" not in out
    assert out.endswith(b"\r\n\r\nline 0\nline 1\n")


async def test_handler_errors_become_json() -> None:
    proto, t, rec, state, _ = make_conn()
    proto.data_received(
        b"GET /apierror HTTP/1.1\r\nHost: x\r\n\r\nGET /boom HTTP/1.1\r\nHost: x\r\n\r\n"
        b"GET /silent HTTP/1.1\r\nHost: x\r\n\r\n" + GET
    )
    await settle(lambda: len(rec.seen) == 4 and state.in_flight == 0)
    await settle()
    res = parse_responses(t.take())
    assert [r[0] for r in res] == [404, 500, 500, 200]
    assert error_of(res[0][2]) == {
        "message": "no such thing",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    assert error_of(res[1][2])["type"] == "server_error"
    assert "handler bug" not in res[1][2].decode()  # internals stay in the log


async def test_disconnect_cancels_handler() -> None:
    proto, t, rec, state, _ = make_conn()
    proto.data_received(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
    await rec.started.wait()
    assert state.in_flight == 1
    proto.connection_lost(None)
    await settle(lambda: state.in_flight == 0)
    assert rec.cancelled == ["/hold"]


async def test_pipelining_depth_holds_input_then_pauses_reading() -> None:
    """Past ``max_pipelined`` waiting requests, input is held unparsed while reading goes on (so a
    client that leaves is still noticed); reading pauses once the held input passes 64 KiB."""
    proto, t, rec, state, _ = make_conn()
    proto.data_received(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n" + GET * FAST_LIMITS.max_pipelined)
    await rec.started.wait()
    more = (64 << 10) // len(GET) + 1
    for _ in range(more):
        assert not t.paused
        proto.data_received(GET)
    assert t.paused and len(rec.seen) == 1
    rec.release.set()
    await settle(lambda: len(rec.finished) == 1 + FAST_LIMITS.max_pipelined + more)
    assert not t.paused
    assert [r.query for r in rec.seen[1:]] == ["a=1"] * (FAST_LIMITS.max_pipelined + more)
    res = parse_responses(t.take())
    assert len(res) == 1 + FAST_LIMITS.max_pipelined + more and res[0][2] == b"first\nsecond\n"


async def test_paused_reading_still_sees_the_client_leave() -> None:
    """With reading paused behind held input, a client that closes (its unread bytes still queued
    in our socket) is noticed by polling the socket: the running request is cancelled."""
    ours, theirs = socket.socketpair()
    try:
        rec = Recorder()
        state = ServerState(make_entrance(rec), FAST_LIMITS, None)
        proto = H1Protocol(state)
        t = FakeTransport({"peername": ("127.0.0.1", 5555), "socket": ours})
        t.protocol = proto
        proto.connection_made(t)  # type: ignore[arg-type]
        proto.data_received(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n" + GET * FAST_LIMITS.max_pipelined)
        await rec.started.wait()
        while not t.paused:
            proto.data_received(GET * 64)
        theirs.sendall(GET)  # what a paused read leaves unread
        await asyncio.sleep(0.6)
        assert not t.closed and not rec.cancelled  # a client that is there is left alone
        theirs.close()
        await settle(lambda: rec.cancelled == ["/hold"], timeout=1.0)
        assert t.closed and state.in_flight == 0 and len(rec.seen) == 1
    finally:
        ours.close()
        theirs.close()


async def test_held_input_keeps_order_and_errors_last() -> None:
    """Input held while the pipeline is full is parsed later in order, a bad request in it included."""
    proto, t, rec, state, _ = make_conn()
    proto.data_received(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n" + GET * FAST_LIMITS.max_pipelined)
    await rec.started.wait()
    for piece in (POST[:20], POST[20:] + CHUNKED, b"BROKEN\r\n\r\n" + GET):
        proto.data_received(piece)
    rec.release.set()
    await settle(lambda: t.closed, timeout=FAST_LIMITS.linger_timeout + 1)
    res = parse_responses(t.take(), [b"GET"] * (1 + FAST_LIMITS.max_pipelined) + [b"POST", b"POST", b"GET"])
    assert [r[0] for r in res] == [200] * (3 + FAST_LIMITS.max_pipelined) + [400]
    assert [orjson.loads(r[2])["body_len"] for r in res[-3:-1]] == [5, 5]


async def test_h2c_preface_hands_over() -> None:
    proto, t, rec, state, _ = make_conn()
    proto.data_received(b"PRI * HTTP/2.0\r\n")  # partial preface: wait and see
    assert not t.out
    proto.data_received(b"\r\nSM\r\n\r\n")
    assert t.protocol is not proto and type(t.protocol).__name__ == "H2Protocol"
    assert t.out[3] == 0x04  # the server's SETTINGS frame
    t.protocol.connection_lost(None)


UPGRADE_POST = (
    b"POST /echo HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
    b"HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\nContent-Length: 5\r\n\r\nhello"
)


@pytest.mark.parametrize("mode", ["whole", "bytewise"])
async def test_upgrade_request_answered_as_http11_with_its_body(mode: str) -> None:
    """curl --http2 on http:// asks to upgrade to h2c; we answer in HTTP/1.1
    (allowed) and must not lose the body llhttp leaves to the 'new protocol'."""
    proto, t, rec, _, _ = make_conn()
    await feed(proto, UPGRADE_POST, list(range(len(UPGRADE_POST))) if mode == "bytewise" else [])
    await settle(lambda: t.closed)
    ((status, headers, body),) = parse_responses(t.take(), [b"POST"])
    doc = orjson.loads(body)
    assert status == 200 and headers[b"connection"] == b"close"
    assert doc["body_len"] == 5 and doc["body_sum"] == sum(b"hello")


async def test_upgrade_with_chunked_body_refused() -> None:
    proto, t, rec, _, _ = make_conn()
    proto.data_received(
        b"POST /echo HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    )
    await settle()
    ((status, _, body),) = parse_responses(t.take())
    assert status == 400 and "Upgrade" in error_of(body)["message"]
    assert not rec.seen
