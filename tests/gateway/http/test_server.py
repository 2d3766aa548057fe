"""Listener lifecycle: draining, wait_idle, in_flight, close, the event hook; the Unix socket
listener; TLS files."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import ssl
from pathlib import Path

import httpx
import pytest
from cryptography import x509

from gateway.http.listeners import ListenerSpec, start_listener
from gateway.http.server import HttpLimits, start_server
from gateway.http.tls import SELF_SIGNED_CERT, SELF_SIGNED_KEY, load_or_create_tls

from .conftest import FAST_LIMITS, Recorder, error_of, make_entrance

pytestmark = pytest.mark.timeout(60)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl binary not installed")
async def test_drain_finishes_in_flight_then_refuses() -> None:
    """h1 and h2 requests in flight finish after stop_accepting (h2 via GOAWAY;
    curl, since httpcore treats any GOAWAY as fatal to open streams)."""
    rec = Recorder()
    srv = await start_server(make_entrance(rec), host="127.0.0.1", port=0)
    url = f"http://127.0.0.1:{srv.port}"
    async with httpx.AsyncClient(base_url=url) as c1:
        idle = await c1.get("/echo")  # leaves an idle keep-alive connection
        assert idle.status_code == 200

        async def held_h1() -> bytes:
            async with c1.stream("GET", "/hold") as s:
                return await s.aread()

        async def held_h2() -> bytes:
            p = await asyncio.create_subprocess_exec(
                "curl",
                "-sS",
                "--http2-prior-knowledge",
                "--max-time",
                "10",
                url + "/hold",
                stdout=asyncio.subprocess.PIPE,
            )
            out, _ = await p.communicate()
            assert p.returncode == 0
            return out

        tasks = [asyncio.create_task(held_h1()), asyncio.create_task(held_h2())]
        while len(rec.seen) < 3 or srv.in_flight < 2:
            await asyncio.sleep(0.01)
        srv.stop_accepting()
        assert not await srv.wait_idle(0.1)  # still busy
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient() as c3:
                await c3.get(url + "/echo")
        rec.release.set()
        assert await srv.wait_idle(5)
        assert [await t for t in tasks] == [b"first\nsecond\n"] * 2
        assert srv.in_flight == 0
    await srv.close()


async def test_close_cancels_handlers() -> None:
    rec = Recorder()
    srv = await start_server(make_entrance(rec), host="127.0.0.1", port=0)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{srv.port}") as c:
        task = asyncio.create_task(c.get("/hold"))
        await rec.started.wait()
        await srv.close()
        with pytest.raises(httpx.HTTPError):
            await task
    assert rec.cancelled == ["/hold"] and srv.in_flight == 0


async def test_event_hook_failure_does_not_break_serving() -> None:
    def hook(ev: object) -> None:
        raise RuntimeError("metrics down")

    srv = await start_server(
        make_entrance(Recorder()),
        host="127.0.0.1",
        port=0,
        on_event=hook,
        limits=HttpLimits(max_header_bytes=1024),
    )
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{srv.port}") as c:
        assert (await c.get("/echo", headers={"x": "y" * 2000})).status_code == 431
        assert (await c.get("/echo")).status_code == 200
    await srv.close()


def test_limits_validated() -> None:
    with pytest.raises(ValueError, match="max_body_bytes"):
        HttpLimits(max_body_bytes=0)
    with pytest.raises(ValueError, match="header_timeout"):
        HttpLimits(header_timeout=0)


def test_self_signed_created_once_and_reused(tmp_path: Path) -> None:
    ctx, fp = load_or_create_tls(None, None, tmp_path / "state")
    cert = tmp_path / "state" / SELF_SIGNED_CERT
    key = tmp_path / "state" / SELF_SIGNED_KEY
    assert (key.stat().st_mode & 0o777) == 0o600
    der = x509.load_pem_x509_certificate(cert.read_bytes()).public_bytes(
        __import__("cryptography.hazmat.primitives.serialization", fromlist=["Encoding"]).Encoding.DER
    )
    assert fp == hashlib.sha256(der).hexdigest() and len(fp) == 64
    san = (
        x509.load_pem_x509_certificate(cert.read_bytes())
        .extensions.get_extension_for_class(x509.SubjectAlternativeName)
        .value
    )
    assert "localhost" in san.get_values_for_type(x509.DNSName)
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "::1"}
    mtime = cert.stat().st_mtime_ns
    _, fp2 = load_or_create_tls(None, None, tmp_path / "state")
    assert fp2 == fp and cert.stat().st_mtime_ns == mtime  # reused, not regenerated
    assert isinstance(ctx, ssl.SSLContext)


def test_configured_files(tmp_path: Path) -> None:
    _, fp = load_or_create_tls(None, None, tmp_path)
    _, fp2 = load_or_create_tls(
        str(tmp_path / SELF_SIGNED_CERT), str(tmp_path / SELF_SIGNED_KEY), tmp_path / "x"
    )
    assert fp2 == fp and not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="both"):
        load_or_create_tls(str(tmp_path / SELF_SIGNED_CERT), None, tmp_path)
    with pytest.raises(FileNotFoundError):
        load_or_create_tls(str(tmp_path / "nope.pem"), str(tmp_path / SELF_SIGNED_KEY), tmp_path)


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2c"])
async def test_unix_socket_listener(tmp_path: Path, http2: bool) -> None:
    """httpx over a Unix domain socket: HTTP/1.1 and h2c prior knowledge, whole and streamed
    responses, errors; draining refuses new connections; close removes the socket file."""
    rec = Recorder()
    path = str(tmp_path / "gw.sock")
    listener = await start_listener(make_entrance(rec), ListenerSpec("unix", path=path), limits=FAST_LIMITS)
    assert listener.address == path and listener.url == f"unix:{path}" and listener.port == 0
    transport = httpx.AsyncHTTPTransport(uds=path, http1=not http2, http2=http2)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        r = await c.post("/echo?q=1", content=b"hello")
        assert r.status_code == 200 and r.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
        doc = r.json()
        assert (doc["body_len"], doc["query"], doc["host"], doc["scheme"]) == (5, "q=1", "gw", "http")
        assert rec.seen[0].client is None  # no peer address on a Unix socket
        async with c.stream("GET", "/stream?n=3") as s:
            assert [line async for line in s.aiter_lines()] == ["line 0", "line 1", "line 2"]
        r = await c.get("/apierror")
        assert r.status_code == 404 and error_of(r.content)["code"] == "model_not_found"
    listener.stop_accepting()
    assert await listener.wait_idle(1.0) and listener.in_flight == 0
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=path)) as c:
            await c.get("http://gw/echo")
    await listener.close()
    assert not Path(path).exists()


def test_listener_spec_validated() -> None:
    with pytest.raises(ValueError, match="ssl"):
        ListenerSpec("tls")
    with pytest.raises(ValueError, match="ssl"):
        ListenerSpec("tcp", ssl=ssl.create_default_context())
    with pytest.raises(ValueError, match="path"):
        ListenerSpec("unix")
    with pytest.raises(ValueError, match="path"):
        ListenerSpec("tcp", path="/tmp/x.sock")
