"""Real servers on 127.0.0.1 port 0, real clients: httpx (HTTP/1.1, h2 over TLS,
h2c prior knowledge), the curl binary, and raw sockets for bad input."""

from __future__ import annotations

import asyncio
import shutil
from typing import Any

import httpx
import orjson
import pytest

from gateway.http.server import start_server

from .conftest import FAST_LIMITS, Live, Recorder, error_of, make_entrance
from .test_h1_bytes import parse_responses

pytestmark = pytest.mark.timeout(60)


def clients(live: Live) -> dict[str, httpx.AsyncClient]:
    return {
        "h1": httpx.AsyncClient(base_url=live.url),
        "h2c": httpx.AsyncClient(base_url=live.url, http1=False, http2=True),
        "h2-tls": httpx.AsyncClient(base_url=live.tls_url, http2=True, verify=live.client_ssl()),
        "h1-tls": httpx.AsyncClient(base_url=live.tls_url, verify=live.client_ssl()),
    }


EXPECTED = {
    "h1": ("HTTP/1.1", "http"),
    "h2c": ("HTTP/2", "http"),
    "h2-tls": ("HTTP/2", "https"),
    "h1-tls": ("HTTP/1.1", "https"),
}


@pytest.mark.parametrize("kind", list(EXPECTED))
async def test_httpx_roundtrips(live: Live, kind: str) -> None:
    async with clients(live)[kind] as c:
        r = await c.post("/echo?q=1", content=b"hello world")
        version, scheme = EXPECTED[kind]
        assert r.status_code == 200 and r.http_version == version
        doc = r.json()
        assert doc["body_len"] == 11 and doc["query"] == "q=1" and doc["scheme"] == scheme
        assert doc["protocol"] == ("h2" if version == "HTTP/2" else "http/1.1")
        async with c.stream("GET", "/stream?n=5") as s:
            lines = [line async for line in s.aiter_lines()]
        assert lines == [f"line {i}" for i in range(5)]
        r = await c.get("/big?n=300000")  # larger than any default window / buffer
        assert r.content == bytes(i % 251 for i in range(300000))
        r = await c.get("/apierror")
        assert r.status_code == 404 and error_of(r.content)["code"] == "model_not_found"


async def test_many_concurrent_h2_streams() -> None:
    # default limits: with 200 streams from one slow client a stream can wait
    # longer than FAST_LIMITS' 1 s body timeout between HEADERS and DATA
    rec = Recorder()
    srv = await start_server(make_entrance(rec), host="127.0.0.1", port=0)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{srv.port}", http1=False, http2=True) as c:
            rs = await asyncio.gather(*(c.post(f"/echo/{i}", content=b"x" * i) for i in range(200)))
            assert srv.connections == 1
    finally:
        await srv.close()
    assert [r.json()["body_len"] for r in rs] == list(range(200))
    assert {r.json()["path"] for r in rs} == {f"/echo/{i}" for i in range(200)}


