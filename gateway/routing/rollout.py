"""Gray release inside the gateway: a candidate model takes a growing share of a stable model's
traffic, step by step, gated on what the gateway itself measures; sans-I/O, ``now`` passed in.

How it works: a :class:`Rollout` stands between the routing decision and the pool. A request
decided for the ``stable`` model goes to the ``candidate`` with the current step's share (exact:
a running remainder, not a coin), and every diverted or kept request reports its end
(:meth:`Rollout.observe`: status, time to first token, time per output token). Each arm keeps the
figures of the current step. At every evaluation (:meth:`Rollout.evaluate`, every ``interval``
seconds) a step whose candidate has ``min_requests`` ends is judged against the gates -- error
rate (a stream that ends in an error counts: the call's final status), p95 TTFT, p95 time per
output token, and p95 TTFT as a ratio to the stable arm's -- and moves to the next step, or
back to 0% for good (``rolled_back``) if any gate fails. The error gate also fails early, as soon
as the candidate's errors alone exceed what the whole sample may hold. At 100% the rollout is
``promoted``. Anchors: Flagger and Argo Rollouts step the same way from an external controller on
Prometheus queries; here the gates read TTFT and TPOT, the signals of a language model, and no
controller is needed.

State survives a restart: :meth:`Rollout.state` / :meth:`Rollout.restore` (serve keeps them in
``rollouts.json`` in the state directory), so a restart resumes at the step it was on, never at
0% or 100% by accident.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RolloutSettings", "Rollout", "Rollouts", "ArmFigures", "ROLLOUT_KEYS"]

log = logging.getLogger("quicserve.rollout")

ROLLOUT_KEYS = ("name", "stable", "candidate", "steps", "min_requests", "interval", "max_error_rate",
                "max_p95_ttft_ms", "max_p95_tpot_ms", "max_ttft_ratio")
_KEEP = 10_000  # samples kept per arm and step (the p95 of the latest ones)


@dataclass(frozen=True, slots=True)
class RolloutSettings:
    """One ``[[rollouts]]`` entry; a gate of 0 is off."""

    name: str
    stable: str
    candidate: str
    steps: list[float] = field(default_factory=lambda: [5.0, 20.0, 50.0, 100.0])  # candidate share, percent
    min_requests: int = 100  # candidate requests ended in a step before it is judged
    interval: float = 10.0  # seconds between evaluations
    max_error_rate: float = 0.02
    max_p95_ttft_ms: float = 0.0
    max_p95_tpot_ms: float = 0.0
    max_ttft_ratio: float = 0.0  # candidate p95 TTFT / the stable arm's

    def problems(self, models: set[str]) -> list[str]:
        p = []
        for arm in ("stable", "candidate"):
            if getattr(self, arm) not in models:
                p.append(f"{arm}: {getattr(self, arm)!r} is not a served model")
        if self.stable == self.candidate:
            p.append("candidate: must differ from stable")
        if not self.steps or any(not 0 < s <= 100 for s in self.steps) or self.steps != sorted(self.steps) \
                or self.steps[-1] != 100:
            p.append(f"steps: expected rising shares in (0, 100] ending at 100, got {self.steps!r}")
        if self.min_requests < 1:
            p.append("min_requests: must be >= 1")
        if not self.interval > 0:
            p.append("interval: must be > 0")
        for gate in ("max_error_rate", "max_p95_ttft_ms", "max_p95_tpot_ms", "max_ttft_ratio"):
            if not (getattr(self, gate) >= 0 and math.isfinite(getattr(self, gate))):
                p.append(f"{gate}: must be >= 0 (0 = no gate)")
        return p


class ArmFigures:
    """One arm's ends in the current step."""

    __slots__ = ("requests", "errors", "ttft", "tpot")

    def __init__(self) -> None:
        self.requests = 0
        self.errors = 0
        self.ttft: list[float] = []  # seconds
        self.tpot: list[float] = []

    def add(self, status: int, ttft: float | None, tpot: float | None) -> None:
        self.requests += 1
        if status >= 500:
            self.errors += 1
        if ttft is not None and len(self.ttft) < _KEEP:
            self.ttft.append(ttft)
        if tpot is not None and len(self.tpot) < _KEEP:
            self.tpot.append(tpot)

    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @staticmethod
    def p95(values: list[float]) -> float | None:
        if not values:
            return None
        s = sorted(values)
        return s[min(len(s) - 1, math.ceil(0.95 * len(s)) - 1)]

    def summary(self) -> dict[str, Any]:
        ttft, tpot = self.p95(self.ttft), self.p95(self.tpot)
        return {"requests": self.requests, "errors": self.errors, "error_rate": round(self.error_rate(), 6),
                "p95_ttft_ms": None if ttft is None else round(ttft * 1e3, 3),
                "p95_tpot_ms": None if tpot is None else round(tpot * 1e3, 3)}


