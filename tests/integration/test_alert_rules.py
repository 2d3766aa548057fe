"""config/prometheus/: the alerting and recording rules, checked by promtool, and the series they
read, exported by a real ``quicserve serve``.

* ``promtool check rules`` on every rule file; ``promtool test rules`` on the fixtures in
  config/prometheus/tests/, which fire each alert on synthetic series and check it stays quiet
  on healthy ones beside them; every alert has a fixture that fires it.
* One gateway (two synthetic models with a rollout between them, shared limits on a Redis that is
  not there, QUIC): the session-ticket and 0-RTT counters move on ``/metrics`` as an aioquic
  client resumes, replays a ticket and sends a request too early; and every series a rule reads
  is on its ``/metrics``, so no alert waits on a name the gateway does not export.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from aioquic.tls import SessionTicket

from tests.gateway.http.h3_client import H3Response, h3_connect
from tests.integration.serve_process import serve_config
from tests.integration.test_dashboard import exported
from tests.integration.test_gateway_e2e import Gateway, stop_gateway

REPO = Path(__file__).resolve().parents[2]
RULES_DIR = REPO / "config" / "prometheus"
RULE_FILES = sorted(RULES_DIR.glob("*.rules.yml"))
FIXTURES = sorted((RULES_DIR / "tests").glob("*.test.yml"))
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed: Debian's prometheus "
                                    "package has it (APT_PKGS; make sysdeps installs it)")

CHAT = {"model": "v1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

pytestmark = pytest.mark.timeout(180)


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=RULES_DIR, capture_output=True, text=True, timeout=120)


def _rules() -> list[dict[str, str]]:
    return [rule for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"]
            for rule in group["rules"]]


def test_rule_files_found() -> None:
    assert [p.name for p in RULE_FILES] == ["quicserve-alerts.rules.yml", "quicserve-recording.rules.yml"]
    assert FIXTURES, "no promtool fixtures"


@needs_promtool
@pytest.mark.parametrize("path", RULE_FILES, ids=lambda p: p.name)
def test_promtool_check_rules(path: Path) -> None:
    r = _promtool("check", "rules", path.name)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


@needs_promtool
@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.name)
def test_promtool_test_rules(path: Path) -> None:
    r = _promtool("test", "rules", str(path.relative_to(RULES_DIR)))
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_every_alert_fires_in_a_fixture() -> None:
    """Each alert has a fixture evaluation that expects it firing (and the fixtures name no alert
    that does not exist: promtool would pass a test of an unknown name that expects nothing)."""
    alerts = {r["alert"] for r in _rules() if "alert" in r}
    fired: set[str] = set()
    named: set[str] = set()
    for path in FIXTURES:
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test.get("alert_rule_test", []):
                named.add(case["alertname"])
                if case.get("exp_alerts"):
                    fired.add(case["alertname"])
    assert alerts - fired == set(), "alerts no fixture fires"
    assert named - alerts == set(), "fixtures of alerts that do not exist"
    assert len(alerts) >= 15


# -- a real gateway ------------------------------------------------------------------------------

def _closed_port() -> int:
    with socket.socket() as s:  # bound and closed: nothing listens there (Redis "down")
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    config = f"""
[workers]
engine = "synthetic"

[admission]
limits = ["client requests 100000/60s"]
redis_url = "redis://127.0.0.1:{_closed_port()}/0"
redis_fail = "open"

[[models]]
name = "v1"
[[models]]
name = "v2"

