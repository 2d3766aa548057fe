"""A run's figures from its records, with the definitions of ``vllm bench serve``.

Latencies are in milliseconds: mean, median, p90, p95, p99 (numpy's linear interpolation)
and std of TTFT, TPOT, ITL (every gap of every request, pooled) and E2E. Throughputs divide by
the measured window: from the end of the warm-up to the end of the last measured request.
Goodput counts the successful requests that met every SLO given (``ttft``, ``tpot``, ``e2e``,
``itl``, in ms; ``itl`` holds when a request's p99 gap does), per second of the window.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from .records import Record

__all__ = ["summarize", "latency_stats", "parse_slos", "PERCENTILES", "METRICS", "metric_values"]

PERCENTILES = (90, 95, 99)
METRICS = ("ttft", "tpot", "itl", "e2e")
_SLO_KEYS = ("ttft", "tpot", "itl", "e2e")


def latency_stats(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean, median, p90/p95/p99 and std of values in seconds, as milliseconds (None: no values)."""
    if not len(values_s):
        return {k: None for k in ("mean", "median", *(f"p{p}" for p in PERCENTILES), "std")} | {"count": 0}
    a = np.asarray(values_s, dtype=np.float64) * 1e3
    pct = np.percentile(a, [50, *PERCENTILES])
    out: dict[str, float | None] = {"mean": float(a.mean()), "median": float(pct[0])}
    out |= {f"p{p}": float(v) for p, v in zip(PERCENTILES, pct[1:], strict=True)}
    return out | {"std": float(a.std()), "count": len(a)}


def metric_values(records: Iterable[Record], metric: str) -> list[float]:
    """A metric's values in seconds over the successful records (ITL: every gap)."""
    out: list[float] = []
    for r in records:
        if r.error:
            continue
        if metric == "itl":
            out += r.itl
        elif metric == "ttft":
            if r.ttft is not None:
                out.append(r.ttft)
        elif metric == "tpot":
            if (v := r.tpot) is not None:
                out.append(v)
        elif metric == "e2e":
            out.append(r.e2e)
        else:
            raise ValueError(f"unknown metric {metric!r}")
    return out


def parse_slos(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 0.5, "tpot": 0.05}`` (given in ms, kept in s)."""
    slos: dict[str, float] = {}
    for item in items:
        for part in item.split():
            key, _, value = part.partition(":")
            key = "e2e" if key == "e2el" else key
            if key not in _SLO_KEYS or not value:
                raise ValueError(f"a goodput SLO is KEY:MS with KEY one of {', '.join(_SLO_KEYS)}: {part!r}")
            slos[key] = float(value) / 1e3
    return slos


def _meets(r: Record, slos: dict[str, float]) -> bool:
    for key, limit in slos.items():
        if key == "itl":
            v: float | None = float(np.percentile(r.itl, 99)) if r.itl else 0.0
        elif key == "ttft":
            v = r.ttft
        elif key == "tpot":
            v = r.tpot if r.tpot is not None else 0.0
        else:
            v = r.e2e
        if v is None or v > limit:
            return False
    return True


def summarize(records: Sequence[Record], *, warmup: float = 0.0, slos: dict[str, float] | None = None) -> dict[str, object]:
    """The figures of the measured (not warm-up) records."""
    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if not r.error]
    t0 = min((r.start for r in measured), default=warmup)
    t1 = max((r.end for r in measured), default=t0)
    window = max(t1 - max(t0, warmup) if measured else 0.0, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    s: dict[str, object] = {
        "requests": len(measured), "completed": len(ok), "failed": len(measured) - len(ok),
        "errors": dict(Counter(r.error for r in measured if r.error)),
        "duration_s": window, "input_tokens": in_tokens, "output_tokens": out_tokens,
        "request_throughput": len(ok) / window, "output_throughput": out_tokens / window,
        "total_token_throughput": (in_tokens + out_tokens) / window,
        "short_outputs": sum(1 for r in ok if r.expected_output and r.output_tokens < r.expected_output),
    }
    for m in METRICS:
        s[f"{m}_ms"] = latency_stats(metric_values(ok, m))
    if slos:
        good = sum(1 for r in ok if _meets(r, slos))
        s["goodput"] = {"slos_ms": {k: v * 1e3 for k, v in slos.items()}, "requests": good,
                        "request_goodput": good / window, "fraction": good / len(measured) if measured else 0.0}
    return s
