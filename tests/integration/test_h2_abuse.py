"""HTTP/2 abuse against a real gateway process (#20): a rapid-reset client is disconnected within a
bounded number of resets while a normal client on another connection is served; a CONTINUATION
flood is cut before its header block exceeds the limit in memory (the gateway's RSS asserted)."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import h2.config
import h2.connection
import h2.exceptions
import httpx
import pytest
from hyperframe.frame import ContinuationFrame, HeadersFrame

from .test_gateway_e2e import CHAT, start_gateway, stop_gateway

pytestmark = pytest.mark.timeout(120)
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _closed(sock: socket.socket, timeout: float) -> bool:
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return False


async def test_rapid_reset_is_cut_off_and_others_are_served(tmp_path: Path) -> None:
    g = start_gateway(tmp_path, "--no-tls", "--worker-option=synthetic_step_ms=5")
    host, port = g.http.removeprefix("http://").rsplit(":", 1)
    try:
        sock = socket.create_connection((host, int(port)))
        c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        c.initiate_connection()
        sent = 0
        cut = False
        body = b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":50}'
        for _ in range(200):  # bursts of 100 HEADERS + DATA + RST_STREAM triples
            if c.state_machine.state == h2.connection.ConnectionState.CLOSED:  # the server's GOAWAY arrived
                cut = True
                break
            for _ in range(100):
                sid = c.get_next_available_stream_id()
                c.send_headers(sid, [(":method", "POST"), (":path", "/v1/chat/completions"), (":scheme", "http"),
                                     (":authority", "x"), ("content-type", "application/json")])
                c.send_data(sid, body, end_stream=True)
                c.reset_stream(sid)
                sent += 1
            try:
                sock.sendall(c.data_to_send())
                sock.setblocking(False)  # take the server's WINDOW_UPDATEs (our DATA spends the window)
                try:
                    while chunk := sock.recv(1 << 20):
                        c.receive_data(chunk)
                except BlockingIOError:
                    pass
                finally:
                    sock.setblocking(True)
            except (BrokenPipeError, ConnectionResetError):
                cut = True
                break
            except h2.exceptions.ProtocolError:  # the server's GOAWAY reached our state machine
                cut = True
                break
            async with httpx.AsyncClient(base_url=g.http, http2=True, http1=False, timeout=10) as normal:
                r = await normal.post("/v1/chat/completions", json=CHAT)  # another connection: served
                assert r.status_code == 200
        cut = cut or _closed(sock, 5)
        assert cut, "the rapid-reset connection is still open"
        assert sent <= 1000, f"{sent} resets before the cut"
        sock.close()
        async with httpx.AsyncClient(base_url=g.http, http2=True, http1=False, timeout=10) as normal:
            assert (await normal.post("/v1/chat/completions", json=CHAT)).status_code == 200
    finally:
        assert stop_gateway(g) == 0


async def test_a_continuation_flood_is_cut_before_the_header_limit(tmp_path: Path) -> None:
    g = start_gateway(tmp_path, "--no-tls")
    host, port = g.http.removeprefix("http://").rsplit(":", 1)
    try:
        before = _rss_kb(g.proc.pid)
        sock = socket.create_connection((host, int(port)))
        sock.sendall(PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")  # preface + empty SETTINGS
        sock.sendall(HeadersFrame(1, data=b"\x00" * 1000).serialize())  # no END_HEADERS
        junk = ContinuationFrame(1, data=b"\x40\x03abc\x03xyz" * 100).serialize()  # ~1 KB of junk headers
        sent = 0
        try:
            for _ in range(4000):  # 4 MB offered
                sock.sendall(junk)
                sent += len(junk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert _closed(sock, 5), "the flooding connection is still open"
        sock.close()
        grew = _rss_kb(g.proc.pid) - before
        assert grew < 2048, f"RSS grew {grew} KB"  # the block never accumulated (4 MB offered)
        r = httpx.post(g.http + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 200
    finally:
        assert stop_gateway(g) == 0
    await asyncio.sleep(0)
