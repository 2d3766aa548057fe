"""What mutual TLS on the worker transport costs the gateway: CPU per request, TLS against plain TCP.

Two ``quicserve serve --engine synthetic`` gateways in the same run, alike but for the
``[workers] transport_tls_*`` files (certificates made here; one leaf with both usages, as a
gateway and its local worker read the same keys): each scenario runs on one, then the other,
``--repeats`` times, interleaved, so drift on the machine falls on both alike. The gateway under
load is pinned to the first CPU, everything else to the rest (bench_gateway.py explains why);
its CPU is read from /proc around each run. Prints gateway µs per request for each, and the
ratio TLS / plain per scenario (target <= 1.1 for the 16-token stream and the whole answer).
The fewer requests in flight, the fewer each TLS record carries: at c=1 every engine step is a
record of its own, decrypted with cold caches after the gateway slept (~10 us each measured in
the transport alone), so c=1 is the hard case.

    .venv/bin/python tests/bench/bench_transport_tls.py [--duration 4] [--repeats 5] [--concurrency 32 4 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.bench.bench_gateway import Sample, children, run_scenario, start_gateway  # noqa: E402
from tests.transport.certs import TestCA  # noqa: E402

TARGET = 1.1


def pin(pid: int, cpus: list[int]) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=4.0, help="seconds per timed run")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per scenario and transport (median shown)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[32, 4, 1])
    p.add_argument("--processes", type=int, default=2, help="load generator processes")
    a = p.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    pinned = len(cpus) >= 2
    if pinned:
        os.sched_setaffinity(0, cpus[1:])
    with tempfile.TemporaryDirectory() as tmp:
        leaf = TestCA(Path(tmp) / "pki").issue("gateway-and-worker", "both")
        tls_opts = [f"transport_tls_cert={leaf.cert}", f"transport_tls_key={leaf.key}", f"transport_tls_ca={leaf.ca}"]
        gateways: dict[str, tuple[subprocess.Popen[str], str, int | None]] = {}
        try:
            for name, opts in (("plain", []), ("tls", tls_opts)):
                state = Path(tmp) / name
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
            failed = missed = False
            for c in a.concurrency:
                for label, stream in (("whole answer", False), ("stream", True)):
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
                    med = {n: statistics.median(s.gw_us for s in r) for n, r in runs.items()}
                    rps = {n: statistics.median(s.rps for s in r) for n, r in runs.items()}
                    spread = {n: f"{min(s.gw_us for s in r):.0f}-{max(s.gw_us for s in r):.0f}" for n, r in runs.items()}
                    ratio = med["tls"] / med["plain"]
                    ok = ratio <= TARGET
                    missed |= not ok
                    errors = sum(s.errors for r in runs.values() for s in r)
                    failed |= errors > 0
                    print(f"{f'{label} 16 tok, c={c}':<28}{med['plain']:>10.0f}{spread['plain']:>12}{med['tls']:>10.0f}"
                          f"{spread['tls']:>12}{ratio:>11.3f}{rps['plain']:>13.0f}{rps['tls']:>11.0f}  "
                          f"{'MET' if ok else 'MISSED'} (<= {TARGET}){f'  errors: {errors}' if errors else ''}",
                          flush=True)
        finally:
            for proc, _, _ in gateways.values():
                proc.terminate()
                proc.wait(30)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