class Rollout:
    """One gray release (see the module doc)."""

    def __init__(self, s: RolloutSettings, now: float) -> None:
        self.s = s
        self.step = 0  # index into s.steps
        self.status = "running"  # running | promoted | rolled_back
        self.reason = ""
        self._since = now  # when this step began
        self._next_eval = now + s.interval
        self._acc = 0.0  # the running remainder of candidate share
        self.arms = {s.stable: ArmFigures(), s.candidate: ArmFigures()}

    @property
    def share(self) -> float:
        """The candidate's share of the stable model's traffic now, in percent."""
        if self.status == "rolled_back":
            return 0.0
        return 100.0 if self.status == "promoted" else self.s.steps[self.step]

    def pick(self) -> str:
        """The model one request decided for ``stable`` goes to (exact shares over any run)."""
        self._acc += self.share
        if self._acc >= 100.0:
            self._acc -= 100.0
            return self.s.candidate
        return self.s.stable

    def observe(self, model: str, status: int, ttft: float | None, tpot: float | None) -> None:
        """A request this rollout placed ended (its status, TTFT and TPOT in seconds)."""
        arm = self.arms.get(model)
        if arm is not None:
            arm.add(status, ttft, tpot)

    def due(self, now: float) -> bool:
        return self.status == "running" and now >= self._next_eval

    def evaluate(self, now: float) -> str | None:
        """Judge the step if it is due and has its sample; returns the transition made, if any
        (``"step N%"``, ``"promoted"``, ``"rolled_back: why"``)."""
        if not self.due(now):
            return None
        self._next_eval = now + self.s.interval
        cand = self.arms[self.s.candidate]
        early = self.s.max_error_rate > 0 and cand.errors > self.s.max_error_rate * self.s.min_requests
        if cand.requests < self.s.min_requests and not early:
            return None
        failed = self._gates(cand, self.arms[self.s.stable])
        if failed:
            self.status, self.reason = "rolled_back", "; ".join(failed)
            log.warning("rollout %s: rolled back to 0%%: %s", self.s.name, self.reason)
            return f"rolled_back: {self.reason}"
        if self.step + 2 >= len(self.s.steps):  # the next step is the last one, 100%: promoted
            self.step = len(self.s.steps) - 1
            self.status = "promoted"
            log.info("rollout %s: promoted (%s takes all of %s's traffic)", self.s.name, self.s.candidate, self.s.stable)
            return "promoted"
        self.step += 1
        self._since = now
        self.arms = {self.s.stable: ArmFigures(), self.s.candidate: ArmFigures()}
        log.info("rollout %s: step %g%% -> %g%%", self.s.name, self.s.steps[self.step - 1], self.share)
        return f"step {self.share:g}%"

    def _gates(self, cand: ArmFigures, stable: ArmFigures) -> list[str]:
        s, failed = self.s, []
        if s.max_error_rate > 0 and cand.error_rate() > s.max_error_rate:
            failed.append(f"error rate {cand.error_rate():.3f} > {s.max_error_rate:g}")
        ttft, tpot = cand.p95(cand.ttft), cand.p95(cand.tpot)
        if s.max_p95_ttft_ms > 0 and ttft is not None and ttft * 1e3 > s.max_p95_ttft_ms:
            failed.append(f"p95 TTFT {ttft * 1e3:.1f} ms > {s.max_p95_ttft_ms:g} ms")
        if s.max_p95_tpot_ms > 0 and tpot is not None and tpot * 1e3 > s.max_p95_tpot_ms:
            failed.append(f"p95 TPOT {tpot * 1e3:.2f} ms > {s.max_p95_tpot_ms:g} ms")
        base = stable.p95(stable.ttft)
        if s.max_ttft_ratio > 0 and ttft is not None and base:
            if ttft / base > s.max_ttft_ratio:
                failed.append(f"p95 TTFT {ttft / base:.2f}x the stable arm's > {s.max_ttft_ratio:g}x")
        return failed

    def state(self) -> dict[str, Any]:
        """What survives a restart (JSON), and what the admin endpoint shows."""
        return {"stable": self.s.stable, "candidate": self.s.candidate, "status": self.status, "step": self.step,
                "share": self.share, "reason": self.reason,
                "arms": {m: a.summary() for m, a in self.arms.items()}}

    def restore(self, saved: dict[str, Any]) -> None:
        """Resume a saved state (same stable and candidate; the step clamped to the configured steps)."""
        if saved.get("stable") != self.s.stable or saved.get("candidate") != self.s.candidate:
            return  # another release now: start it afresh
        if saved.get("status") in ("running", "promoted", "rolled_back"):
            self.status = saved["status"]
            self.reason = str(saved.get("reason", ""))
        step = saved.get("step", 0)
        if isinstance(step, int) and not isinstance(step, bool):
            self.step = max(0, min(step, len(self.s.steps) - 1))


class Rollouts:
    """Every configured rollout, by its stable model (one rollout per stable model)."""

    def __init__(self, settings: list[RolloutSettings], now: float) -> None:
        self.by_stable = {s.stable: Rollout(s, now) for s in settings}
        self.interval = min((s.interval for s in settings), default=10.0)

    def __bool__(self) -> bool:
        return bool(self.by_stable)

    def reconfigure(self, settings: list[RolloutSettings], now: float) -> None:
        """A reload's rollouts: one still releasing the same candidate over the same stable model
        goes on from its state; others start afresh; removed ones end."""
        saved = self.states()
        self.by_stable = {s.stable: Rollout(s, now) for s in settings}
        self.interval = min((s.interval for s in settings), default=10.0)
        self.restore(saved)

    def evaluate(self, now: float) -> list[tuple[str, str]]:
        """(rollout, transition) for every rollout that moved."""
        out = []
        for ro in self.by_stable.values():
            moved = ro.evaluate(now)
            if moved is not None:
                out.append((ro.s.name, moved))
        return out

    def states(self) -> dict[str, dict[str, Any]]:
        return {ro.s.name: ro.state() for ro in self.by_stable.values()}

    def restore(self, saved: dict[str, Any]) -> None:
        for ro in self.by_stable.values():
            state = saved.get(ro.s.name)
            if isinstance(state, dict):
                ro.restore(state)
