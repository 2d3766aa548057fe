"""A run's figures as text, in the layout of ``vllm bench serve``."""

from __future__ import annotations

from typing import Any

__all__ = ["format_run"]

_NAMES = {"ttft": "Time to first token", "tpot": "Time per output token (excl. 1st)", "itl": "Inter-token latency",
          "e2e": "End-to-end latency"}


def _f(v: object, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.2f}{unit}"
    return f"{v}{unit}"


def format_run(run: dict[str, Any]) -> str:
    s, c = run["summary"], run["client"]
    w = 44
    lines = [f"{' ' + run['label'] + ' ':=^{w + 14}}"]

    def row(name: str, v: object, unit: str = "") -> None:
        lines.append(f"{name + ':':<{w}}{_f(v, unit):>14}")

    row("Successful requests", s["completed"])
    row("Failed requests", s["failed"])
    for kind, n in sorted(s["errors"].items()):
        row(f"  {kind}", n)
    row("Measured window (s)", s["duration_s"])
    row("Total input tokens", s["input_tokens"])
    row("Total generated tokens", s["output_tokens"])
    row("Request throughput (req/s)", s["request_throughput"])
    row("Output token throughput (tok/s)", s["output_throughput"])
    row("Total token throughput (tok/s)", s["total_token_throughput"])
    if "goodput" in s:
        g = s["goodput"]
        slos = " ".join(f"{k}:{v:g}" for k, v in g["slos_ms"].items())
        row(f"Request goodput ({slos} ms) (req/s)", g["request_goodput"])
        row("  share of requests within the SLOs", g["fraction"] * 100, " %")
    for m, name in _NAMES.items():
        st = s[f"{m}_ms"]
        if not st["count"]:
            continue
        lines.append(f"{' ' + name + ' ':-^{w + 14}}")
        for k in ("mean", "median", "p90", "p95", "p99"):
            row(f"{k.capitalize() if k in ('mean', 'median') else k.upper()} {m.upper()} (ms)", st[k])
    lines.append(f"{' Client ':-^{w + 14}}")
    row("Client CPU (share of one core)", c["cpu_fraction_of_one_core"] * 100, " %")
    row("Send lag p99 (ms)", c["send_lag_p99_ms"])
    row("Most requests in flight", c["max_in_flight"])
    lines += [f"! {n}" for n in c["notes"]]
    lines.append("=" * (w + 14))
    return "\n".join(lines)
