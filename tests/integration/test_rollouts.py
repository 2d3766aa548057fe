"""Gray release through a real ``quicserve serve`` (issue #28, item 4): two rollouts over synthetic
models on default clocks -- a candidate that fails half its requests (the synthetic engine's fault
injection) is rolled back to 0%, a healthy one is promoted step by step; the admin endpoint and
/metrics show both; a restart on the same state directory resumes them where they were."""

from __future__ import annotations

import time
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
name = "v1"
[[models]]
name = "v2"
workers = { synthetic_error_rate = 0.5, synthetic_fault_seed = 3 }
[[models]]
name = "w1"
[[models]]
name = "w2"

[[rollouts]]
name = "bad"
stable = "v1"
candidate = "v2"
steps = [20, 100]
min_requests = 10
interval = 0.2
max_error_rate = 0.05

[[rollouts]]
name = "good"
stable = "w1"
candidate = "w2"
steps = [20, 50, 100]
min_requests = 10
interval = 0.2
max_error_rate = 0.05
max_p95_ttft_ms = 5000
"""

pytestmark = pytest.mark.timeout(120)


def _serve(tmp: Path) -> Gateway:
    return serve_config(tmp, CONFIG, models=("v1", "v2", "w1", "w2"))


def _states(g: Gateway) -> dict[str, dict[str, object]]:
    return httpx.get(g.http + "/admin/rollouts").json()["rollouts"]  # type: ignore[no-any-return]


def test_bad_candidate_rolled_back_good_one_promoted_and_both_survive_a_restart(tmp_path: Path) -> None:
    g = _serve(tmp_path)
    try:
        statuses: dict[str, list[int]] = {"v1": [], "w1": []}
        with httpx.Client(base_url=g.http, timeout=10) as c:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                st = _states(g)
                if st["bad"]["status"] == "rolled_back" and st["good"]["status"] == "promoted":
                    break
                for model in statuses:
                    r = c.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2})
                    statuses[model].append(r.status_code)
        st = _states(g)
        assert st["bad"]["status"] == "rolled_back" and st["bad"]["share"] == 0.0
        assert "error rate" in str(st["bad"]["reason"])
        assert st["good"]["status"] == "promoted" and st["good"]["share"] == 100.0
        assert set(statuses["w1"]) == {200}  # the healthy release never failed a request
        # after the rollback, requests for v1 stay on v1 and succeed
        with httpx.Client(base_url=g.http, timeout=10) as c:
            after = [c.post("/v1/completions", json={"model": "v1", "prompt": "hi", "max_tokens": 2}) for _ in range(20)]
        assert all(r.status_code == 200 and r.json()["model"] == "v1" for r in after)
        text = httpx.get(g.http + "/metrics").text
        assert 'quicserve_rollout_share_percent{rollout="bad"} 0.0' in text
        assert 'quicserve_rollout_status{rollout="good",status="promoted"} 1.0' in text
    finally:
        assert stop_gateway(g) == 0
    g = _serve(tmp_path)  # the same state directory: both resume, neither back at its first step
    try:
        st = _states(g)
        assert (st["bad"]["status"], st["bad"]["share"]) == ("rolled_back", 0.0)
        assert (st["good"]["status"], st["good"]["share"]) == ("promoted", 100.0)
    finally:
        assert stop_gateway(g) == 0


LATER = """
[workers]
engine = "synthetic"
synthetic_step_ms = 2
synthetic_prefill_us_per_token = 300  # TTFT: mostly the prompt's prefill, which the slowdown doubles

[[models]]
name = "a1"
[[models]]
name = "a2"
workers = { synthetic_error_rate = 0.05, synthetic_fault_seed = 11 }
[[models]]
name = "s1"
[[models]]
name = "s2"
workers = { synthetic_slowdown = 2.0 }
[[models]]
name = "m1"
[[models]]
name = "m2"

[[rollouts]]
name = "errors-5pc"
stable = "a1"
candidate = "a2"
steps = [50, 100]
min_requests = 200
interval = 0.2
max_error_rate = 0.01

[[rollouts]]
name = "slow-2x"
stable = "s1"
candidate = "s2"
steps = [50, 100]
min_requests = 30
interval = 0.2
max_error_rate = 0.05
max_ttft_ratio = 1.5

[[rollouts]]
name = "midway"
stable = "m1"
candidate = "m2"
steps = [10, 30, 60, 100]
min_requests = 5
interval = 0.2
"""


def test_five_percent_errors_and_double_ttft_rolled_back_and_a_restart_resumes_mid_rollout(tmp_path: Path) -> None:
    g = serve_config(tmp_path, LATER, models=("a1", "a2", "s1", "s2", "m1", "m2"))
    try:
        i = 0
        with httpx.Client(base_url=g.http, timeout=10) as c:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                st = _states(g)
                if st["errors-5pc"]["status"] == st["slow-2x"]["status"] == "rolled_back" \
                        and st["midway"]["share"] >= 30:
                    break
                models = ("a1", "s1") if st["midway"]["share"] >= 30 else ("a1", "s1", "m1")  # midway stays mid-way
                for model in models:
                    i += 1  # a prompt of its own (no prefix-cache hit): ~100 tokens to prefill
                    r = c.post("/v1/completions", json={"model": model, "prompt": f"{i} " + "hi " * 30, "max_tokens": 4})
                    if r.status_code != 200:  # an injected error: an explicit one, never a hang or a lost request
                        assert r.status_code == 500 and r.json()["error"]["message"], r.text
        st = _states(g)
        assert st["errors-5pc"]["status"] == "rolled_back" and "error rate" in str(st["errors-5pc"]["reason"])
        assert st["slow-2x"]["status"] == "rolled_back" and "stable arm" in str(st["slow-2x"]["reason"])
        assert st["midway"]["status"] == "running"
        step, share = st["midway"]["step"], st["midway"]["share"]
    finally:
        assert stop_gateway(g) == 0
    g = serve_config(tmp_path, LATER, models=("a1", "m1"))
    try:
        st = _states(g)
        assert (st["midway"]["status"], st["midway"]["step"], st["midway"]["share"]) == ("running", step, share)
        assert st["errors-5pc"]["share"] == st["slow-2x"]["share"] == 0.0
    finally:
        assert stop_gateway(g) == 0
