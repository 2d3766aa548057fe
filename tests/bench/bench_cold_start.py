"""Cold start of a JAX worker: a first start against a restart over the persistent compilation cache.

Each round starts ``quicserve worker`` on an empty cache directory (the first start: it compiles every
shape and writes the cache), then again on the same directory (the restart: it loads them), and
times each from the spawn to its ``ready`` event, with the phases the worker reports (load, compile,
warm-up). The figure is the ratio of the medians (#35's target: restart <= 0.4x the first start);
``--off`` adds a start with the cache off per round, to see what writing the cache costs.

    .venv/bin/python tests/bench/bench_cold_start.py            # the tiny model, 5 rounds
    .venv/bin/python tests/bench/bench_cold_start.py --runs 3 --max-batch 8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def start(cache: str, model: str, max_batch: int) -> dict[str, float]:
    """One worker start: seconds to ready and the phases it reported; the worker is stopped after."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "worker", "--model", model, "--max-batch",
                             str(max_batch), f"--compilation-cache={cache}"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            ev = json.loads(line)
            if ev.get("event") == "ready":
                row = {"ready": time.perf_counter() - t0, **ev["startup"]}
                row["spawn"] = row["ready"] - row["load"] - row["compile"] - row["warmup"]  # before it timed itself
                return row
        raise RuntimeError(f"worker exited with {proc.wait()} before it was ready")
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--off", action="store_true", help="also a start with the cache off each round")
    ap.add_argument("--json", default="", help="write every start's figures here")
    args = ap.parse_args()
    rows: dict[str, list[dict[str, float]]] = {"first": [], "restart": [], "off": []}
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="quicserve-cc-") as cache:
            if args.off:
                rows["off"].append(start("", args.model, args.max_batch))
            rows["first"].append(start(cache, args.model, args.max_batch))
            rows["restart"].append(start(cache, args.model, args.max_batch))
            entries = len(os.listdir(cache))
        print(f"round {i + 1}: " + ", ".join(f"{k} {v[-1]['ready']:.1f} s (compile {v[-1]['compile']:.1f})"
                                             for k, v in rows.items() if v) + f"; {entries} cache entries",
              flush=True)
    med = {k: {p: statistics.median(r[p] for r in v) for p in v[0]} for k, v in rows.items() if v}
    for k, m in med.items():
        print(f"{k:8s} median of {args.runs}: ready {m['ready']:.1f} s = load {m['load']:.1f} + compile "
              f"{m['compile']:.1f} + warm-up {m['warmup']:.2f} + spawn {m['spawn']:.1f} (each phase's own median)")
    ratio = med["restart"]["ready"] / med["first"]["ready"]
    print(f"restart / first start: {ratio:.2f}x (target <= 0.4x: {'met' if ratio <= 0.4 else 'NOT met'})")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "medians": med, "ratio": ratio}, indent=1))


if __name__ == "__main__":
    main()
