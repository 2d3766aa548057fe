"""Gateway CPU per request, this tree against another checkout, side by side in one alternating run.

For changes that must keep the gateway's speed (the one-pipeline rework was held to +5%): start
``quicserve serve --engine synthetic`` from the baseline tree, load it (non-streaming chat and
16-token SSE streams at c=32, the load generator of *this* tree for both), stop it, then the same
from this tree, and alternate for ``--rounds`` rounds. Each side's best round is its figure (the
least disturbed by the rest of the machine); the ratio this/baseline is printed per scenario.

    git worktree add /tmp/base <commit before the change>
    .venv/bin/python -m tests.bench.bench_gateway_ab --baseline /tmp/base [--rounds 3] [--duration 4]

The gateway is pinned to the first CPU and the harness to the others (as in ``bench_gateway``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from tests.bench.bench_gateway import REPO, _load, children, run_scenario, start_gateway

SCENARIOS = [("chat 16 tok, c=32", False), ("chat stream 16 tok, c=32", True)]


def one_round(repo: Path, duration: float, processes: int, pin: bool, cpus: list[int],
              env: list[str], api_key: str = "") -> list[float]:
    """gw µs per request for each scenario, from one fresh gateway of ``repo``."""
    with tempfile.TemporaryDirectory() as state:
        gw, url = start_gateway(state, [], repo, dict(e.split("=", 1) for e in env))
        try:
            kids = children(gw.pid)
            if pin:
                for tid in os.listdir(f"/proc/{gw.pid}/task"):
                    os.sched_setaffinity(int(tid), cpus[:1])
            out = []
            for _, stream in SCENARIOS:
                samples = run_scenario(url, gw.pid, kids[0] if kids else None, path="/v1/chat/completions",
                                       stream=stream, concurrency=32, duration=duration, processes=processes,
                                       repeats=1, api_key=api_key)
                if samples[0].errors or not samples[0].requests:
                    raise RuntimeError(f"{repo}: errors: {samples[0].first_error}")
                out.append(samples[0].gw_us)
            return out
        finally:
            gw.terminate()
            gw.wait(30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", type=Path, required=True, help="source tree of the baseline commit")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=4.0)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--this-env", action="append", default=[], metavar="K=V",
                   help="environment for this tree's gateway (e.g. QUICSERVE_ADMISSION__ENABLED=false)")
    p.add_argument("--baseline-env", action="append", default=[], metavar="K=V")
    p.add_argument("--api-key", default="", help="sent by the load generator (Authorization: Bearer) to both")
    a = p.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    pin = len(cpus) >= 2
    if pin:
        os.sched_setaffinity(0, cpus[1:])
    trees = {"baseline": a.baseline.resolve(), "this": REPO}
    envs = {"baseline": a.baseline_env, "this": a.this_env}
    runs: dict[str, list[list[float]]] = {k: [] for k in trees}
    print(f"A/B gateway CPU, {a.rounds} alternating rounds x {a.duration:g} s; load average {_load()}; "
          f"baseline env {a.baseline_env}, this env {a.this_env}")
    for r in range(a.rounds):
        for name, repo in trees.items():
            figs = one_round(repo, a.duration, a.processes, pin, cpus, envs[name], a.api_key)
            runs[name].append(figs)
            print(f"  round {r + 1} {name:<9}" + "".join(f"{s}: {f:6.1f} µs   " for (s, _), f in zip(SCENARIOS, figs,
                                                                                                    strict=True)),
                  flush=True)
    print(f"{'scenario':<28}{'baseline µs':>12}{'this µs':>10}{'this/base':>11}   (best of {a.rounds})")
    for i, (name, _) in enumerate(SCENARIOS):
        b = min(x[i] for x in runs["baseline"])
        t = min(x[i] for x in runs["this"])
        print(f"{name:<28}{b:>12.1f}{t:>10.1f}{t / b:>11.3f}")
    print(f"load average after: {_load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
