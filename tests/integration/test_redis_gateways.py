"""Redis-shared rate limits through the real thing (issue #26): a real ``redis-server``, one and two
real ``quicserve serve`` processes (synthetic engine) on their default settings and clocks, real
HTTP clients. Nothing is injected: each gateway runs the shipped request clock and Redis its own
``TIME``. The skew test shifts two gateways' clocks 4 s apart with the ``QUICSERVE_TEST_CLOCK_OFFSET``
hook (gateway/clock.py), as two hosts with wrong clocks would be.

The bug these guard against: the lease loop ran on ``time.time`` while requests reached the limiters
with ``perf_counter`` readings; every request after the first got a 429 with ``Retry-After`` ~1.8e9.
Every earlier test injected one clock into both sides, or ran in one process.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.gateway.admission.accuracy import bucket_excess, exact_bucket
from tests.gateway.admission.redis_server import RedisProcess
from tests.integration.test_gateway_e2e import Gateway, stop_gateway, wait_ready

REPO = Path(__file__).resolve().parents[2]
KEYS = {kid: f"sk-{kid}-0123456789abcdef" for kid in ("t1", "t2", "t3", "t4", "t5", "t6")}
LIMITS = [
    "key=t1 requests 300/60s",  # the issue's reproduction
    "key=t2 requests 300/60s",  # two gateways, sliding window
    "key=t3 requests 300/60s bucket",  # two gateways, token bucket (burst 300, 5/s)
    "key=t4 requests 10/2s",  # window roll-over
    "key=t5 requests 100000/60s",  # far below its limit: Redis outages
    "key=t6 requests 30/60s",  # limited again after Redis restarted empty
]
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def _config(path: Path, redis_url: str, fail: str = "open") -> Path:
    keys = ", ".join(f'"{kid}:{hashlib.sha256(k.encode()).hexdigest()}"' for kid, k in KEYS.items())
    limits = ", ".join(f'"{rule}"' for rule in LIMITS)
    path.write_text(f'[admission]\nkeys = [{keys}]\nlimits = [{limits}]\nredis_url = "{redis_url}"\n'
                    f'redis_fail = "{fail}"\n')
    return path


def _serve(tmp: Path, config: Path, offset: float = 0.0) -> Gateway:
    """``quicserve serve`` with this config, cleartext HTTP only, its clocks shifted by ``offset``."""
    state = tmp / f"state-{os.urandom(3).hex()}"
    state.mkdir()
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--engine", "synthetic", "--config", str(config),
           "--port", "0", "--no-tls", "--grpc-port", "-1", "--quic-port", "-1", "--state-dir", str(state),
           "--progress", "lines", "--log-level", "warning"]
    env = {**os.environ, "QUICSERVE_SHUTDOWN__GRACE_PERIOD": "0"}
    env.pop("QUICSERVE_TEST_CLOCK_OFFSET", None)
    if offset:
        env["QUICSERVE_TEST_CLOCK_OFFSET"] = repr(offset)
    return wait_ready(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, env=env))


@dataclass
class Answer:
    status: int
    sent: float  # wall time, this process
    done: float
    retry_after: str | None
    reset: str | None
    code: str | None


async def _load(urls: list[str], kid: str, n: int, concurrency: int = 16) -> list[Answer]:
    """``n`` chat completions with key ``kid``, spread round-robin over ``urls``, ``concurrency`` at once."""
    clients = [httpx.AsyncClient(base_url=u, timeout=30.0, limits=httpx.Limits(max_connections=concurrency))
               for u in urls]
    headers = {"authorization": f"Bearer {KEYS[kid]}"}
    out: list[Answer] = []
    todo = iter(range(n))

    async def one_by_one() -> None:
        for i in todo:
            sent = time.time()
            r = await clients[i % len(clients)].post("/v1/chat/completions", json=CHAT, headers=headers)
            code = r.json().get("error", {}).get("code") if r.status_code != 200 else None
            out.append(Answer(r.status_code, sent, time.time(), r.headers.get("retry-after"),
                              r.headers.get("x-ratelimit-reset-requests"), code))

    try:
        await asyncio.gather(*(one_by_one() for _ in range(concurrency)))
    finally:
        for c in clients:
            await c.aclose()
    return out


def _seconds(reset: str) -> float:
    """OpenAI's ``x-ratelimit-reset-*`` form (``20ms``, ``1.5s``, ``1m0s``) in seconds."""
    if reset.endswith("ms"):
        return float(reset[:-2]) / 1000
    total = 0.0
    for value, unit in re.findall(r"([\d.]+)([hms])", reset):
        total += float(value) * {"h": 3600, "m": 60, "s": 1}[unit]
    return total


