"""When requests are sent: open-loop arrival times (Poisson, gamma, a trace) as plain numbers.

An open loop sends each request at its arrival time whether or not earlier ones have
answered, as users do; a closed loop (``--concurrency`` without a rate) has a fixed number
of clients that each send the next request when the last one ends. These functions only
compute times (seconds from the start of a run); :mod:`gateway.bench.runner` waits for them.

Gamma inter-arrival times with shape ``burstiness`` and mean ``1 / rate`` are the
definition of ``vllm bench serve``: burstiness 1 is a Poisson process, below 1 burstier,
above 1 more regular.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

__all__ = ["arrival_times", "TraceEntry", "load_trace", "parse_rates"]


def arrival_times(rate: float, *, burstiness: float = 1.0, seed: int = 0) -> Iterator[float]:
    """Arrival times of a gamma renewal process of ``rate`` requests/s (inf: all at time 0)."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be positive")
    if math.isinf(rate):
        while True:
            yield 0.0
    rng = np.random.default_rng(seed)
    scale = 1.0 / (rate * burstiness)
    t = 0.0
    while True:
        for gap in rng.gamma(burstiness, scale, size=1024).tolist():
            t += gap
            yield t


@dataclass(frozen=True, slots=True)
class TraceEntry:
    """One arrival of a trace file: when (seconds from its first entry) and, if it says, lengths."""

    at: float
    input_len: int | None = None
    output_len: int | None = None


def load_trace(path: str | Path, *, time_unit: float = 1.0) -> list[TraceEntry]:
    """Read a JSON-lines trace: one object per line with ``timestamp`` (in ``time_unit`` seconds:
    1 for seconds, 0.001 for milliseconds, as Mooncake's traces use) and, optionally,
    ``input_length`` and ``output_length``. Times are made relative to the first arrival."""
    entries: list[TraceEntry] = []
    for n, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = orjson.loads(line)
            at = float(d["timestamp"]) * time_unit
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}:{n}: not a trace entry with a numeric timestamp ({e})") from None
        entries.append(TraceEntry(at, _opt_int(d.get("input_length")), _opt_int(d.get("output_length"))))
    if not entries:
        raise ValueError(f"{path}: no trace entries")
    entries.sort(key=lambda e: e.at)
    t0 = entries[0].at
    return [TraceEntry(e.at - t0, e.input_len, e.output_len) for e in entries]


def _opt_int(v: object) -> int | None:
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def parse_rates(text: str) -> list[float]:
    """``"inf"``, ``"10"`` or a sweep ``"5,10,20"`` (requests/s) as numbers."""
    rates = [float(x) for x in text.split(",") if x.strip()]
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"request rates must be positive numbers or inf: {text!r}")
    return rates

