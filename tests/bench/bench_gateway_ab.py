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

``--control`` (with ``--keep``): a second gateway of the baseline tree, started after this tree's,
takes its turn in every round; its ratios to the baseline are what noise alone gives in the same
run (on a shared 2-core VM, paired medians of 12 slices of two identical trees were seen from
0.90 to 1.03), so a ratio for this tree is read against them. With three gateways each takes the
first turn of a round in rotation.

``--perf-stat`` (with ``--keep``): each slice also runs under ``perf stat -p`` on its gateway, and
the table after the CPU figures gives, per scenario and side, the median per request of
instructions (where the machine exposes the counter: a VM often does not), system calls
(``raw_syscalls:sys_enter``) and context switches. Counts move far less than CPU time with the
rest of a shared machine, so equal syscalls and instructions per request with unequal CPU time
point away from the code (cache, memory footprint, neighbours); unequal ones say where to look.
Needs ``perf`` and the right to trace the gateway (root, or ``perf_event_paranoid`` <= 1 for
counters; tracefs for the syscall tracepoint)::

    .venv/bin/python -m tests.bench.bench_gateway_ab --baseline /tmp/base --keep --perf-stat --rounds 6

``--callgrind`` (with ``--keep``): where the machine has no instruction counter (``n/a`` above),
each gateway runs under valgrind's callgrind (about 50x slower; its worker runs natively) and
every slice counts the gateway's user-space instructions exactly (``callgrind_control``
switches counting on for the slice only). Per request they still depend on how many requests a
loop iteration handles, which varies at c=32 under valgrind; ``--concurrency 1`` (one request per
iteration) repeats within about 1%. The CPU figures of such a run mean nothing::

    .venv/bin/python -m tests.bench.bench_gateway_ab --baseline /tmp/base --keep --callgrind \
        --concurrency 1 --rounds 2 --duration 10
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from gateway.loadgen import run_processes
from tests.bench.bench_gateway import REPO, _load, children, cpu_seconds, run_scenario, start_gateway

SCENARIOS = [("chat 16 tok", False), ("chat stream 16 tok", True)]  # at c=32 (--concurrency)
PERF_EVENTS = [("instructions", "instructions"), ("raw_syscalls:sys_enter", "syscalls"),
               ("context-switches", "ctx switches")]
CALLGRIND_EVENTS = [("Ir", "instructions (user, callgrind)")]
Counts = dict[str, float | None]


