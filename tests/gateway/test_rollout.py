"""The gray-release controller (gateway/routing/rollout.py) on a fake clock."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from gateway.routing.rollout import Rollout, Rollouts, RolloutSettings
from gateway.routing.rollout_runner import load_rollouts, save_rollouts


def _settings(**kw: object) -> RolloutSettings:
    base: dict[str, object] = dict(name="r", stable="v1", candidate="v2", steps=[10.0, 50.0, 100.0], min_requests=20,
                                   interval=1.0, max_error_rate=0.05)
    base.update(kw)
    return RolloutSettings(**base)  # type: ignore[arg-type]


def _serve(ro: Rollout, n: int, fail: float = 0.0, ttft: float = 0.05, stable_ttft: float = 0.05) -> Counter[str]:
    """``n`` requests for the stable model: each placed, then ended (the candidate failing ``fail``)."""
    picks: Counter[str] = Counter()
    errors = 0.0
    for _ in range(n):
        model = ro.pick()
        picks[model] += 1
        status = 200
        if model == "v2":
            errors += fail
            if errors >= 1:
                errors -= 1
                status = 500
        ro.observe(model, status, ttft if model == "v2" else stable_ttft, 0.01)
    return picks


def test_shares_are_exact_and_steps_promote() -> None:
    ro = Rollout(_settings(), now=0.0)
    assert _serve(ro, 200) == {"v1": 180, "v2": 20}  # 10%
    assert ro.evaluate(0.5) is None  # not due yet
    assert ro.evaluate(1.0) == "step 50%"
    assert _serve(ro, 40) == {"v1": 20, "v2": 20}
    assert ro.evaluate(2.0) == "promoted"
    assert ro.share == 100.0 and set(_serve(ro, 10)) == {"v2"}
    assert ro.evaluate(10.0) is None  # done


def test_no_judgement_before_the_sample() -> None:
    ro = Rollout(_settings(min_requests=50), now=0.0)
    _serve(ro, 100)  # 10 candidate requests of 50 needed
    assert ro.evaluate(1.0) is None and ro.share == 10.0


def test_error_gate_rolls_back_to_zero() -> None:
    ro = Rollout(_settings(), now=0.0)
    _serve(ro, 200, fail=0.2)
    assert ro.evaluate(1.0) == "rolled_back: error rate 0.200 > 0.05"
    assert ro.share == 0.0 and set(_serve(ro, 50)) == {"v1"}
    assert ro.evaluate(5.0) is None  # rolled back for good


def test_errors_fail_early_before_the_sample_is_full() -> None:
    ro = Rollout(_settings(min_requests=100), now=0.0)
    _serve(ro, 100, fail=1.0)  # 10 candidate requests, all failed: more than 5% of 100 whatever comes
    moved = ro.evaluate(1.0)
    assert moved is not None and moved.startswith("rolled_back")


def test_latency_gates() -> None:
    ro = Rollout(_settings(max_error_rate=0.0, max_p95_ttft_ms=100.0), now=0.0)
    _serve(ro, 200, ttft=0.2)
    assert ro.evaluate(1.0) == "rolled_back: p95 TTFT 200.0 ms > 100 ms"
    ro = Rollout(_settings(max_error_rate=0.0, max_ttft_ratio=1.5), now=0.0)
    _serve(ro, 200, ttft=0.2, stable_ttft=0.1)
    assert ro.evaluate(1.0) == "rolled_back: p95 TTFT 2.00x the stable arm's > 1.5x"
    ro = Rollout(_settings(max_error_rate=0.0, max_p95_tpot_ms=5.0), now=0.0)
    _serve(ro, 200)
    assert ro.evaluate(1.0) == "rolled_back: p95 TPOT 10.00 ms > 5 ms"


def test_state_survives_a_restart(tmp_path: Path) -> None:
    ros = Rollouts([_settings()], now=0.0)
    ro = ros.by_stable["v1"]
    _serve(ro, 200)
    assert ros.evaluate(1.0) == [("r", "step 50%")]
    save_rollouts(ros, tmp_path / "rollouts.json")
    again = Rollouts([_settings()], now=100.0)
    load_rollouts(again, tmp_path / "rollouts.json")
    assert again.by_stable["v1"].share == 50.0  # resumed at its step, not at 10% or 100%
    other = Rollouts([_settings(candidate="v3")], now=0.0)  # another release: starts afresh
    load_rollouts(other, tmp_path / "rollouts.json")
    assert other.by_stable["v1"].share == 10.0


def test_settings_problems() -> None:
    s = RolloutSettings("r", "v1", "v1", steps=[50.0, 20.0], min_requests=0, interval=0.0, max_error_rate=-1)
    text = "\n".join(s.problems({"v1"}))
    for needle in ("candidate: must differ", "steps: expected rising", "min_requests", "interval", "max_error_rate"):
        assert needle in text
    assert "stable: 'x' is not a served model" in "\n".join(RolloutSettings("r", "x", "v1").problems({"v1"}))