async def curl(*args: str) -> tuple[int, bytes, bytes]:
    p = await asyncio.create_subprocess_exec(
        "curl",
        "-sS",
        "--max-time",
        "10",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await p.communicate()
    return p.returncode or 0, out, err


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl binary not installed")
@pytest.mark.parametrize("mode", ["--http1.1", "--http2-prior-knowledge", "--http2"])
async def test_curl(live: Live, mode: str) -> None:
    base = live.tls_url if mode == "--http2" else live.url
    extra = ["--cacert", str(live.cafile)] if mode == "--http2" else []
    rc, out, err = await curl(mode, *extra, "-w", "\n%{http_version}", "-d", "abc", f"{base}/echo")
    assert rc == 0, err
    body, version = out.rsplit(b"\n", 1)
    assert version == (b"1.1" if mode == "--http1.1" else b"2")
    assert orjson.loads(body)["body_len"] == 3
    rc, out, err = await curl(mode, *extra, "-N", f"{base}/stream?n=4")
    assert rc == 0 and out == b"line 0\nline 1\nline 2\nline 3\n", err
    if mode == "--http2":  # on http:// curl asks to upgrade to h2c; we answer in HTTP/1.1
        rc, out, err = await curl(mode, "-d", "abcd", f"{live.url}/echo")
        assert rc == 0 and orjson.loads(out)["body_len"] == 4, err
    rc, out, err = await curl(
        mode, *extra, "-w", "%{http_code}", "-o", "/dev/null", "-H", "x-big: " + "a" * 3000, f"{base}/echo"
    )
    assert out == b"431", err


async def raw_exchange(live: Live, data: bytes, wait: float = 0.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", live.server.port)
    writer.write(data)
    if wait:
        await asyncio.sleep(wait)
    try:
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()


def split_response(raw: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = dict(line.lower().split(b": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


async def still_serves(live: Live) -> None:
    async with httpx.AsyncClient(base_url=live.url) as c:
        r = await c.get("/echo")
        assert r.status_code == 200
    async with httpx.AsyncClient(base_url=live.url, http1=False, http2=True) as c:
        r = await c.get("/echo")
        assert r.status_code == 200


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"NOT HTTP AT ALL\r\n\r\n", 400),
        (b"GET /caf\xc3 HTTP/1.1\r\nHost: x\r\n\r\n", 400),
        (b"GET /%c3%28 HTTP/1.1\r\nHost: x\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\nX: \xff\xfe\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"b" * 5000 + b"\r\n\r\n", 431),
        (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + b"z" * 100000, 413),
    ],
    ids=["malformed", "utf8-target", "utf8-pct-target", "utf8-header", "431", "413"],
)
async def test_bad_input_raw_socket(live: Live, raw: bytes, status: int) -> None:
    got, headers, body = split_response(await raw_exchange(live, raw))
    assert got == status and headers[b"content-type"] == b"application/json"
    error_of(body)
    assert [e.status for e in live.events] == [status]
    await still_serves(live)


@pytest.mark.parametrize(
    ("partial", "what"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n", "header"),  # headers never end
        (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\nonly part", "body"),
    ],
    ids=["slow-headers", "stalled-body"],
)
async def test_slow_client_408(live: Live, partial: bytes, what: str) -> None:
    got, _, body = split_response(await raw_exchange(live, partial))
    assert got == 408 and what in error_of(body)["message"]
    assert not live.rec.seen
    await still_serves(live)


@pytest.mark.parametrize("kind", ["h1", "h2c", "h2-tls"])
async def test_too_large_body_httpx(live: Live, kind: str) -> None:
    async with clients(live)[kind] as c:
        r = await c.post("/echo", content=b"q" * (FAST_LIMITS.max_body_bytes + 1))
        assert r.status_code == 413 and error_of(r.content)["type"] == "invalid_request_error"

        async def chunks() -> Any:  # no content-length: chunked (h1) / unsized DATA (h2)
            for _ in range(10):
                yield b"w" * 1000

        r = await c.post("/echo", content=chunks())
        assert r.status_code == 413
        r = await c.get("/echo", headers={"x-big": "h" * 3000})
        assert r.status_code == 431
    await still_serves(live)


async def test_pipelined_on_real_socket(live: Live) -> None:
    reqs = b"".join(b"GET /echo/%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(10))
    raw = await raw_exchange(live, reqs + b"GET /echo/last HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    paths = [orjson.loads(body)["path"] for _, _, body in parse_responses(raw)]
    assert paths == [f"/echo/{i}" for i in range(10)] + ["/echo/last"]


@pytest.mark.parametrize("kind", ["h1", "h2c", "h2-tls"])
async def test_client_disconnect_cancels_handler(live: Live, kind: str) -> None:
    async with clients(live)[kind] as c:
        async with c.stream("GET", "/hold") as s:
            it = s.aiter_raw()
            assert await it.__anext__() == b"first\n"
            assert live.server.in_flight + live.tls_server.in_flight == 1
    # the client goes away mid-stream (httpx keeps an h2 connection open after a
    # closed response without resetting the stream; RST_STREAM is covered in memory)
    for _ in range(200):
        if live.rec.cancelled:
            break
        await asyncio.sleep(0.01)
    assert live.rec.cancelled == ["/hold"]
    assert live.server.in_flight == live.tls_server.in_flight == 0


@pytest.mark.parametrize("kind", ["h1", "h2c"])
async def test_send_waits_for_a_slow_reader(live: Live, kind: str) -> None:
    """A client that stops reading stalls the handler's send() (socket buffer /
    flow-control window) instead of the server buffering without bound."""
    reader, writer = await asyncio.open_connection("127.0.0.1", live.server.port)
    if kind == "h1":
        writer.write(b"GET /flood HTTP/1.1\r\nHost: x\r\n\r\n")
    else:
        import h2.config
        import h2.connection

        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        conn.send_headers(
            1,
            [(":method", "GET"), (":path", "/flood"), (":scheme", "http"), (":authority", "x")],
            end_stream=True,
        )
        writer.write(conn.data_to_send())
    while not live.rec.seen:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.5)
    stalled_at = live.rec.sent
    await asyncio.sleep(0.3)
    assert live.rec.sent == stalled_at  # the handler is parked in send()
    assert stalled_at * 65536 < 64 << 20  # bounded by kernel buffers / the h2 window
    writer.close()
    for _ in range(300):
        if live.rec.cancelled:
            break
        await asyncio.sleep(0.01)
    assert live.rec.cancelled == ["/flood"]