class PerfStat:
    """``perf stat -p PID`` over one slice: counts of :data:`PERF_EVENTS` (None: not supported)."""

    def __init__(self, pid: int) -> None:
        fd, self._out = tempfile.mkstemp(suffix=".perf")
        os.close(fd)
        self._proc = subprocess.Popen(["perf", "stat", "-x,", "-o", self._out, "-e",
                                       ",".join(e for e, _ in PERF_EVENTS), "-p", str(pid)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(0.3)  # attached before the load starts (the idle gateway counts next to nothing)
        if self._proc.poll() is not None:
            raise RuntimeError(f"perf stat failed: {self._proc.stderr.read() if self._proc.stderr else ''}")

    def stop(self) -> Counts:
        self._proc.send_signal(signal.SIGINT)
        self._proc.wait(30)
        counts: Counts = {e: None for e, _ in PERF_EVENTS}
        with open(self._out) as f:
            for line in f:
                fields = line.strip().split(",")
                if len(fields) > 2 and fields[2] in counts:
                    try:
                        counts[fields[2]] = float(fields[0])
                    except ValueError:  # "<not supported>", "<not counted>"
                        pass
        os.unlink(self._out)
        return counts


def callgrind_prefix(out: str) -> list[str]:
    """What a gateway runs under for ``--callgrind``: nothing counted until :class:`Callgrind` says."""
    return ["valgrind", "-q", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]


class Callgrind:
    """One slice of a gateway started under :func:`callgrind_prefix`: its user-space instructions."""

    def __init__(self, pid: int, out: str) -> None:
        self._pid = str(pid)
        self._out = Path(out)
        self._control("-i", "on")

    def _control(self, *args: str) -> None:
        subprocess.run(["callgrind_control", *args, self._pid], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)

    def stop(self) -> Counts:
        self._control("-i", "off")
        self._control("-d")  # a dump holds what was counted since the last one
        dumps = sorted(self._out.parent.glob(self._out.name + ".*"), key=lambda f: int(f.suffix[1:]))
        totals = [line for line in dumps[-1].read_text().splitlines() if line.startswith("totals:")]
        return {"Ir": float(totals[-1].split()[1]) if totals else None}  # (its summary: line says 0)


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


def _slice(url: str, pid: int, stream: bool, duration: float, processes: int, api_key: str,
           counts: list[Counts] | None = None, meter: Callable[[int], PerfStat | Callgrind] = PerfStat,
           concurrency: int = 32) -> float:
    """Gateway CPU µs per request for one slice of load on a running gateway; with ``counts``, the
    slice is counted by ``meter`` (perf stat or callgrind) and its counts per request appended there."""
    args = argparse.Namespace(url=url, concurrency=concurrency, duration=duration, stream=stream, max_tokens=16,
                              path="/v1/chat/completions", model="tiny", processes=min(processes, concurrency),
                              api_key=api_key)
    m = meter(pid) if counts is not None else None
    c0 = cpu_seconds(pid)
    r = run_processes(args)
    c1 = cpu_seconds(pid)
    raw = m.stop() if m is not None else {}
    if r.errors or not r.requests:
        raise RuntimeError(f"errors: {r.first_error or 'no requests'}")
    if counts is not None:
        counts.append({e: None if v is None else v / r.requests for e, v in raw.items()})
    return (c1 - c0) / r.requests * 1e6


def _num(v: float) -> str:
    return f"{v / 1000:.1f}k" if v >= 1000 else f"{v:.3g}"


def print_counts(counts: dict[str, list[list[Counts]]], events: list[tuple[str, str]]) -> None:
    """The ``--perf-stat`` / ``--callgrind`` table: median counts per request, per scenario and side."""
    print(f"{'per request':<28}" + "".join(f"{label:>30}" for _, label in events)
          + "   (median of the slices; base / this / ratio)")

    def median(side: str, i: int, event: str) -> float | None:
        vals = [v for c in counts[side] if (v := c[i][event]) is not None]
        return statistics.median(vals) if vals else None

    for side in [k for k in counts if k != "baseline"]:
        for i, (name, _) in enumerate(SCENARIOS):
            cells = []
            for event, _ in events:
                b, t = median("baseline", i, event), median(side, i, event)
                cells.append("n/a" if b is None or t is None else f"{_num(b)} / {_num(t)} / {t / b:.3f}")
            label = name if side == "this" else f"{name} ({side})"
            print(f"{label:<28}" + "".join(f"{c:>30}" for c in cells))


def keep_mode(a: argparse.Namespace, trees: dict[str, Path], envs: dict[str, list[str]], pin: bool,
              cpus: list[int]) -> dict[str, list[list[float]]]:
    """Every gateway (baseline, this, control) running for the whole run; ``a.rounds`` alternating
    slices per scenario (with ``a.perf_stat`` or ``a.callgrind``, each slice's counts per request
    are printed after the CPU table)."""
    runs: dict[str, list[list[float]]] = {k: [] for k in trees}
    counts: dict[str, list[list[Counts]]] = {k: [] for k in trees}
    counting = a.perf_stat or a.callgrind
    outs: dict[int, str] = {}  # --callgrind: each gateway's dump file

    def meter(pid: int) -> PerfStat | Callgrind:
        return Callgrind(pid, outs[pid]) if a.callgrind else PerfStat(pid)

    with contextlib.ExitStack() as stack:
        gws = {}
        for name, repo in trees.items():
            state = stack.enter_context(tempfile.TemporaryDirectory())
            out = f"{state}/callgrind.out"
            gw, url = start_gateway(state, [], repo, dict(e.split("=", 1) for e in envs[name]),
                                    callgrind_prefix(out) if a.callgrind else None)
            outs[gw.pid] = out
            stack.callback(gw.wait, 30)
            stack.callback(gw.terminate)
            if pin:
                for tid in os.listdir(f"/proc/{gw.pid}/task"):
                    os.sched_setaffinity(int(tid), cpus[:1])
            gws[name] = (gw.pid, url)
        for pid, url in gws.values():  # warm-up: every scenario once on each
            for _, stream in SCENARIOS:
                _slice(url, pid, stream, 1.0, a.processes, a.api_key, concurrency=a.concurrency)
        names = list(trees)
        for r in range(a.rounds):
            figs: dict[str, list[float]] = {name: [] for name in names}
            cnts: dict[str, list[Counts]] = {name: [] for name in names}
            order = names[r % len(names):] + names[:r % len(names)]  # each side first in turn
            for _, stream in SCENARIOS:
                for name in order if len(names) > 2 or r % 2 == 0 else names[::-1]:
                    pid, url = gws[name]
                    figs[name].append(_slice(url, pid, stream, a.duration, a.processes, a.api_key,
                                             cnts[name] if counting else None, meter, a.concurrency))
            for name in names:
                runs[name].append(figs[name])
                counts[name].append(cnts[name])
                print(f"  round {r + 1} {name:<9}" + "".join(f"{s}: {f:6.1f} µs   " for (s, _), f in
                                                           zip(SCENARIOS, figs[name], strict=True)), flush=True)
    if counting:
        print_counts(counts, CALLGRIND_EVENTS if a.callgrind else PERF_EVENTS)
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
    p.add_argument("--perf-stat", action="store_true",
                   help="with --keep: instructions, syscalls and context switches per request (perf stat)")
    p.add_argument("--callgrind", action="store_true",
                   help="with --keep: gateways under valgrind, exact user-space instructions per request")
    p.add_argument("--concurrency", type=int, default=32, help="connections (--keep; 1 for --callgrind)")
    p.add_argument("--control", action="store_true",
                   help="with --keep: a second baseline gateway, started last, measured like the others: "
                        "its ratio to the first is this run's noise floor (an A/A pair)")
    a = p.parse_args()
    if (a.perf_stat or a.callgrind or a.control or a.concurrency != 32) and not a.keep:
        p.error("--perf-stat, --callgrind, --control and --concurrency need --keep")
    cpus = sorted(os.sched_getaffinity(0))
    pin = len(cpus) >= 2
    if pin:
        os.sched_setaffinity(0, cpus[1:])
    trees = {"baseline": a.baseline.resolve(), "this": REPO}
    envs = {"baseline": a.baseline_env, "this": a.this_env}
    if a.control:
        trees["control"], envs["control"] = trees["baseline"], a.baseline_env
    runs: dict[str, list[list[float]]] = {k: [] for k in trees}
    print(f"A/B gateway CPU, {a.rounds} alternating {'slices' if a.keep else 'rounds'} x {a.duration:g} s"
          f"{' (one gateway per tree, kept)' if a.keep else ''}, c={a.concurrency}; load average {_load()}; "
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
    for side in [k for k in runs if k != "baseline"]:
        if side == "control":
            print("control: the baseline tree again (A/A); its ratios are what noise alone gives in this run")
        for i, (name, _) in enumerate(SCENARIOS):
            bs = [x[i] for x in runs["baseline"]]
            ts = [x[i] for x in runs[side]]
            b, t = min(bs), min(ts)
            bm, tm = statistics.median(bs), statistics.median(ts)
            paired = statistics.median(y / x for x, y in zip(bs, ts, strict=True))
            label = name if side == "this" else f"{name} ({side})"
            print(f"{label:<28}{b:>12.1f}{t:>10.1f}{t / b:>11.3f}{'':>17}{bm:>10.1f}{tm:>10.1f}{tm / bm:>7.3f}"
                  f"{paired:>8.3f}")
    print(f"load average after: {_load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
