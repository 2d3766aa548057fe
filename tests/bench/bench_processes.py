"""Gateway processes (``[server] processes``, #33): requests/s against N on this host, and the
gateway's instructions per request with N = 2 against N = 1 (callgrind).

    .venv/bin/python -m tests.bench.bench_processes [--processes 1,2,4] [--duration 5] [--concurrency 64]
    .venv/bin/python -m tests.bench.bench_processes --callgrind [--duration 20]

Requests/s: ``quicserve serve --engine synthetic --processes N`` (``--workers`` synthetic workers, no
step delay, so the gateway is what is measured until the workers saturate), loaded by this tree's
load generator (``gateway.loadgen``: non-streaming chat completions of 16 tokens at
``--concurrency`` keep-alive connections, spread over the processes by SO_REUSEPORT) for
``--duration`` seconds per N, N in the order given; the ratio to the first N is printed. Scaling is
bounded by the cores: on a 2-core host the load generator and the worker share them with the
gateway, so the figure that matters there is the second one.

``--callgrind``: the gateway (the one process, or the supervisor and its gateway processes; their
worker and local redis-server run natively) under valgrind's callgrind, counting nothing until
the load starts; one keep-alive connection (c=1: one request per loop iteration, exact to about
1 %) sends chat completions (whole, then 16-token streams) for ``--duration`` seconds; the figure
is the user-space instructions of every gateway process together per request, N = 2 against
N = 1. The processes' own timers (the metrics snapshot each writes every second, the cycle
sweeper) run at wall-clock rate while valgrind slows requests about 50x, so they weigh about 50
times more per request here than natively; the table gives the figure with them, and "net": less
what the same processes count idle over as long (measured just before).

Last measured (2-core VM shared with other jobs, load average ~17)::

    --callgrind --duration 15: instructions per request, every gateway process together
      N=1 chat 16 tok      637 requests     342,856            net   332,726
      N=1 stream 16 tok    553 requests   1,280,549            net 1,268,849
      N=2 chat 16 tok      993 requests     345,839 (1.009x)   net   331,684 (0.997x)
      N=2 stream 16 tok    377 requests   1,228,022 (0.959x)   net 1,190,526 (0.938x)
    (before the snapshots were written only while /metrics is read, N=2 was 3.6x raw: each
    process rendered its exposition every second, 10M instructions under valgrind)

    --processes 1,2,1,2 --duration 5 (c=64; the load generator and the worker on the same 2 CPUs):
      N=1 630, N=2 613, N=1 980, N=2 972 requests/s -- alike: two cores hold no room for a second
      gateway process here; run it where the gateway can have cores of its own.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from gateway.loadgen import run_processes

REPO = Path(__file__).resolve().parents[2]


def start(state: str, n: int, workers: int, prefix: list[str] | None = None) -> tuple[subprocess.Popen[str], str, list[int]]:
    """A gateway of ``n`` processes: (supervisor, URL, the pids that serve requests)."""
    cmd = [*(prefix or []), sys.executable, "-m", "gateway.cli", "serve", "--engine", "synthetic", "--port", "0",
           "--no-tls", "--grpc-port", "-1", "--progress", "off", "--log-level", "warning", "--state-dir", state,
           "--processes", str(n), "--workers", str(workers)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "QUICSERVE_SHUTDOWN__GRACE_PERIOD": "0"})
    assert proc.stdout is not None
    url, pids = "", []
    deadline = time.monotonic() + (900 if prefix else 120)
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"gateway exited with {proc.wait()}")
        if m := re.search(r"listening on (http://\S+)", line):
            url = m.group(1)
        if m := re.search(r"gateway process \d+ started \(pid (\d+)\)", line):
            pids.append(int(m.group(1)))
        if line.startswith("quicserve: ready"):
            return proc, url, pids or [proc.pid]
    raise RuntimeError("gateway not ready in time")


def load(url: str, concurrency: int, duration: float, stream: bool) -> tuple[int, float]:
    args = argparse.Namespace(url=url, concurrency=concurrency, duration=duration, stream=stream, max_tokens=16,
                              path="/v1/chat/completions", model="tiny", processes=min(4, concurrency), api_key="")
    t0 = time.perf_counter()
    r = run_processes(args)
    if r.errors or not r.requests:
        raise RuntimeError(f"errors: {r.first_error or 'no requests'}")
    return r.requests, time.perf_counter() - t0


def requests_per_second(a: argparse.Namespace) -> None:
    counts = [int(x) for x in a.processes.split(",")]
    first = 0.0
    print(f"host: {os.cpu_count()} CPUs; {a.workers} synthetic worker(s); c={a.concurrency}; {a.duration:g} s per N")
    for n in counts:
        with tempfile.TemporaryDirectory() as state:
            proc, url, _ = start(state, n, a.workers)
            try:
                load(url, a.concurrency, 1.0, False)  # warm-up
                done, took = load(url, a.concurrency, a.duration, False)
            finally:
                proc.terminate()
                proc.wait(60)
        rps = done / took
        first = first or rps
        print(f"  N={n:<3d} {rps:8.0f} requests/s  {rps / first:5.2f}x")


def _instructions(out_dir: Path, pid: int) -> float:
    """Instructions counted in ``pid``'s last dump."""
    dumps = sorted(out_dir.glob(f"cg.{pid}.*"), key=lambda f: int(f.suffix[1:]))
    return float(next(line.split()[1] for line in dumps[-1].read_text().splitlines() if line.startswith("totals:")))


