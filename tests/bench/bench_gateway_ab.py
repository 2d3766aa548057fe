"""Gateway CPU per request, this tree against another checkout, side by side in one alternating run.

For changes that must keep the gateway's speed (the one-pipeline rework was held to +5%): start
``quicserve serve --engine synthetic`` from the baseline tree, load it (non-streaming chat and
16-token SSE streams at c=32, the load generator of *this* tree for both), stop it, then the same
from this tree, and alternate for ``--rounds`` rounds. Each side's best round is its figure (the
least disturbed by the rest of the machine); the ratio this/baseline is printed per scenario.

    git worktree add /tmp/base <commit before the change>
    .venv/bin/python -m tests.bench.bench_gateway_ab --baseline /tmp/base [--rounds 3] [--duration 4]

The gateway is pinned to the first CPU and the harness to the others (as in ``bench_gateway``).

``--keep``: start each tree's gateway once and alternate ``--rounds`` short slices of load between
the two running gateways (both pinned to the first CPU; only one is loaded at a time). More,
shorter pairs, without a restart per round: besides each side's best slice, the paired ratio (the
median over rounds of this slice / the baseline slice next to it) is printed, which a machine whose
load drifts (other jobs on a shared host) moves least::

    .venv/bin/python -m tests.bench.bench_gateway_ab --baseline /tmp/base --keep --rounds 12 --duration 2
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
from pathlib import Path

from gateway.loadgen import run_processes
from tests.bench.bench_gateway import REPO, _load, children, cpu_seconds, run_scenario, start_gateway

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


def _slice(url: str, pid: int, stream: bool, duration: float, processes: int, api_key: str) -> float:
    """Gateway CPU µs per request for one slice of load on a running gateway."""
    args = argparse.Namespace(url=url, concurrency=32, duration=duration, stream=stream, max_tokens=16,
                              path="/v1/chat/completions", model="tiny", processes=processes, api_key=api_key)
    c0 = cpu_seconds(pid)
    r = run_processes(args)
    c1 = cpu_seconds(pid)
    if r.errors or not r.requests:
        raise RuntimeError(f"errors: {r.first_error or 'no requests'}")
    return (c1 - c0) / r.requests * 1e6


def keep_mode(a: argparse.Namespace, trees: dict[str, Path], envs: dict[str, list[str]], pin: bool,
              cpus: list[int]) -> dict[str, list[list[float]]]:
    """Both gateways running for the whole run; ``a.rounds`` alternating slices per scenario."""
    runs: dict[str, list[list[float]]] = {k: [] for k in trees}
    with contextlib.ExitStack() as stack:
        gws = {}
        for name, repo in trees.items():
            state = stack.enter_context(tempfile.TemporaryDirectory())
            gw, url = start_gateway(state, [], repo, dict(e.split("=", 1) for e in envs[name]))
            stack.callback(gw.wait, 30)
            stack.callback(gw.terminate)
            if pin:
                for tid in os.listdir(f"/proc/{gw.pid}/task"):
                    os.sched_setaffinity(int(tid), cpus[:1])
            gws[name] = (gw.pid, url)
        for pid, url in gws.values():  # warm-up: every scenario once on each
            for _, stream in SCENARIOS:
                _slice(url, pid, stream, 1.0, a.processes, a.api_key)
        names = list(trees)
        for r in range(a.rounds):
            figs: dict[str, list[float]] = {name: [] for name in names}
            for _, stream in SCENARIOS:
                for name in names if r % 2 == 0 else names[::-1]:
                    pid, url = gws[name]
                    figs[name].append(_slice(url, pid, stream, a.duration, a.processes, a.api_key))
            for name in names:
                runs[name].append(figs[name])
                print(f"  round {r + 1} {name:<9}" + "".join(f"{s}: {f:6.1f} µs   " for (s, _), f in
                                                           zip(SCENARIOS, figs[name], strict=True)), flush=True)
    return runs


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
    p.add_argument("--keep", action="store_true",
                   help="one gateway per tree for the whole run, alternating --rounds slices (module docstring)")
    a = p.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    pin = len(cpus) >= 2
    if pin:
        os.sched_setaffinity(0, cpus[1:])
    trees = {"baseline": a.baseline.resolve(), "this": REPO}
    envs = {"baseline": a.baseline_env, "this": a.this_env}
    runs: dict[str, list[list[float]]] = {k: [] for k in trees}
    print(f"A/B gateway CPU, {a.rounds} alternating {'slices' if a.keep else 'rounds'} x {a.duration:g} s"
          f"{' (one gateway per tree, kept)' if a.keep else ''}; load average {_load()}; "
          f"baseline env {a.baseline_env}, this env {a.this_env}")
    if a.keep:
        runs = keep_mode(a, trees, envs, pin, cpus)
    else:
        for r in range(a.rounds):
            for name, repo in trees.items():
                figs = one_round(repo, a.duration, a.processes, pin, cpus, envs[name], a.api_key)
                runs[name].append(figs)
                print(f"  round {r + 1} {name:<9}" + "".join(f"{s}: {f:6.1f} µs   " for (s, _), f in
                                                           zip(SCENARIOS, figs, strict=True)), flush=True)
    print(f"{'scenario':<28}{'baseline µs':>12}{'this µs':>10}{'this/base':>11}   (best of {a.rounds})"
          f"{'base med':>10}{'this med':>10}{'ratio':>7}{'paired':>8}")
    for i, (name, _) in enumerate(SCENARIOS):
        bs = [x[i] for x in runs["baseline"]]
        ts = [x[i] for x in runs["this"]]
        b, t = min(bs), min(ts)
        bm, tm = statistics.median(bs), statistics.median(ts)
        paired = statistics.median(y / x for x, y in zip(bs, ts, strict=True))
        print(f"{name:<28}{b:>12.1f}{t:>10.1f}{t / b:>11.3f}{'':>17}{bm:>10.1f}{tm:>10.1f}{tm / bm:>7.3f}"
              f"{paired:>8.3f}")
    print(f"load average after: {_load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
