"""The I/O around :mod:`.rollout`: the evaluation loop, the state file, the metrics.

The state file (``rollouts.json`` in the state directory) is written whole after every
transition (to a temporary file, then renamed: a crash leaves the old one or the new one) and
read at start, so a restart resumes each rollout at its step and status.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
from prometheus_client.core import GaugeMetricFamily, Metric

from .. import clock
from .rollout import Rollouts

__all__ = ["run_rollouts", "load_rollouts", "RolloutCollector", "STATE_FILE"]

log = logging.getLogger("quicserve.rollout")
STATE_FILE = "rollouts.json"


def load_rollouts(rollouts: Rollouts, path: Path) -> None:
    """Resume what ``path`` saved (a missing or unreadable file: every rollout starts at its first step)."""
    try:
        saved = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        return
    except (OSError, orjson.JSONDecodeError) as e:
        log.warning("rollouts: cannot read %s (%s); starting every rollout at its first step", path, e)
        return
    if isinstance(saved, dict):
        rollouts.restore(saved)
        for name, state in rollouts.states().items():
            log.info("rollout %s resumed: %s at %g%%", name, state["status"], state["share"])


def save_rollouts(rollouts: Rollouts, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(orjson.dumps({name: {k: v for k, v in st.items() if k != "arms"}
                                  for name, st in rollouts.states().items()}, option=orjson.OPT_INDENT_2))
    os.replace(tmp, path)


async def run_rollouts(rollouts: Rollouts, path: Path) -> None:
    """Evaluate every rollout when due, for the gateway's life; cancel it to stop."""
    while True:
        await asyncio.sleep(max(0.05, rollouts.interval / 4))  # a reload may change the interval
        if rollouts.evaluate(clock.now()):
            try:
                save_rollouts(rollouts, path)
            except OSError as e:
                log.error("rollouts: cannot save %s: %s (a restart would resume an older state)", path, e)


class RolloutCollector:
    """``/metrics``: each rollout's candidate share and status, and each arm's figures in the step."""

    def __init__(self, rollouts: Rollouts) -> None:
        self.rollouts = rollouts

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        share = GaugeMetricFamily("quicserve_rollout_share_percent", "The candidate's share of the stable model's "
                                  "traffic", labels=["rollout"])
        status = GaugeMetricFamily("quicserve_rollout_status", "1 for the rollout's status (running, promoted, "
                                   "rolled_back)", labels=["rollout", "status"])
        arms: dict[str, GaugeMetricFamily] = {
            k: GaugeMetricFamily(f"quicserve_rollout_arm_{k}", doc, labels=["rollout", "model", "arm"])
            for k, doc in (("requests", "Requests ended in the current step"),
                           ("error_rate", "Share of them that ended in an error (5xx)"),
                           ("p95_ttft_ms", "p95 time to first token in the current step"),
                           ("p95_tpot_ms", "p95 time per output token in the current step"))}
        for name, st in self.rollouts.states().items():
            share.add_metric([name], st["share"])
            status.add_metric([name, st["status"]], 1)
            for model, figs in st["arms"].items():
                arm = "candidate" if model == st["candidate"] else "stable"
                for k, fam in arms.items():
                    v: Any = figs[k]
                    if v is not None:
                        fam.add_metric([name, model, arm], v)
        yield share
        yield status
        yield from arms.values()