[[rollouts]]
name = "v2-release"
stable = "v1"
candidate = "v2"
steps = [50, 100]
min_requests = 1000
interval = 60
"""
    g = serve_config(tmp_path_factory.mktemp("alerts"), config, models=("v1", "v2"), log_level="error",
                     args=("--tls-port", "0", "--quic-port", "0", "--grpc-port", "-1"))
    yield g
    assert stop_gateway(g) == 0


def _samples(g: Gateway) -> dict[str, float]:
    text = httpx.get(g.http + "/metrics", timeout=10).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def _quic_port(g: Gateway) -> int:
    for line in g.lines:
        if m := re.search(r"listening on https://[^ ]+:(\d+) \(h3", line):
            return int(m.group(1))
    raise AssertionError(f"no h3 listener in {g.lines}")


async def _ticket(port: int, path: str = "/healthz") -> SessionTicket:
    tickets: list[SessionTicket] = []
    async with h3_connect(port, tickets=tickets) as client:
        assert (await client.request("GET", path)).status == 200
        for _ in range(200):
            if tickets:
                break
            await asyncio.sleep(0.01)
    assert tickets, "no session ticket"
    return tickets[-1]


async def _early(port: int, ticket: SessionTicket, method: str, path: str,
                 body: bytes = b"") -> tuple[H3Response, bool | None]:
    """``method path`` sent in 0-RTT on a connection resumed with ``ticket``."""
    headers = [(b"content-type", b"application/json")] if body else None
    async with h3_connect(port, ticket=ticket, wait_connected=False) as client:
        resp = client.start(method, path, body, headers)
        await asyncio.wait_for(resp.done.wait(), 10)
        return resp, client.early_data_accepted


def test_0rtt_and_ticket_counters_on_metrics(gw: Gateway) -> None:
    """A ticket resumes once with a 0-RTT request served; presented again (a replay) it is refused
    and the request goes in a full handshake; a route not listed as early-data safe (/metrics) sent
    in 0-RTT is answered 425. Each
    shows on /metrics as the counter it moves."""
    port = _quic_port(gw)
    before = _samples(gw)

    async def go() -> None:
        ticket = await _ticket(port)
        resp, accepted = await _early(port, ticket, "GET", "/v1/models")
        assert (resp.status, accepted) == (200, True)
        resp, accepted = await _early(port, ticket, "GET", "/v1/models")  # the same ticket again
        assert (resp.status, accepted) == (200, False)
        resp, accepted = await _early(port, await _ticket(port), "GET", "/metrics")
        assert (resp.status, accepted) == (425, True)

    asyncio.run(go())
    after = _samples(gw)

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert moved('quicserve_h3_early_data_requests_total{outcome="served"}') == 1
    assert moved('quicserve_h3_early_data_requests_total{outcome="too_early"}') == 1
    assert moved('quicserve_quic_session_tickets_presented_total{outcome="resumed"}') == 2
    assert moved('quicserve_quic_session_tickets_presented_total{outcome="refused"}') == 1
    assert moved("quicserve_quic_session_tickets_issued_total") >= 4  # one a handshake, full or resumed
    assert after["quicserve_quic_replay_store_keys"] >= 2  # both used tickets remembered
    assert after["quicserve_quic_replay_store_full_total"] == 0
    assert moved('quicserve_protocol_errors_total{protocol="h3",status="425"}') == 1


def test_workers_and_sweeps_on_metrics(gw: Gateway) -> None:
    """What QuicserveModelDown and QuicserveReplicasDown compare: each model's workers, configured
    and connected; and the cycle sweeper's counts beside them."""
    s = _samples(gw)
    assert s["quicserve_gc_sweeps_total"] >= 0 and s["quicserve_gc_sweep_collected_objects_total"] >= 0
    for model in ("v1", "v2"):
        assert s[f'quicserve_workers_configured{{model="{model}"}}'] == 1
        assert s[f'quicserve_workers_connected{{model="{model}"}}'] == 1
        assert s[f'quicserve_workers_failed{{model="{model}"}}'] == 0


def test_redis_fail_open_counted(gw: Gateway) -> None:
    """Redis is not there and redis_fail = "open": requests are admitted, and once a renewal has
    failed, counted as admitted uncounted (the series QuicserveRedisFailOpen and
    QuicserveRedisUnreachable read)."""
    before = _samples(gw)
    deadline = time.monotonic() + 20
    while True:
        assert httpx.post(gw.http + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 200
        after = _samples(gw)
        if after["quicserve_admission_redis_fail_open_admits_total"] > before.get(
                "quicserve_admission_redis_fail_open_admits_total", 0.0):
            break
        assert time.monotonic() < deadline, "no request counted as admitted fail-open"
        time.sleep(0.1)
    assert after["quicserve_admission_redis_errors_total"] > 0


def test_every_series_the_rules_read_is_exported(gw: Gateway) -> None:
    """The metric names in every rule's expression (recording rules' own names aside) are on a real
    gateway's /metrics, with the labels the rules select and aggregate by: a renamed metric or
    label would leave an alert that can never fire."""
    stream = httpx.post(gw.http + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=10)
    assert stream.status_code == 200  # a streamed answer: the TTFT histogram has a sample
    names = exported(httpx.get(gw.http + "/metrics", timeout=10).text)
    read: set[str] = set()
    for rule in _rules():
        expr = rule["expr"]
        here = set(re.findall(r"(?<![\w:])(quicserve_\w+)(?![\w:])", expr))
        assert here - set(names) == set(), f"{rule}: series the gateway does not export"
        read |= here
        by = {label.strip() for group in re.findall(r"\bby \(([^)]*)\)", expr) for label in group.split(",")}
        for name in here:
            selected = {m.group(1) for sel in re.findall(rf"(?<![\w:]){name}\{{([^}}]*)\}}", expr)
                        for m in re.finditer(r"(\w+)\s*[=!]", sel)}
            if names[name]:  # the labels seen on its samples (none yet: nothing to compare)
                assert (selected | by) - {"job", "instance", "le"} <= names[name], f"{name} in {rule}"
    assert {"quicserve_requests_total", "quicserve_time_to_first_token_seconds_bucket",
            "quicserve_admission_shed_total", "quicserve_worker_restarts_total",
            "quicserve_rollout_status", "quicserve_config_reloads_total"} <= read
