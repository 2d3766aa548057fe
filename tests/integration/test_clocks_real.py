"""Parts whose unit tests inject a clock, run once through a real ``quicserve serve`` on its shipped
clocks (issue #26's audit: the Redis limits passed every injected-clock test and failed in a real
gateway). gateway/clock.py names the clocks; this checks the places where two of them meet:

* the key file's mtime check (the request clock schedules it, file times decide it);
* a gRPC deadline (grpc-timeout, a duration, becomes a request-clock deadline in the service and a
  duration again for the pipeline's deadline sweeper);
* session tickets and 0-RTT (tickets are issued and claimed on the wall clock);
* the access log's and metrics' latencies (request clock) beside the transport's first-token time
  (perf_counter, converted through an age).

Each gateway runs with its clocks shifted by ``QUICSERVE_TEST_CLOCK_OFFSET`` (-3 s): a place that
mixed the shifted clocks with an unshifted one would be off by seconds.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import orjson
import pytest
from aioquic.tls import SessionTicket

from gateway.grpc.quicserve.v1 import quicserve_pb2 as pb
from tests.gateway.http.h3_client import h3_connect
from tests.integration.test_gateway_e2e import Gateway, stop_gateway, wait_ready

REPO = Path(__file__).resolve().parents[2]
KEY_A, KEY_B = "sk-clock-a-0123456789", "sk-clock-b-0123456789"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

pytestmark = pytest.mark.timeout(120)


def _entry(kid: str, key: str) -> str:
    return f'[[keys]]\nid = "{kid}"\nsha256 = "{hashlib.sha256(key.encode()).hexdigest()}"\n\n'


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, Path]]:
    tmp = tmp_path_factory.mktemp("clocks")
    keys = tmp / "keys.toml"
    keys.write_text(_entry("a", KEY_A))
    config = tmp / "config.toml"
    config.write_text(f'[admission]\nkeys_file = "{keys}"\nkeys_check_interval = 0.25\n\n'
                      '[log]\naccess_log = true\nformat = "json"\n')
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--engine", "synthetic", "--config", str(config),
           "--port", "0", "--tls-port", "0", "--quic-port", "0", "--grpc-port", "0", "--state-dir", str(tmp),
           "--worker-option=synthetic_step_ms=20", "--progress", "lines", "--log-level", "warning"]
    env = {**os.environ, "QUICSERVE_SHUTDOWN__GRACE_PERIOD": "0", "QUICSERVE_TEST_CLOCK_OFFSET": "-3"}
    with (tmp / "stderr.log").open("w") as err:
        g = wait_ready(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True, env=env))
    yield g, keys
    assert stop_gateway(g) == 0


def _listening(g: Gateway, pattern: str) -> str:
    for line in g.lines:
        if m := re.search(pattern, line):
            return m.group(1)
    raise AssertionError(f"no {pattern!r} in {g.lines}")


def _chat(g: Gateway, key: str) -> httpx.Response:
    return httpx.post(g.http + "/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {key}"},
                      timeout=10)


def test_key_file_change_picked_up_by_mtime(gw: tuple[Gateway, Path]) -> None:
    g, keys = gw
    assert _chat(g, KEY_A).status_code == 200
    assert _chat(g, KEY_B).status_code == 401
    keys.write_text(_entry("b", KEY_B))  # a rotation: b in, a out; no SIGHUP
    os.utime(keys, (time.time() + 5, time.time() + 5))  # a new mtime even on a coarse filesystem clock
    deadline = time.monotonic() + 10
    while _chat(g, KEY_B).status_code != 200:
        assert time.monotonic() < deadline, "the new key file was never read"
        time.sleep(0.1)
    assert _chat(g, KEY_A).status_code == 401


def test_grpc_deadline_ends_the_call_on_time(gw: tuple[Gateway, Path]) -> None:
    """grpc-timeout 0.5 s against a generation of 200 steps x 20 ms: DEADLINE_EXCEEDED after about
    0.5 s -- not at once (a deadline already in the past) and not after the whole generation."""
    g, keys = gw
    keys.write_text(_entry("a", KEY_A) + _entry("b", KEY_B))
    target = _listening(g, r"listening on grpc://(\S+)")
    with grpc.insecure_channel(target) as ch:
        gen = ch.unary_stream("/quicserve.v1.Inference/Generate", request_serializer=lambda m: m.SerializeToString(),
                              response_deserializer=pb.GenerateResponse.FromString)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            list(gen(pb.GenerateRequest(model="tiny", prompt="a b c", sampling=pb.Sampling(max_tokens=200)), timeout=0.5,
                     metadata=(("authorization", f"Bearer {KEY_B}"),)))
        took = time.monotonic() - t0
    assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
    assert 0.4 <= took <= 2.5, took


def test_0rtt_on_a_resumed_connection(gw: tuple[Gateway, Path]) -> None:
    """A ticket from one connection, then a request in 0-RTT on the next: tickets are issued and
    claimed on the wall clock (their lifetime and single use), accepted and answered."""
    g, _ = gw
    port = int(_listening(g, r"listening on https://[^:]+:(\d+) \(h3"))

    async def go() -> tuple[int, bool | None]:
        tickets: list[SessionTicket] = []
        async with h3_connect(port, tickets=tickets) as client:
            await client.request("GET", "/healthz")
            for _ in range(100):
                if tickets:
                    break
                await asyncio.sleep(0.01)
        assert tickets, "no session ticket"
        async with h3_connect(port, ticket=tickets[-1], wait_connected=False) as client:
            resp = client.start("GET", "/v1/models", b"", [(b"authorization", f"Bearer {KEY_A}".encode())])
            await asyncio.wait_for(resp.done.wait(), 10)
            return resp.status, client.early_data_accepted

    status, accepted = asyncio.run(go())
    assert (status, accepted) == (200, True)


def test_latencies_on_one_clock(gw: tuple[Gateway, Path]) -> None:
    """TTFT and durations in the access log and on /metrics are seconds-small: the transport's
    first-token time (its own clock) is brought onto the request clock, which here is 3 s off the
    plain one."""
    g, keys = gw
    for stream in (False, True):
        r = httpx.post(g.http + "/v1/chat/completions", json={**CHAT, "stream": stream},
                       headers={"authorization": f"Bearer {KEY_A}"}, timeout=10)
        assert r.status_code == 200
    log = keys.parent / "stderr.log"
    records = [orjson.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    chats = [r for r in records if r.get("logger") == "quicserve.access" and r.get("path") == "/v1/chat/completions"
             and r.get("status") == 200]
    assert len(chats) >= 2, records[-5:]
    for r in chats:
        assert 0 <= r["ttft_ms"] <= r["duration_ms"] < 2000, r
    text = httpx.get(g.http + "/metrics").text
    sums = {m.group(1): float(m.group(2)) for m in
            re.finditer(r"^(quicserve_\w+_seconds)_sum\{[^}]*\} (\S+)$", text, re.M)}
    counts = {m.group(1): float(m.group(2)) for m in
              re.finditer(r"^(quicserve_\w+_seconds)_count\{[^}]*\} (\S+)$", text, re.M)}
    assert sums, text[:2000]
    for name, total in sums.items():
        assert 0 <= total <= 2.0 * max(counts.get(name, 1.0), 1.0), (name, total)
