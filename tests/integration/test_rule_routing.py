"""Rule-tree routing through a real ``quicserve serve`` (issue #28, items 2 and 3): [[routes]] over
three synthetic models; each response names its leaf (``x-quicserve-route``); a header, keywords,
the prompt's size, a fallback chain past a model with no ready replica, an exact 90/10 split;
``quicserve config check`` names a bad rule by its path."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.serve_process import serve_config
from tests.integration.test_gateway_e2e import Gateway, stop_gateway

REPO = Path(__file__).resolve().parents[2]
CONFIG = """
[workers]
engine = "synthetic"

[[models]]
name = "big"

[[models]]
name = "small"
aliases = ["default"]

[[models]]
name = "down"            # its only worker never answers: no ready replica
local = 0
remote = ["tcp://127.0.0.1:9"]

[[models]]
name = "slow"            # a shadow pool that takes 0.3 s a step
workers = { synthetic_step_ms = 300 }

[[models]]
name = "broken"          # a shadow pool that fails every request
workers = { synthetic_error_rate = 1.0 }

[[routes]]
name = "mirror-slow"
when = { headers = { "x-shadow" = "slow" } }
to = "small"
shadow = { to = "slow", share = 50, max_in_flight = 2 }

[[routes]]
name = "mirror-broken"
when = { headers = { "x-shadow" = "broken" } }
to = "small"
shadow = { to = "broken", share = 100 }

[[routes]]
name = "gold"
when = { headers = { "x-tier" = "gold" } }
to = "big"

[[routes]]
name = "sql"
when = { user_keywords = ["sql"] }
to = "big"

[[routes]]
name = "long"
when = { min_prompt_tokens = 200 }
to = "big"

[[routes]]
name = "chain"
when = { model = "down" }
fallback = ["down", "small"]

[[routes]]
name = "ab"
when = { model = "small" }
split = [{ to = "small", weight = 90 }, { to = "big", weight = 10 }]
"""

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    g = serve_config(tmp_path_factory.mktemp("rules"), CONFIG, models=("big", "small", "slow", "broken"))
    yield g
    assert stop_gateway(g) == 0


def _chat(client: httpx.Client, model: str, text: str = "hi", **headers: str) -> tuple[str, str]:
    r = client.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": text}],
                                                  "max_tokens": 2}, headers=headers)
    assert r.status_code == 200, r.text
    return r.headers.get("x-quicserve-route", ""), r.json()["model"]


def test_each_feature_picks_its_leaf(gw: Gateway) -> None:
    with httpx.Client(base_url=gw.http) as c:
        assert _chat(c, "default", **{"x-tier": "gold"}) == ("gold", "big")
        assert _chat(c, "small", "write SQL for me") == ("sql", "big")
        assert _chat(c, "small", "x" * 1000) == ("long", "big")
        assert _chat(c, "down") == ("chain", "small")  # "down" has no ready replica: the next in the chain
        assert _chat(c, "big") == ("", "big")  # no rule matches: the model asked for, no header


def test_split_takes_its_exact_shares(gw: Gateway) -> None:
    with httpx.Client(base_url=gw.http) as c:
        picks = Counter(_chat(c, "small") for _ in range(200))
    assert picks == {("ab", "small"): 180, ("ab", "big"): 20}
    text = httpx.get(gw.http + "/metrics").text
    assert 'quicserve_route_decisions_total{leaf="ab",model="big"} 20.0' in text
    assert 'quicserve_route_decisions_total{leaf="chain",model="small"} 1.0' in text


def test_config_check_names_a_bad_rule_by_path(tmp_path: Path) -> None:
    bad = CONFIG.replace('user_keywords = ["sql"]', 'user_regex = "(sql"').replace('to = "big"\n\n[[routes]]\nname = "long"',
                                                                                    'to = "huge"\n\n[[routes]]\nname = "long"')
    (tmp_path / "bad.toml").write_text(bad)
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "config", "check", str(tmp_path / "bad.toml")], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    out = r.stdout + r.stderr
    assert "routes[3].when.user_regex: not a regular expression" in out
    assert "routes[3].to: 'huge' is not a served model" in out


def test_shadow_copies_never_touch_the_clients_answer(gw: Gateway) -> None:
    """Half of the requests copied to a pool that takes 0.6 s each, at most 2 at once: every client
    answer still comes at once, from its own model; the copies beyond the bound are skipped. Every
    copy to a failing pool fails, and no client sees it."""
    metrics = httpx.get(gw.http + "/metrics").text
    with httpx.Client(base_url=gw.http) as c:
        t0 = time.monotonic()
        answers = [_chat(c, "small", **{"x-shadow": "slow"}) for _ in range(20)]
        took = time.monotonic() - t0
        broken = [_chat(c, "small", **{"x-shadow": "broken"}) for _ in range(10)]
    assert set(answers) == {("mirror-slow", "small")} and set(broken) == {("mirror-broken", "small")}
    assert took < 3.0, took  # 20 copies of 0.6 s in series would be 12 s; at 2 in flight 6 s
    deadline = time.monotonic() + 10
    while True:
        metrics = httpx.get(gw.http + "/metrics").text
        ok = _count(metrics, 'quicserve_shadow_requests_total{leaf="mirror-slow",model="slow",outcome="ok"}')
        skipped = _count(metrics, 'quicserve_shadow_requests_total{leaf="mirror-slow",model="slow",outcome="skipped"}')
        failed = _count(metrics, 'quicserve_shadow_requests_total{leaf="mirror-broken",model="broken",outcome="failed"}')
        if ok + skipped == 10 and failed == 10 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert ok + skipped == 10 and 2 <= ok <= 8 and skipped >= 2, (ok, skipped)  # half copied, the bound held
    assert failed == 10


def _count(metrics: str, series: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(series):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
