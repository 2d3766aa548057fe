"""PNG figures of a result (matplotlib, no display): every axis named with its unit, a legend.

- ``latency_cdf.png``: the distribution of TTFT, TPOT, ITL and E2E, one line per run;
- ``inflight.png``: requests in flight over the run's time, one line per run;
- for a sweep of rates, ``sweep_latency.png`` (median and p99 TTFT and TPOT against the offered
  rate) and ``sweep_throughput.png`` (achieved requests/s and output tokens/s against it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .records import Record
from .results import run_records
from .stats import METRICS, metric_values

__all__ = ["draw_result", "draw_cdfs", "LABELS"]

LABELS = {"ttft": "Time to first token", "tpot": "Time per output token (excl. 1st)",
          "itl": "Inter-token latency", "e2e": "End-to-end latency"}


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_cdfs(series: Sequence[tuple[str, list[Record]]], path: Path, title: str) -> Path:
    """One panel per metric, one line per (label, records)."""
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), constrained_layout=True)
    for ax, m in zip(axes.flat, METRICS, strict=True):
        drawn = False
        for label, records in series:
            v = np.sort(np.asarray(metric_values(records, m), dtype=np.float64) * 1e3)
            if len(v):
                ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=f"{label} (n={len(v)})")
                drawn = True
        ax.set_title(LABELS[m])
        ax.set_xlabel(f"{m.upper()} (ms)")
        ax.set_ylabel("fraction of " + ("token gaps" if m == "itl" else "requests") + " at or below")
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3)
        if drawn:
            ax.legend(loc="lower right", fontsize="small")
        else:
            ax.text(0.5, 0.5, "no values (not streamed?)", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _inflight(records: Sequence[Record]) -> tuple[np.ndarray, np.ndarray]:
    events = sorted([(r.start, 1) for r in records] + [(r.end, -1) for r in records])
    t = np.array([e[0] for e in events])
    return t, np.cumsum([e[1] for e in events])


def _draw_inflight(runs: Sequence[dict[str, Any]], path: Path, title: str) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(11, 5), constrained_layout=True)
    for run in runs:
        t, n = _inflight(run_records(run))
        if len(t):
            ax.step(t, n, where="post", label=run["label"])
    if runs and runs[0].get("warmup_s"):
        ax.axvline(runs[0]["warmup_s"], color="grey", linestyle=":", label="end of warm-up")
    ax.set_xlabel("time since the run started (s)")
    ax.set_ylabel("requests in flight")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize="small")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _rates(runs: Sequence[dict[str, Any]]) -> list[tuple[float, dict[str, Any]]]:
    return sorted((float(r["rate"]), r) for r in runs
                  if isinstance(r.get("rate"), int | float) and not math.isinf(float(r["rate"])))


def _draw_sweep_latency(points: list[tuple[float, dict[str, Any]]], path: Path, title: str) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), constrained_layout=True)
    x = [p[0] for p in points]
    for ax, m in zip(axes, ("ttft", "tpot"), strict=True):
        for stat, style in (("median", "o-"), ("p99", "s--")):
            y = [p[1]["summary"][f"{m}_ms"][stat] for p in points]
            ax.plot(x, [np.nan if v is None else v for v in y], style, label=f"{stat} {m.upper()}")
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_ylabel(f"{m.upper()} (ms)")
        ax.set_title(LABELS[m])
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _draw_sweep_throughput(points: list[tuple[float, dict[str, Any]]], path: Path, title: str) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5), constrained_layout=True)
    x = [p[0] for p in points]
    ax.plot(x, [p[1]["summary"]["request_throughput"] for p in points], "o-", color="C0", label="requests/s achieved")
    ax.plot(x, x, ":", color="grey", label="requests/s offered")
    ax.set_xlabel("offered request rate (req/s)")
    ax.set_ylabel("request throughput (req/s)")
    ax2 = ax.twinx()
    ax2.plot(x, [p[1]["summary"]["output_throughput"] for p in points], "s--", color="C1",
             label="output tokens/s")
    ax2.set_ylabel("output token throughput (tokens/s)")
    handles = ax.get_legend_handles_labels()
    handles2 = ax2.get_legend_handles_labels()
    ax.legend(handles[0] + handles2[0], handles[1] + handles2[1], loc="upper left")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def draw_result(doc: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Every figure of one result file, into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs, title = doc["runs"], str(doc.get("label", ""))
    paths = [draw_cdfs([(r["label"], [x for x in run_records(r) if not x.warmup]) for r in runs],
                       out / "latency_cdf.png", title),
             _draw_inflight(runs, out / "inflight.png", title)]
    points = _rates(runs)
    if len(points) > 1:
        paths.append(_draw_sweep_latency(points, out / "sweep_latency.png", title))
        paths.append(_draw_sweep_throughput(points, out / "sweep_throughput.png", title))
    return paths