def _check_refusals(answers: list[Answer], window: float) -> None:
    """Every answer a 200 or a 429 whose Retry-After and reset are within the window."""
    assert {a.status for a in answers} <= {200, 429}, sorted({a.status for a in answers})
    for a in answers:
        assert a.reset is not None and _seconds(a.reset) <= window, a
        if a.status == 429:
            assert a.code == "rate_limit_exceeded", a
            assert a.retry_after is not None and 1 <= int(a.retry_after) <= math.ceil(window), a


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module", params=[(0.0, 0.0), (2.0, -2.0)], ids=["same-clock", "skewed-4s"])
def pair(request: pytest.FixtureRequest, redis: RedisProcess, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[list[Gateway]]:
    """Two gateways on one Redis (each pair its own database), clocks shifted by the params."""
    tmp = tmp_path_factory.mktemp("pair")
    db = 1 + request.param_index
    config = _config(tmp / "config.toml", redis.url.rsplit("/", 1)[0] + f"/{db}")
    gws = [_serve(tmp, config, offset) for offset in request.param]
    yield gws
    for g in gws:
        assert stop_gateway(g) == 0


def test_the_reproduction_one_gateway(pair: list[Gateway]) -> None:
    """The issue's report, on one gateway: 200s until the limit, then 429s with Retry-After <= 60."""
    answers = asyncio.run(_load([pair[0].http], "t1", 310, concurrency=1))
    statuses = [a.status for a in answers]
    assert statuses == [200] * 300 + [429] * 10, statuses
    _check_refusals(answers, 60.0)


def test_two_gateways_share_a_window(pair: list[Gateway]) -> None:
    t0 = time.monotonic()
    answers = asyncio.run(_load([g.http for g in pair], "t2", 1500))
    took = time.monotonic() - t0
    admitted = sum(a.status == 200 for a in answers)
    print(f"window, two gateways: {admitted} of 1500 admitted against 300/60s in {took:.2f}s")
    assert took < 10.0
    assert 0.95 * 300 <= admitted <= 1.005 * 300
    _check_refusals(answers, 60.0)


def test_two_gateways_share_a_bucket(pair: list[Gateway]) -> None:
    """Burst 300 refilled at 5/s: what one perfect bucket would admit of the same requests (their
    send times), within [0.95, 1.005]; never more than burst + rate x T in any interval."""
    t0 = time.monotonic()
    answers = asyncio.run(_load([g.http for g in pair], "t3", 1500))
    took = time.monotonic() - t0
    admitted = [a.sent for a in answers if a.status == 200]
    # the reference bucket sees each request at its send time; the gateway saw it later, by at most
    # the request's own time in flight, so the reference gets that much refill in hand
    slack = max(a.done - a.sent for a in answers) * 5.0
    best = len(exact_bucket([a.sent for a in answers], 5.0, 300.0))
    print(f"bucket, two gateways: {len(admitted)} of 1500 admitted, a perfect bucket {best}, in {took:.2f}s")
    assert took < 10.0
    assert 0.95 * best <= len(admitted) <= 1.005 * best + slack
    assert bucket_excess([a.done for a in answers if a.status == 200], 5.0) <= 300 * 1.005 + slack
    _check_refusals(answers, 60.0)


def test_window_rolls_over(pair: list[Gateway]) -> None:
    """10 per 2 s: refused past 10, admitted again once the window has passed (Retry-After says when)."""
    first = asyncio.run(_load([pair[0].http], "t4", 15, concurrency=1))
    assert [a.status for a in first] == [200] * 10 + [429] * 5
    _check_refusals(first, 2.0)
    wait = max(int(a.retry_after or 0) for a in first)
    assert 1 <= wait <= 2
    time.sleep(wait + 0.3)
    again = asyncio.run(_load([pair[1].http], "t4", 10, concurrency=1))
    assert [a.status for a in again] == [200] * 10


def _metric(gw: Gateway, name: str) -> float:
    return gw.metric(name)


@pytest.mark.parametrize("fail", ["open", "closed"])
def test_redis_stopped_mid_load_and_restarted_empty(fail: str, tmp_path: Path) -> None:
    """Redis killed under load: fail-open admits and counts it on /metrics, fail-closed answers 503;
    both recover when Redis comes back empty on its port, and limits hold again from zero."""
    redis = RedisProcess(tmp_path).start()
    gw = _serve(tmp_path, _config(tmp_path / "config.toml", redis.url, fail))
    try:
        assert {a.status for a in asyncio.run(_load([gw.http], "t5", 50, 4))} == {200}
        redis.stop()
        down = asyncio.run(_load([gw.http], "t5", 300, 4))  # leases run out, renewals fail
        statuses = {a.status for a in down}
        errors = _metric(gw, "quicserve_admission_redis_errors_total")
        assert errors >= 1
        if fail == "open":
            assert statuses == {200}
            assert _metric(gw, "quicserve_admission_redis_fail_open_admits_total") > 0
        else:
            assert statuses <= {200, 503} and 503 in statuses
            refused = [a for a in down if a.status == 503]
            assert all(a.retry_after is not None and int(a.retry_after) >= 1 for a in refused)
        redis.start()  # the same port, empty: no scripts, no counts
        deadline = time.monotonic() + 10.0
        while True:  # back within the backoff (1 s) and a renewal
            if asyncio.run(_load([gw.http], "t5", 1, 1))[0].status == 200 and \
                    _metric(gw, "quicserve_admission_redis_script_reloads_total") >= 1:
                break
            assert time.monotonic() < deadline, "did not recover after Redis came back"
            time.sleep(0.2)
        t6 = asyncio.run(_load([gw.http], "t6", 40, 1))
        assert [a.status for a in t6] == [200] * 30 + [429] * 10  # limits hold again, from an empty store
        _check_refusals(t6, 60.0)
    finally:
        assert stop_gateway(gw) == 0
        redis.stop()


@pytest.mark.parametrize("secured", ["password", "password+tls"])
def test_limits_through_a_redis_with_a_password_and_tls(secured: str, tmp_path: Path) -> None:
    """Issue #36: the shared limits through a redis-server with requirepass, and with TLS too
    (rediss:// with the server's CA), as the Kubernetes base runs it: limits as accurate as ever;
    a wrong password is an unreachable store (fail open, counted)."""
    from tests.transport.certs import TestCA

    tls = None
    if secured.endswith("tls"):
        ca = TestCA(tmp_path / "ca", "redis test CA")
        leaf = ca.issue("localhost", "worker")  # serverAuth, for the name the client dials
        tls = (leaf.cert, leaf.key, leaf.ca)
    redis = RedisProcess(tmp_path, password="s3cret-redis", tls=tls).start()
    try:
        gw = _serve(tmp_path, _config(tmp_path / "config.toml", redis.url))
        try:
            answers = asyncio.run(_load([gw.http], "t6", 40, concurrency=1))
            assert [a.status for a in answers] == [200] * 30 + [429] * 10
            assert _metric(gw, "quicserve_admission_redis_errors_total") == 0
        finally:
            assert stop_gateway(gw) == 0
        wrong = redis.url.replace("s3cret-redis", "wrong")
        gw = _serve(tmp_path, _config(tmp_path / "wrong.toml", wrong))
        try:
            answers = asyncio.run(_load([gw.http], "t5", 10, concurrency=1))
            assert {a.status for a in answers} == {200}  # fail open ...
            assert _metric(gw, "quicserve_admission_redis_errors_total") >= 1  # ... and counted
        finally:
            assert stop_gateway(gw) == 0
    finally:
        redis.stop()