def _counted(out: Path, pids: list[int], run: Callable[[], int]) -> tuple[int, float, float]:
    """(requests, instructions of every process, seconds) over ``run()``, counted by callgrind."""
    for pid in pids:
        subprocess.run(["callgrind_control", "-i", "on", str(pid)], check=True, capture_output=True)
    t0 = time.perf_counter()
    done = run()
    took = time.perf_counter() - t0
    for pid in pids:
        subprocess.run(["callgrind_control", "-i", "off", str(pid)], check=True, capture_output=True)
        subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
    return done, sum(_instructions(out, pid) for pid in pids), took


def callgrind(a: argparse.Namespace) -> None:
    rows = []
    for n in (1, 2):
        with tempfile.TemporaryDirectory() as state:
            out = Path(state)
            prefix = ["valgrind", "-q", "--tool=callgrind", "--instr-atstart=no", "--trace-children=yes",
                      "--trace-children-skip=*redis-server*", "--trace-children-skip-by-arg=worker",
                      f"--callgrind-out-file={out}/cg.%p"]
            proc, url, pids = start(state, n, 1, prefix)
            try:
                load(url, 1, 2.0, False)  # warm-up, uncounted
                _, idle, idle_s = _counted(out, pids, lambda: (time.sleep(a.duration), 0)[1])
                for stream in (False, True):
                    done, total, took = _counted(out, pids, lambda s=stream, u=url: load(u, 1, a.duration, s)[0])
                    rows.append((n, "stream 16 tok" if stream else "chat 16 tok", done, total / done,
                                 (total - idle / idle_s * took) / done))
            finally:
                proc.terminate()
                proc.wait(120)
    print("user-space instructions per request, every gateway process together (c=1, callgrind); 'net': less what")
    print("the same processes spent idle (timers) over as long")
    base = {kind: (ir, net) for n, kind, _, ir, net in rows if n == 1}
    for n, kind, done, ir, net in rows:
        print(f"  N={n} {kind:14s} {done:5d} requests  {ir:12,.0f} ({ir / base[kind][0]:.3f}x)  "
              f"net {net:12,.0f} ({net / base[kind][1]:.3f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", default="1,2", help="the Ns to run, in order (default 1,2)")
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--callgrind", action="store_true", help="instructions per request, N = 2 against N = 1")
    a = ap.parse_args()
    callgrind(a) if a.callgrind else requests_per_second(a)


if __name__ == "__main__":
    main()
