"""What mutual TLS on the worker transport costs the gateway: CPU per request, TLS against plain TCP.

Two ``quicserve serve --engine synthetic`` gateways in the same run, alike but for the
``[workers] transport_tls_*`` files (certificates made here; one leaf with both usages, as a
gateway and its local worker read the same keys): each scenario runs on one, then the other,
``--repeats`` times, interleaved, so drift on the machine falls on both alike. The gateway under
load is pinned to the first CPU, everything else to the rest (bench_gateway.py explains why);
its CPU is read from /proc around each run. Prints gateway µs per request for each, and the
ratio TLS / plain per scenario (target <= 1.1 for the 16-token stream and the whole answer),
then the two ratios at c=1, the hard case: the fewer requests in flight, the fewer frames each
TLS record carries, and at c=1 every engine step is a record of its own.

CPU time on a shared machine moves by 10-20% between equal runs, more than the margin that
matters here. So the verdict (exit status 1 on a miss) is the instruction count, where valgrind
is installed (``--no-callgrind``: CPU time only): both gateways run under callgrind (about 50x
slower; their workers natively), one connection, the engine's steps ``--step-ms`` apart, so
every step is one TLS record and one wake-up of the gateway, as with a real model (with 0 ms
steps, how many steps share a read depends on the machine's speed; under valgrind it would not be
the count natively). Each slice counts the gateway's user-space instructions exactly; what the
gateway spends idle in that time (timers, heartbeats, load reports: per second, not per request;
at the 600 requests a second of a native c=1 run it is next to nothing) is taken off at each
gateway's idle rate, the median of its idle slices (one per round). Taking each round's own idle
slice off its load slices, as this bench did at first, moved a round's figure by up to 5%: one
2-second slice's rate ranges 260-410k instructions a second; with the median the six rounds of a
run agree within 0.5%. The ratio leaves out what instructions do not show (cache misses, system
calls, which TLS does not add).

Figures (stream / whole answer, TLS/plain instructions at c=1; OpenSSL 3.0.19, CPython 3.11.7):
1.161 / 1.087 before the record path was trimmed; 1.121 / 1.061 with the memory-BIO session and a
small first read (TLS 1.3; last session, the per-round idle); 1.093 / 1.039 and 1.098 / 1.042 now
(two runs of this bench, 6 rounds: 1449.5k / 1584.5k and 1449.8k / 1592.6k instructions per stream),
with TLS 1.2 (transport/security.py: why) and a record's read in TlsChannel's own frame. In one run
of three gateways (plain, TLS before, TLS now; 6 rounds, median idle): before 1.125 / 1.069, now
1.099 / 1.051. Runs differ by about 0.5% (each gateway process its own hash seed and heap), rounds
within a run by less: the stream sits at 1.09-1.10, under the bar by a little.
At c=1 the TLS gateway reads one record per engine step (16.5 per 16-token stream, with the load
reports) at ~8.6k instructions each (6.0k in ``SSLObject.read``, of which 5.0k in OpenSSL's
SSL_read: tests/bench/tls_record_cost.py) and writes 1.3 (the Submit): that is the 135k. What is
left is OpenSSL's and CPython's: CPython's ssl sets SSL_MODE_RELEASE_BUFFERS, so OpenSSL frees and
allocates a record buffer for every record (~0.5k of a read, ~0.7k of a write); Python has no way
to clear it (through ctypes on the SSL_CTX, not done: 1.100 -> 1.091 per stream in one run).

    .venv/bin/python tests/bench/bench_transport_tls.py [--duration 4] [--repeats 5] [--concurrency 1 4 32]
        [--no-callgrind | --callgrind-only] [--rounds 6] [--step-ms 5]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from gateway.loadgen import LoadResult, run_processes  # noqa: E402
from tests.bench.bench_gateway import Sample, children, run_scenario, start_gateway  # noqa: E402
from tests.bench.bench_gateway_ab import Callgrind, callgrind_prefix  # noqa: E402
from tests.transport.certs import TestCA  # noqa: E402

TARGET = 1.1
SCENARIOS = (("whole answer", False), ("stream", True))


def pin(pid: int, cpus: list[int]) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass


def tls_options(tmp: str) -> list[str]:
    leaf = TestCA(Path(tmp) / "pki").issue("gateway-and-worker", "both")
    return [f"transport_tls_cert={leaf.cert}", f"transport_tls_key={leaf.key}", f"transport_tls_ca={leaf.ca}"]


def cpu_time(a: argparse.Namespace, tmp: str) -> dict[tuple[int, bool], float]:
    """The CPU-time table; returns the TLS/plain ratio per (concurrency, stream)."""
    cpus = sorted(os.sched_getaffinity(0))
    pinned = len(cpus) >= 2
    if pinned:
        os.sched_setaffinity(0, cpus[1:])
    gateways: dict[str, tuple[subprocess.Popen[str], str, int | None]] = {}
    ratios: dict[tuple[int, bool], float] = {}
    try:
        for name, opts in (("plain", []), ("tls", tls_options(tmp))):
            state = Path(tmp) / f"cpu-{name}"
            state.mkdir()
            proc, url = start_gateway(str(state), opts)
            kids = children(proc.pid)
            gateways[name] = (proc, url, kids[0] if kids else None)
            if pinned:
                pin(proc.pid, cpus[1:])
        print(f"{os.cpu_count()} CPUs; {a.repeats} x {a.duration:g} s per scenario and transport, interleaved; "
              f"gateway CPU per request (median, min-max)")
        print(f"{'scenario':<28}{'plain µs':>10}{'(min-max)':>12}{'TLS µs':>10}{'(min-max)':>12}{'TLS/plain':>11}"
              f"{'req/s plain':>13}{'req/s TLS':>11}  target")
        for c in a.concurrency:
            for label, stream in SCENARIOS:
                runs: dict[str, list[Sample]] = {"plain": [], "tls": []}
                for _ in range(a.repeats):
                    for name, (proc, url, worker) in gateways.items():
                        if pinned:
                            pin(proc.pid, cpus[:1])
                        runs[name] += run_scenario(url, proc.pid, worker, path="/v1/chat/completions",
                                                   stream=stream, concurrency=c, duration=a.duration,
                                                   processes=min(a.processes, c), repeats=1)
                        if pinned:
                            pin(proc.pid, cpus[1:])
                        if proc.poll() is not None:
                            raise RuntimeError(f"the {name} gateway exited with {proc.returncode}")
                errors = sum(s.errors for r in runs.values() for s in r)
                if errors:
                    raise RuntimeError(f"{errors} errors: {next(s.first_error for r in runs.values() for s in r)}")
                med = {n: statistics.median(s.gw_us for s in r) for n, r in runs.items()}
                rps = {n: statistics.median(s.rps for s in r) for n, r in runs.items()}
                spread = {n: f"{min(s.gw_us for s in r):.0f}-{max(s.gw_us for s in r):.0f}" for n, r in runs.items()}
                ratio = ratios[c, stream] = med["tls"] / med["plain"]
                print(f"{f'{label} 16 tok, c={c}':<28}{med['plain']:>10.0f}{spread['plain']:>12}{med['tls']:>10.0f}"
                      f"{spread['tls']:>12}{ratio:>11.3f}{rps['plain']:>13.0f}{rps['tls']:>11.0f}  "
                      f"{'MET' if ratio <= TARGET else 'MISSED'} (<= {TARGET})", flush=True)
    finally:
        for proc, _, _ in gateways.values():
            proc.terminate()
            proc.wait(30)
    return ratios


def _one_connection(url: str, stream: bool, duration: float) -> LoadResult:
    return run_processes(argparse.Namespace(url=url, concurrency=1, duration=duration, stream=stream, max_tokens=16,
                                            path="/v1/chat/completions", model="tiny", processes=1, api_key=""))


def _count(pid: int, out: str, url: str, stream: bool | None, duration: float) -> tuple[float, float, int]:
    """(instructions, seconds, requests) of one slice; ``stream`` None: an idle slice, no load."""
    meter = Callgrind(pid, out)
    t0 = time.monotonic()
    requests = 0
    if stream is None:
        time.sleep(duration)
    else:
        r = _one_connection(url, stream, duration)
        if r.errors or not r.requests:
            raise RuntimeError(f"errors: {r.first_error or 'no requests'}")
        requests = r.requests
    counted = meter.stop()["Ir"]
    if counted is None:
        raise RuntimeError("callgrind counted nothing")
    return counted, time.monotonic() - t0, requests


def instructions(a: argparse.Namespace, tmp: str) -> dict[bool, float]:
    """The callgrind table (module docstring); returns the TLS/plain ratio per scenario (stream or not)."""
    step = [f"synthetic_step_ms={a.step_ms:g}"]
    slices: dict[tuple[str, bool], list[tuple[float, float, int]]] = {}  # (instructions, seconds, requests)
    idle: dict[str, list[float]] = {}  # instructions per second, one idle slice per round
    with contextlib.ExitStack() as stack:
        gws: dict[str, tuple[int, str, str]] = {}
        for name, opts in (("plain", step), ("tls", step + tls_options(tmp))):
            state = Path(tmp) / f"cg-{name}"
            state.mkdir()
            out = str(state / "callgrind.out")
            proc, url = start_gateway(str(state), opts, prefix=callgrind_prefix(out))
            stack.callback(proc.wait, 60)
            stack.callback(proc.terminate)
            gws[name] = (proc.pid, url, out)
        for _, url, _ in gws.values():  # warm-up: every scenario once on each
            for _, stream in SCENARIOS:
                _one_connection(url, stream, 1.0)
        print(f"instructions per request at c=1 (callgrind; engine steps {a.step_ms:g} ms apart: one TLS record "
              f"each), {a.rounds} round(s) of {a.duration:g} s slices, each gateway's idle rate (the median of "
              f"its idle slices) taken off")
        for r in range(a.rounds):
            for name in (["plain", "tls"] if r % 2 == 0 else ["tls", "plain"]):
                pid, url, out = gws[name]
                ir, secs, _ = _count(pid, out, url, None, a.idle)
                idle.setdefault(name, []).append(ir / secs)
                for _, stream in SCENARIOS:
                    ir, secs, n = _count(pid, out, url, stream, a.duration)
                    slices.setdefault((name, stream), []).append((ir, secs, n))
                    print(f"  round {r + 1} {name:<5} {'stream' if stream else 'whole':<6} {n:>4} requests, "
                          f"{ir / n / 1e3:8.1f}k per request, idle {idle[name][-1] / 1e3:6.1f}k/s", flush=True)
    rate = {name: statistics.median(rates) for name, rates in idle.items()}
    print("idle k/s: " + "; ".join(f"{name} {' '.join(f'{v / 1e3:.0f}' for v in rates)} (median {rate[name] / 1e3:.0f})"
                                   for name, rates in idle.items()))
    print(f"{'scenario':<28}{'plain Ir':>12}{'TLS Ir':>12}{'TLS/plain':>11}  target   (per round: plain, TLS)")
    ratios: dict[bool, float] = {}
    for label, stream in SCENARIOS:
        per_request = {name: [(ir - rate[name] * secs) / n for ir, secs, n in slices[name, stream]]
                       for name in ("plain", "tls")}
        p, t = (statistics.median(per_request[n]) for n in ("plain", "tls"))
        ratio = ratios[stream] = t / p
        rounds = ", ".join(f"{pl / 1e3:.0f}k {tl / 1e3:.0f}k"
                           for pl, tl in zip(per_request["plain"], per_request["tls"], strict=True))
        print(f"{f'{label} 16 tok, c=1':<28}{p / 1e3:>11.1f}k{t / 1e3:>11.1f}k{ratio:>11.3f}  "
              f"{'MET' if ratio <= TARGET else 'MISSED'} (<= {TARGET})   ({rounds})")
    return ratios


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=4.0, help="seconds per timed run or counted slice")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per scenario and transport (median shown)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 32])
    p.add_argument("--processes", type=int, default=2, help="load generator processes")
    p.add_argument("--no-callgrind", action="store_true", help="CPU time only (the verdict is then CPU time's)")
    p.add_argument("--callgrind-only", action="store_true", help="instructions only")
    p.add_argument("--rounds", type=int, default=6, help="callgrind: counted rounds (median shown)")
    p.add_argument("--step-ms", type=float, default=5.0, help="callgrind: engine step time of both workers")
    p.add_argument("--idle", type=float, default=2.0, help="callgrind: seconds of the idle slice per round")
    a = p.parse_args()
    counting = not a.no_callgrind and shutil.which("valgrind") is not None and shutil.which("callgrind_control")
    with tempfile.TemporaryDirectory() as tmp:
        cpu = {} if a.callgrind_only else cpu_time(a, tmp)
        counted = instructions(a, tmp) if counting else {}
    for label, stream in SCENARIOS:
        figures = [f"CPU time {cpu[1, stream]:.3f}" if (1, stream) in cpu else "",
                   f"instructions {counted[stream]:.3f}" if stream in counted else ""]
        print(f"c=1 {label}: TLS/plain " + ", ".join(f for f in figures if f))
    verdict = counted or {stream: cpu[1, stream] for _, stream in SCENARIOS if (1, stream) in cpu}
    if not counting and not a.no_callgrind:
        print("(valgrind not installed: the verdict is CPU time's)")
    missed = [label for label, stream in SCENARIOS if verdict.get(stream, 0.0) > TARGET]
    if missed:
        print(f"MISSED at c=1 (<= {TARGET}): {', '.join(missed)}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
