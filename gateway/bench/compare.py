"""``quicserve bench compare A.json B.json``: two results side by side.

Runs are paired by position when both files hold as many (a sweep against a sweep),
else each file's runs are pooled (latencies only: pooled runs of different loads have no
throughput to compare). For each metric the medians of A and B, each with a
bootstrap confidence interval, and B - A with its own (percentile bootstrap: the requests
of each side resampled with replacement, the medians' difference taken each time). An
interval of the difference that leaves out 0 is marked ``*``: the medians differ beyond
what resampling the same requests moves them. Throughputs are single figures, without one.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .records import Record
from .results import load_result, run_records
from .stats import METRICS, metric_values

__all__ = ["compare_main", "bootstrap_median_ci", "compare_rows"]

_CHUNK = 4_000_000  # resampled values drawn at once (memory bound)


def _medians(x: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    n = len(x)
    per = max(1, _CHUNK // n)
    out = []
    for k in range(0, resamples, per):
        idx = rng.integers(0, n, size=(min(per, resamples - k), n))
        out.append(np.median(x[idx], axis=1))
    return np.concatenate(out)


def bootstrap_median_ci(a: Sequence[float], b: Sequence[float], *, confidence: float = 0.95,
                        resamples: int = 2000, seed: int = 0) -> dict[str, float]:
    """Medians of ``a`` and ``b``, B - A, and percentile-bootstrap intervals of each."""
    rng = np.random.default_rng(seed)
    xa, xb = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    ma, mb = _medians(xa, resamples, rng), _medians(xb, resamples, rng)
    q = [(1 - confidence) / 2 * 100, (1 + confidence) / 2 * 100]
    (alo, ahi), (blo, bhi), (dlo, dhi) = (np.percentile(v, q) for v in (ma, mb, mb - ma))
    med_a, med_b = float(np.median(xa)), float(np.median(xb))
    return {"a": med_a, "a_lo": float(alo), "a_hi": float(ahi), "b": med_b, "b_lo": float(blo), "b_hi": float(bhi),
            "diff": med_b - med_a, "diff_lo": float(dlo), "diff_hi": float(dhi),
            "ratio": med_b / med_a if med_a else float("nan")}


_Pair = tuple[str, list[Record], list[Record], dict[str, Any] | None, dict[str, Any] | None]


def _pairs(a: dict[str, Any], b: dict[str, Any]) -> list[_Pair]:
    def ok(run: dict[str, Any]) -> list[Record]:
        return [r for r in run_records(run) if not r.warmup]

    ra, rb = a["runs"], b["runs"]
    if len(ra) == len(rb):
        return [(f"{x['label']} | {y['label']}" if x["label"] != y["label"] else x["label"], ok(x), ok(y),
                 x["summary"], y["summary"]) for x, y in zip(ra, rb, strict=True)]
    pool_a = [r for run in ra for r in ok(run)]
    pool_b = [r for run in rb for r in ok(run)]
    return [("all runs", pool_a, pool_b, None, None)]  # runs of different loads: no throughput to set side by side


def compare_rows(a: dict[str, Any], b: dict[str, Any], *, confidence: float = 0.95, resamples: int = 2000,
                 seed: int = 0) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for label, rec_a, rec_b, sa, sb in _pairs(a, b):
        for m in METRICS:
            va, vb = metric_values(rec_a, m), metric_values(rec_b, m)
            if not va or not vb:
                continue
            ci = bootstrap_median_ci([v * 1e3 for v in va], [v * 1e3 for v in vb], confidence=confidence,
                                     resamples=resamples, seed=seed)
            rows.append({"run": label, "metric": f"median {m.upper()} (ms)", **ci,
                         "significant": ci["diff_lo"] > 0 or ci["diff_hi"] < 0})
        for key, name in (("request_throughput", "requests/s"), ("output_throughput", "output tokens/s")):
            if sa is None or sb is None:
                break
            x, y = float(sa[key]), float(sb[key])
            rows.append({"run": label, "metric": name, "a": x, "b": y, "diff": y - x,
                         "ratio": y / x if x else float("nan")})
    return rows


def _fmt(v: float | None) -> str:
    return "" if v is None else f"{v:,.2f}"


def _ci(row: dict[str, Any], key: str) -> str:
    return f"[{_fmt(row[key + '_lo'])}, {_fmt(row[key + '_hi'])}]" if key + "_lo" in row else ""


def format_rows(rows: list[dict[str, Any]], name_a: str, name_b: str, confidence: float) -> str:
    pct = f"{confidence:.0%}"
    head = ["run", "metric", f"A: {name_a}", f"{pct} CI", f"B: {name_b}", f"{pct} CI", "B - A", f"{pct} CI", "B / A"]
    body = []
    for r in rows:
        mark = " *" if r.get("significant") else ""
        body.append([r["run"], r["metric"], _fmt(r["a"]), _ci(r, "a"), _fmt(r["b"]), _ci(r, "b"), _fmt(r["diff"]) + mark,
                     _ci(r, "diff"), f"{r['ratio']:.3f}"])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=True)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"* the {pct} interval of B - A leaves out 0")
    return "\n".join(lines)


def compare_main(a: argparse.Namespace) -> int:
    try:
        da, db = load_result(a.a), load_result(a.b)
    except (OSError, ValueError) as e:
        print(f"quicserve bench compare: {e}")
        return 2
    rows = compare_rows(da, db, confidence=a.confidence, resamples=a.resamples, seed=a.seed)
    print(format_rows(rows, str(da.get("label") or a.a), str(db.get("label") or a.b), a.confidence))
    if a.plot:
        from .plots import draw_cdfs

        series = [(f"A: {da.get('label') or a.a}", [r for run in da["runs"] for r in run_records(run) if not r.warmup]),
                  (f"B: {db.get('label') or a.b}", [r for run in db["runs"] for r in run_records(run) if not r.warmup])]
        print(f"plot: {draw_cdfs(series, Path(a.plot), f'{Path(a.a).name} vs {Path(a.b).name}')}")
    return 0
