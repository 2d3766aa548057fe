"""Normal streams' inter-token latency with and without 100 hostile structured-output requests sent
meanwhile (tests/integration/test_hostile_schemas.py's load): a real `quicserve serve` with the
synthetic engine (5 ms steps; its worker compiles grammars as the JAX one does), runs alternated,
p99 of each kind pooled over its runs; target: with/without <= 1.5.

    .venv/bin/python tests/bench/bench_hostile_schemas.py [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.integration.test_gateway_e2e import start_gateway, stop_gateway  # noqa: E402
from tests.integration.test_hostile_schemas import run_load  # noqa: E402


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[int(0.99 * (len(xs) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        gw = start_gateway(Path(tmp), "--worker-option=synthetic_step_ms=5")
        try:
            itl: dict[bool, list[float]] = {False: [], True: []}
            outcomes: list[str] = []
            for r in range(a.runs):
                for hostile in (False, True) if r % 2 == 0 else (True, False):
                    _, got, out = asyncio.run(run_load(gw.http, hostile))
                    itl[hostile] += got
                    outcomes += out
        finally:
            stop_gateway(gw)
    base, loaded = p99(itl[False]), p99(itl[True])
    print(f"normal streams' p99 ITL: {1e3 * base:.1f} ms alone, {1e3 * loaded:.1f} ms with 100 hostile requests "
          f"(ratio {loaded / base:.2f}, target <= 1.5); hostile outcomes "
          f"{ {o: outcomes.count(o) for o in sorted(set(outcomes))} }")


if __name__ == "__main__":
    main()
