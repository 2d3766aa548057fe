"""Gateway benchmark: loopback load against `quicserve serve --engine synthetic`.

Starts a real gateway process (and its synthetic worker child), then for each
scenario runs the load generator (``gateway.loadgen``, its own processes) for
a fixed time and reads the gateway's CPU time from /proc/<pid>/stat before and
after. Prints req/s, p50/p99 latency, gateway CPU µs per request, the worker's
CPU µs per request for context, and the ratio to a same-run baseline
(``GET /healthz``: the HTTP stack alone).

    .venv/bin/python tests/bench/bench_gateway.py [--duration 5] [--repeats 3] [--quick] [--strict]

Each scenario is warmed up, then timed ``--repeats`` times (at least 2); the
table shows the median of each column over the repeats, and the spread of the
gateway CPU figure. Targets (same machine): <= 100 µs gateway CPU per
non-streaming request, <= 250 µs per 16-token stream; each chat row says MET or
MISSED (``--strict``: exit 1 when one is missed). CPU per request is inflated
by other load on the machine (cache and scheduler contention), so the load
average is printed before and after.

On a machine with two or more CPUs the gateway process is pinned to the first
and the load generator and the worker to the rest (``--no-pin`` to turn this
off): on two cores the four busy processes otherwise land on the gateway's
core at random, and its CPU per request moved by half between otherwise equal
runs.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from gateway.loadgen import run_processes  # noqa: E402
from tests.bench.proc_cpu import cpu_seconds  # noqa: E402

TARGET_UNARY_US = 100.0
TARGET_STREAM_US = 250.0


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(x) for x in text]
    return out


def start_gateway(state: str, worker_options: list[str], repo: Path = REPO,
                  extra_env: dict[str, str] | None = None,
                  prefix: list[str] | None = None) -> tuple[subprocess.Popen[str], str]:
    """``quicserve serve --engine synthetic`` from the source tree ``repo`` (another checkout for A/B runs);
    ``prefix``: a command the gateway runs under (``valgrind ...``; its worker runs without it)."""
    cmd = [*(prefix or []), sys.executable, "-m", "gateway.cli", "serve", "--engine", "synthetic", "--port", "0", "--no-tls",
           "--progress", "off", "--log-level", "warning", "--state-dir", state]
    env = {**os.environ, "PYTHONPATH": str(repo), **(extra_env or {})}
    if (repo / "gateway" / "grpc" / "mount.py").exists():  # a newer tree: no gRPC port, no drain grace
        cmd += ["--grpc-port", "-1"]
        env["QUICSERVE_SHUTDOWN__GRACE_PERIOD"] = "0"
    cmd += [f"--worker-option={o}" for o in worker_options]
    proc = subprocess.Popen(cmd, cwd=repo, stdout=subprocess.PIPE, text=True, env=env)
    url = ""
    deadline = time.monotonic() + (600 if prefix else 120)
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"gateway exited with {proc.wait()}")
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            url = m.group(1)
        if line.startswith("quicserve: ready"):
            return proc, url
    raise RuntimeError("gateway not ready in time")


@dataclass
class Sample:
    """One timed run of a scenario."""

    rps: float
    p50_ms: float
    p99_ms: float
    gw_us: float
    wk_us: float
    requests: int
    errors: int
    first_error: str


def run_scenario(url: str, gw_pid: int, worker_pid: int | None, *, path: str, stream: bool, concurrency: int,
                 duration: float, processes: int, repeats: int, api_key: str = "") -> list[Sample]:
    """Warm up once, then ``repeats`` timed runs, each with its own /proc CPU readings."""
    args = argparse.Namespace(url=url, concurrency=concurrency, duration=duration, stream=stream, max_tokens=16,
                              path=path, model="tiny", processes=processes, api_key=api_key)
    warm = argparse.Namespace(**{**vars(args), "duration": min(1.0, duration)})
    run_processes(warm)
    out: list[Sample] = []
    for _ in range(repeats):
        g0 = cpu_seconds(gw_pid)
        w0 = cpu_seconds(worker_pid) if worker_pid else 0.0
        r = run_processes(args)
        g1 = cpu_seconds(gw_pid)
        w1 = cpu_seconds(worker_pid) if worker_pid else 0.0
        n = max(1, r.requests)
        out.append(Sample(r.requests / r.elapsed if r.elapsed else 0.0, r.percentile(50) * 1e3,
                          r.percentile(99) * 1e3, (g1 - g0) / n * 1e6, (w1 - w0) / n * 1e6, r.requests,
                          r.errors, r.first_error))
    return out


def _median(samples: list[Sample], attr: str) -> float:
    return statistics.median(getattr(s, attr) for s in samples)


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=5.0, help="seconds per timed run")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per scenario (>= 2; the median is shown)")
    p.add_argument("--quick", action="store_true", help="concurrency 32 only, 2 s per run, 2 runs")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    p.add_argument("--processes", type=int, default=2, help="load generator processes")
    p.add_argument("--worker-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a [workers] setting for the synthetic worker, e.g. synthetic_step_ms=2")
    p.add_argument("--no-pin", action="store_true",
                   help="do not give the gateway a CPU of its own (see the module docstring)")
    a = p.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    pin = not a.no_pin and len(cpus) >= 2
    if pin:  # the harness (load generator, worker) on the other CPUs; the gateway gets cpus[0] below
        os.sched_setaffinity(0, cpus[1:])
    if a.repeats < 2:
        p.error("--repeats must be at least 2 (the table shows a median)")
    duration = 2.0 if a.quick else a.duration
    repeats = 2 if a.quick else a.repeats
    with tempfile.TemporaryDirectory() as state:
        gw, url = start_gateway(state, a.worker_option)
        try:
            kids = children(gw.pid)
            worker_pid = kids[0] if kids else None
            if pin:
                for tid in os.listdir(f"/proc/{gw.pid}/task"):  # every thread of the gateway
                    os.sched_setaffinity(int(tid), cpus[:1])
            print(f"gateway pid {gw.pid} at {url}; synthetic worker pid {worker_pid}; {os.cpu_count()} CPUs; "
                  f"{repeats} x {duration:g} s per scenario (medians); load average {_load()}")
            print(f"{'scenario':<30}{'req/s':>8}{'p50 ms':>9}{'p99 ms':>9}{'gw µs/req':>11}{'(min-max)':>12}"
                  f"{'wk µs/req':>11}{'x healthz':>10}{'errors':>8}  target")
            conc = [32] if a.quick else [32, 128]
            scenarios = [("GET /healthz (baseline)", "/healthz", False, c, None) for c in conc[:1]]
            scenarios += [(f"chat 16 tok, c={c}", "/v1/chat/completions", False, c, TARGET_UNARY_US) for c in conc]
            scenarios += [(f"chat stream 16 tok, c={c}", "/v1/chat/completions", True, c, TARGET_STREAM_US)
                          for c in conc]
            base = None
            failed = missed = False
            for name, path, stream, c, target in scenarios:
                samples = run_scenario(url, gw.pid, worker_pid, path=path, stream=stream, concurrency=c,
                                       duration=duration, processes=min(a.processes, c), repeats=repeats)
                if gw.poll() is not None:
                    raise RuntimeError(f"the gateway exited with {gw.returncode} during {name!r}")
                gw_us = _median(samples, "gw_us")
                base = base or gw_us
                errors = sum(s.errors for s in samples)
                verdict = ""
                if target is not None:
                    ok = gw_us <= target
                    missed |= not ok
                    verdict = f"{'MET' if ok else 'MISSED'} (<= {target:g})"
                spread = f"{min(s.gw_us for s in samples):.0f}-{max(s.gw_us for s in samples):.0f}"
                print(f"{name:<30}{_median(samples, 'rps'):>8.0f}{_median(samples, 'p50_ms'):>9.2f}"
                      f"{_median(samples, 'p99_ms'):>9.2f}{gw_us:>11.0f}{spread:>12}{_median(samples, 'wk_us'):>11.0f}"
                      f"{gw_us / base:>10.2f}{errors:>8}  {verdict}", flush=True)
                if errors or not all(s.requests for s in samples):
                    failed = True
                    print(f"  first error: {next((s.first_error for s in samples if s.first_error), 'no requests')}")
            print(f"load average after: {_load()}")
        finally:
            gw.terminate()
            gw.wait(30)
    return 1 if failed or (a.strict and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
