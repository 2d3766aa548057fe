"""Shared pieces for the HTTP adapter tests: a recording test handler, a fake
transport (test double) for byte-level tests, and live servers on port 0."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.errors import APIError
from gateway.http.common import task_entrance
from gateway.http.server import HttpLimits, HttpServer, ProtocolEvent, start_server
from gateway.http.tls import SELF_SIGNED_CERT, load_or_create_tls
from gateway.http.types import Entrance, Handler, Request, ResponseSink

FAST_LIMITS = HttpLimits(
    max_body_bytes=4096,
    max_header_bytes=2048,
    header_timeout=1.0,
    body_timeout=1.0,
    keepalive_timeout=5.0,
    linger_timeout=0.5,
    max_pipelined=4,
)


@dataclass
class Recorder:
    """What the test handler saw: requests started, finished, cancelled."""

    seen: list[Request] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    sent: int = 0


def make_entrance(rec: Recorder) -> Entrance:
    """:func:`make_handler` as the adapters see it (through :func:`task_entrance`)."""
    return task_entrance(make_handler(rec))


def make_handler(rec: Recorder) -> Handler:
    """A small app: /echo, /stream?n=K, /big?n=BYTES, /hold, /flood, /apierror, /boom, /silent."""

    async def handler(req: Request, sink: ResponseSink) -> None:
        rec.seen.append(req)
        q = dict(p.split("=", 1) for p in req.query.split("&") if "=" in p)
        try:
            if req.path.startswith("/echo"):
                body = orjson.dumps(
                    {
                        "method": req.method,
                        "path": req.path,
                        "query": req.query,
                        "protocol": req.protocol,
                        "scheme": req.scheme,
                        "body_len": len(req.body),
                        "body_sum": sum(req.body) % 65521,
                        "host": (req.header(b"host") or b"").decode(),
                    }
                )
                sink.respond(200, [(b"content-type", b"application/json")], body)
            elif req.path == "/stream":
                sink.start(200, [(b"content-type", b"text/plain")])
                for i in range(int(q.get("n", "3"))):
                    await sink.send(b"line %d\n" % i)
                    if "delay" in q:
                        await asyncio.sleep(float(q["delay"]))
                sink.end()
            elif req.path == "/big":
                n = int(q.get("n", "100000"))
                sink.respond(200, [], bytes(i % 251 for i in range(n)))
            elif req.path == "/hold":
                rec.started.set()
                sink.start(200, [(b"content-type", b"text/plain")])
                await sink.send(b"first\n")
                await rec.release.wait()
                await sink.send(b"second\n")
                sink.end()
            elif req.path == "/flood":  # 64 KiB chunks until cancelled; counts what send() accepted
                sink.start(200, [])
                chunk = b"f" * 65536
                while True:
                    await sink.send(chunk)
                    rec.sent += 1
            elif req.path == "/apierror":
                raise APIError(404, "no such thing", "invalid_request_error", "model", "model_not_found")
            elif req.path == "/boom":
                raise RuntimeError("handler bug")
            elif req.path == "/silent":
                return
            else:
                raise APIError(404, f"unknown route {req.path}")
        except asyncio.CancelledError:
            rec.cancelled.append(req.path)
            raise
        rec.finished.append(req.path)

    return handler


class FakeTransport:
    """Test double for an asyncio transport: records writes and close."""

    def __init__(self, extra: dict[str, Any] | None = None) -> None:
        self.out = bytearray()
        self.closed = False
        self.eof = False
        self.paused = False
        self.protocol: Any = None
        self._extra = extra or {"peername": ("127.0.0.1", 5555)}

    def write(self, data: bytes) -> None:
        assert not self.closed, "write after close"
        self.out += data

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.protocol is not None:
                asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def abort(self) -> None:
        self.close()

    def is_closing(self) -> bool:
        return self.closed

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._extra.get(name, default)

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def set_protocol(self, protocol: Any) -> None:
        self.protocol = protocol

    def take(self) -> bytes:
        data = bytes(self.out)
        self.out.clear()
        return data


async def settle(cond: Any = None, timeout: float = 2.0) -> None:
    """Run the loop until ``cond()`` holds (or a few iterations when None)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    if cond is None:
        for _ in range(10):
            await asyncio.sleep(0)
        return
    while not cond():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.001)


def error_of(body: bytes) -> dict[str, Any]:
    """The OpenAI-shaped error object of a response body (asserts the shape)."""
    doc = orjson.loads(body)
    assert set(doc) == {"error"}
    err: dict[str, Any] = doc["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


@dataclass
class Live:
    server: HttpServer
    tls_server: HttpServer
    rec: Recorder
    events: list[ProtocolEvent]
    cafile: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    @property
    def tls_url(self) -> str:
        return f"https://localhost:{self.tls_server.port}"

    def client_ssl(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.cafile))


@pytest.fixture
async def live(tmp_path: Path) -> AsyncIterator[Live]:
    rec = Recorder()
    events: list[ProtocolEvent] = []
    handler = make_entrance(rec)
    ctx, _fp = load_or_create_tls(None, None, tmp_path)
    srv = await start_server(handler, host="127.0.0.1", port=0, limits=FAST_LIMITS, on_event=events.append)
    tls = await start_server(
        handler, host="127.0.0.1", port=0, ssl_context=ctx, limits=FAST_LIMITS, on_event=events.append
    )
    try:
        yield Live(srv, tls, rec, events, tmp_path / SELF_SIGNED_CERT)
    finally:
        await srv.close()
        await tls.close()


@pytest.fixture(scope="session")
def event_loop_policy() -> Any:
    """The gateway runs under uvloop; so do these tests."""
    import uvloop

    return uvloop.EventLoopPolicy()


@pytest.fixture(scope="session")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A self-signed certificate and key for the QUIC/TLS listeners (one for the whole run)."""
    from .h3_client import make_cert

    return make_cert(Path(tmp_path_factory.mktemp("h3cert")))
