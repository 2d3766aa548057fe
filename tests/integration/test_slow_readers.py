"""Clients that stop reading do not take the engine from the others (#20): 100 streams whose clients
never read (50 over HTTP/1.1 with a tiny receive buffer, 50 over HTTP/2 with a tiny flow-control
window) against a real gateway and synthetic worker (32 batch slots). Their worker requests are
paused off the batch once their transport credit is spent, so a normal client's latency stays near
its baseline; past the gateway's write timeout each stalled stream is cut and its worker request
cancelled (counted as 408)."""

from __future__ import annotations

import asyncio
import socket
import statistics
import time
from pathlib import Path

import h2.config
import h2.connection
import h2.settings
import httpx
import orjson
import pytest

from .test_gateway_e2e import CHAT, Gateway, start_gateway, stop_gateway

pytestmark = pytest.mark.timeout(120)
BODY = orjson.dumps({**CHAT, "max_tokens": 4000, "stream": True})


def _h1_stalled(host: str, port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # before connect: a small window
    s.connect((host, port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\n\r\n%s" % (len(BODY), BODY))
    return s  # never read


def _h2_stalled(host: str, port: int, streams: int) -> socket.socket:
    s = socket.create_connection((host, port))
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.local_settings = h2.settings.Settings(client=True, initial_values={
        h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1024})
    conn.initiate_connection()
    for _ in range(streams):
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, [(":method", "POST"), (":path", "/v1/chat/completions"), (":scheme", "http"),
                                (":authority", "x"), ("content-type", "application/json")])
        conn.send_data(sid, BODY, end_stream=True)
    s.sendall(conn.data_to_send())
    return s  # never read, never a WINDOW_UPDATE


async def _latencies(base: str, n: int) -> list[float]:
    out = []
    async with httpx.AsyncClient(base_url=base, timeout=30) as c:
        for _ in range(n):
            t0 = time.monotonic()
            r = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 16})
            assert r.status_code == 200
            out.append(time.monotonic() - t0)
    return out


async def test_a_normal_client_keeps_its_latency_while_100_streams_stall(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUICSERVE_API__WRITE_TIMEOUT", "20")
    monkeypatch.setenv("QUICSERVE_LIMITS__SEND_BUFFER_BYTES", "16384")  # backpressure within ~150 tokens
    g: Gateway = start_gateway(tmp_path, "--no-tls", "--worker-option=synthetic_step_ms=5")
    host, port = g.http.removeprefix("http://").rsplit(":", 1)
    socks: list[socket.socket] = []
    try:
        await _latencies(g.http, 5)  # warm
        baseline = await _latencies(g.http, 20)
        t_stall = time.monotonic()
        socks += [_h1_stalled(host, int(port)) for _ in range(50)]
        socks += [_h2_stalled(host, int(port), 10) for _ in range(5)]
        deadline = time.monotonic() + 30  # until every stalled request has spent its credit and is paused
        while time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            if g.metric("quicserve_worker_in_flight") >= 100 and g.metric("quicserve_worker_running") == 0:
                break
        assert g.metric("quicserve_worker_in_flight") >= 100, "the stalled streams are open on the worker"
        assert g.metric("quicserve_worker_running") == 0, "stalled requests still hold batch slots"
        stalled = await _latencies(g.http, 20)
        assert time.monotonic() - t_stall < 20  # measured while all 100 still exist
        p99_base, p99_stalled = max(baseline), max(stalled)
        assert p99_stalled <= 2 * p99_base, (statistics.median(baseline), p99_base, p99_stalled)
        deadline = time.monotonic() + 30  # past the write timeout: cut, and their worker requests cancelled
        while time.monotonic() < deadline and g.metric("quicserve_worker_in_flight"):
            await asyncio.sleep(0.2)
        assert g.metric("quicserve_worker_in_flight") == 0
        text = httpx.get(g.http + "/metrics").text
        cut = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("quicserve_requests_total{") and 'status="408"' in line)
        assert cut == 100
    finally:
        for s in socks:
            s.close()
        assert stop_gateway(g) == 0
