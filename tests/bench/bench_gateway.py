"""Gateway benchmark: loopback load against `quicserve serve --engine synthetic`.

Starts a real gateway process (and its synthetic worker child), then for each
scenario runs the load generator (``gateway.loadgen``, its own processes) for
a fixed time and reads the gateway's CPU time from /proc/<pid>/stat before and
after. Prints req/s, p50/p99 latency, gateway CPU µs per request, the worker's
CPU µs per request for context, and the ratio to a same-run baseline
(``GET /healthz``: the HTTP stack alone).

    .venv/bin/python tests/bench/bench_gateway.py [--duration 5] [--quick]

Targets (same machine): <= 100 µs gateway CPU per non-streaming request,
<= 250 µs per 16-token stream.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from gateway.loadgen import LoadResult, run_processes  # noqa: E402

TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (not its children)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / TCK


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(x) for x in text]
    return out


def start_gateway(state: str, worker_args: list[str]) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--engine", "synthetic", "--port", "0", "--no-tls",
           "--progress", "off", "--log-level", "warning", "--state-dir", state]
    cmd += [f"--worker-arg={a}" for a in worker_args]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
    url = ""
    deadline = time.monotonic() + 120
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
    raise RuntimeError("gateway not ready in 120 s")


def run_scenario(url: str, gw_pid: int, worker_pid: int | None, *, path: str, stream: bool, concurrency: int,
                 duration: float, processes: int) -> tuple[LoadResult, float, float]:
    args = argparse.Namespace(url=url, concurrency=concurrency, duration=duration, stream=stream, max_tokens=16,
                              path=path, model="tiny", processes=processes)
    warm = argparse.Namespace(**{**vars(args), "duration": min(1.0, duration)})
    run_processes(warm)
    g0 = cpu_seconds(gw_pid)
    w0 = cpu_seconds(worker_pid) if worker_pid else 0.0
    r = run_processes(args)
    g1 = cpu_seconds(gw_pid)
    w1 = cpu_seconds(worker_pid) if worker_pid else 0.0
    n = max(1, r.requests)
    return r, (g1 - g0) / n * 1e6, (w1 - w0) / n * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--quick", action="store_true", help="concurrency 32 only, 2 s per scenario")
    p.add_argument("--processes", type=int, default=2, help="load generator processes")
    p.add_argument("--worker-arg", action="append", default=[], help="extra args for the synthetic worker")
    a = p.parse_args()
    duration = 2.0 if a.quick else a.duration
    with tempfile.TemporaryDirectory() as state:
        gw, url = start_gateway(state, a.worker_arg)
        try:
            kids = children(gw.pid)
            worker_pid = kids[0] if kids else None
            print(f"gateway pid {gw.pid} at {url}; synthetic worker pid {worker_pid}; {duration:g} s per scenario")
            print(f"{'scenario':<34}{'req/s':>8}{'p50 ms':>9}{'p99 ms':>9}{'gw µs/req':>11}{'wk µs/req':>11}"
                  f"{'x healthz':>10}{'errors':>8}")
            conc = [32] if a.quick else [32, 128]
            scenarios = [("GET /healthz (baseline)", "/healthz", False, c) for c in conc[:1]]
            scenarios += [(f"chat 16 tok, c={c}", "/v1/chat/completions", False, c) for c in conc]
            scenarios += [(f"chat stream 16 tok, c={c}", "/v1/chat/completions", True, c) for c in conc]
            base = None
            failed = False
            for name, path, stream, c in scenarios:
                r, gw_us, wk_us = run_scenario(url, gw.pid, worker_pid, path=path, stream=stream, concurrency=c,
                                               duration=duration, processes=min(a.processes, c))
                base = base or gw_us
                print(f"{name:<34}{r.requests / r.elapsed:>8.0f}{r.percentile(50) * 1e3:>9.2f}"
                      f"{r.percentile(99) * 1e3:>9.2f}{gw_us:>11.0f}{wk_us:>11.0f}{gw_us / base:>10.2f}"
                      f"{r.errors:>8}")
                if r.errors:
                    failed = True
                    print(f"  first error: {r.first_error}")
        finally:
            gw.terminate()
            gw.wait(30)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
