"""Rule-tree routing through a real ``quicserve serve`` (issue #28, items 2 and 3): [[routes]] over
three synthetic models; each response names its leaf (``x-quicserve-route``); a header, keywords,
the prompt's size, a fallback chain past a model with no ready replica, an exact 90/10 split;
``quicserve config check`` names a bad rule by its path."""

from __future__ import annotations

import subprocess
import sys
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
    g = serve_config(tmp_path_factory.mktemp("rules"), CONFIG, models=("big", "small"))
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
    assert "routes[1].when.user_regex: not a regular expression" in out
    assert "routes[1].to: 'huge' is not a served model" in out
