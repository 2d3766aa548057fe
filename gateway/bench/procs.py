"""Several client processes (``--processes N``) when one core cannot keep up.

Each child is ``quicserve bench`` itself with a share of the load: the rate divided by N
(N Poisson processes of rate r/N make one of rate r), the concurrency, request count and
in-flight guard split, its own seed. All start at the same Unix time the parent picks (after
they have built their requests), write their runs to a file, and the parent merges the records
of each run and computes the figures once over all of them. The client's CPU is the sum.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import orjson

from .records import Record
from .runner import SATURATED_CPU
from .stats import parse_slos, summarize

__all__ = ["run_processes", "split"]

_START_DELAY = 3.0  # seconds for the children to start Python and build their requests


def split(total: int, n: int) -> list[int]:
    """``total`` in ``n`` shares as even as whole numbers allow."""
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


def _child_argv(a: argparse.Namespace, argv: list[str], i: int, out: str, start_at: float) -> list[str]:
    n = a.processes
    extra = ["--processes", "1", "--raw-out", out, "--start-at", repr(start_at), "--seed", str(a.seed + i),
             "--progress", "off", "--url", a.url]
    if a.request_rate:
        extra += ["--request-rate", ",".join(repr(float(r) / n) for r in a.request_rate.split(","))]
    for flag, value in (("--concurrency", a.concurrency), ("--num-requests", a.num_requests),
                        ("--max-concurrency", a.max_concurrency)):
        if value:
            extra += [flag, str(max(1, split(value, n)[i]))]
    return [sys.executable, "-m", "gateway.bench", *argv, *extra]


def run_processes(a: argparse.Namespace, argv: list[str]) -> list[dict[str, Any]]:
    if a.trace:
        raise ValueError("--trace runs in one process (its arrivals are one sequence)")
    start_at = time.time() + _START_DELAY
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"{i}.json") for i in range(a.processes)]
        procs = [subprocess.Popen(_child_argv(a, argv, i, out, start_at)) for i, out in enumerate(outs)]
        for p in procs:
            if p.wait() != 0:
                raise ValueError(f"a client process failed with status {p.returncode}")
        children = [orjson.loads(open(out, "rb").read())["runs"] for out in outs]
    late = [c[0]["started_unix"] - start_at for c in children if c]
    slos = parse_slos(a.goodput)
    merged = []
    for k, first in enumerate(children[0]):
        runs = [c[k] for c in children]
        records = [Record.from_json(d) for run in runs for d in run["records"]]
        records.sort(key=lambda r: r.start)
        for j, r in enumerate(records):
            r.index = j
        cpu = [run["client"] for run in runs]
        client = {"processes": len(runs), "wall_s": max(c["wall_s"] for c in cpu),
                  "cpu_user_s": sum(c["cpu_user_s"] for c in cpu), "cpu_sys_s": sum(c["cpu_sys_s"] for c in cpu),
                  "cpu_fraction_of_one_core": max(c["cpu_fraction_of_one_core"] for c in cpu),
                  "cpu_fraction_each": [c["cpu_fraction_of_one_core"] for c in cpu],
                  "saturated": any(c["cpu_fraction_of_one_core"] >= SATURATED_CPU for c in cpu),
                  "send_lag_p99_ms": max(c["send_lag_p99_ms"] for c in cpu),
                  "max_in_flight": sum(c["max_in_flight"] for c in cpu),
                  "start_skew_ms": (max(late) - min(late)) * 1e3 if late else 0.0,
                  "notes": sorted({note for c in cpu for note in c["notes"]})}
        merged.append({**first, "rate": _total_rate(first["rate"], len(runs)),
                       "concurrency": a.concurrency, "max_concurrency": a.max_concurrency,
                       "label": _label(first["label"], a, k),
                       "summary": summarize(records, warmup=a.warmup, slos=slos), "client": client,
                       "records": [r.to_json() for r in records]})
    return merged


def _total_rate(rate: object, n: int) -> object:
    return rate * n if isinstance(rate, float | int) else rate


def _label(label: str, a: argparse.Namespace, k: int) -> str:
    if a.request_rate:
        return f"rate {float(a.request_rate.split(',')[k]):g}/s"
    return f"concurrency {a.concurrency}" if a.concurrency else label
