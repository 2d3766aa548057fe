"""Elastic pool vs static pools and a reactive autoscaler, on the simulator (issue #35).

Same run, same trace, same seed for every pool: a diurnal base (one simulated hour per cycle by
default) with bursts of 5x for 60 s, Poisson arrivals within, lognormal service times; replicas
start in a lognormal time around 0.7 s. The elastic controller begins with a measured start-up
history (16 draws from the same distribution, a different stream) as the gateway would have from
earlier starts. Pools compared:

  static-mean   sized for the trace's mean rate at the target utilisation
  static-peak   sized for its peak rate (a burst on the diurnal crest) at the target utilisation
  reactive      starts replicas once the queue's head passes the wait budget
  elastic-bare  forecasts (Holt: level + trend) over the P90 + 2 sigma start-up horizon and starts a
                replica when that forecast exceeds ready + starting capacity at the target
                utilisation (0.75): the write-up's rule
  elastic       the same forecast, sized by Erlang C: the fewest replicas for which at most 1% of
                requests would wait past the budget (see gateway/workers/elastic.py)

It prints p50/p95/p99 queue wait, the share of requests past the budget, replica-seconds and the
ratios to the peak-sized pool. The issue's target: elastic p95 <= 1.2x static-peak's with <= 0.6x
its replica-seconds, and ahead of reactive on both. (Where static-peak's p95 is 0 the ratio is
undefined; the line then says whether elastic's p95 is 0 too.)

    .venv/bin/python tests/bench/bench_elastic.py [--seed N] [--seeds K] [--duration S] [--slots N]
"""

from __future__ import annotations

import argparse
import math
import random
import time

from gateway.workers.elastic import ElasticController, PoolLimits, ReactiveController
from gateway.workers.elastic_sim import SimResult, Startup, StaticController, bursty_trace, simulate


def run(seed: int, duration: float, slots: int, budget: float, idle: float,
        margin: float = 0.0, late: float = 0.01) -> dict[str, SimResult]:
    trace = bursty_trace(seed=seed, duration_s=duration)
    startup = Startup()
    capacity = slots / (sum(trace.service) / len(trace.service))
    util = 0.75
    mean_n = math.ceil(trace.mean_rps / (capacity * util))
    peak_n = math.ceil(trace.peak_rps / (capacity * util))
    limits = PoolLimits(min_replicas=1, max_replicas=2 * peak_n, queue_budget_s=budget, idle_s=idle,
                        target_utilisation=util)
    elastic = ElasticController(limits, margin_sigmas=margin, late_target=late)
    bare = ElasticController(limits, margin_sigmas=0.0, late_target=None)  # the write-up's rule alone
    history = random.Random(seed + 1000)
    for _ in range(16):
        d = startup.draw(history)
        elastic.observe_startup(d)
        bare.observe_startup(d)
    out = {}
    out["static-mean"] = simulate(trace, StaticController(), slots=slots, initial=mean_n, seed=seed)
    out["static-peak"] = simulate(trace, StaticController(), slots=slots, initial=peak_n, seed=seed)
    out["reactive"] = simulate(trace, ReactiveController(limits), slots=slots, initial=1, seed=seed)
    out["elastic-bare"] = simulate(trace, bare, slots=slots, initial=1, seed=seed)
    out["elastic"] = simulate(trace, elastic, slots=slots, initial=1, seed=seed)
    print(f"seed {seed}: {len(trace.arrivals)} requests over {duration:.0f} s, mean {trace.mean_rps:.1f} rps,"
          f" peak {trace.peak_rps:.1f} rps, {len(trace.bursts)} bursts; replica capacity {capacity:.2f} rps"
          f" ({slots} slots); static-mean {mean_n}, static-peak {peak_n} replicas;"
          f" elastic horizon {elastic.startup.horizon() * 1000:.0f} ms")
    return out


def report(results: dict[str, SimResult], budget: float) -> None:
    peak = results["static-peak"]
    print(f"  {'pool':<12} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'>budget':>8} {'repl-s':>9}"
          f" {'starts':>6} {'max':>4} {'p95/peak':>9} {'rs/peak':>8}")
    for name, r in results.items():
        late = sum(w > budget for w in r.waits) / len(r.waits)
        p95_ratio = f"{r.p(0.95) / peak.p(0.95):.2f}x" if peak.p(0.95) > 0 else (
            "0=0" if r.p(0.95) == 0 else "inf")
        print(f"  {name:<12} {r.p(0.5) * 1e3:8.1f} {r.p(0.95) * 1e3:8.1f} {r.p(0.99) * 1e3:8.1f}"
              f" {late:8.2%} {r.replica_seconds:9.0f} {r.starts:6d} {r.peak_replicas:4d}"
              f" {p95_ratio:>9} {r.replica_seconds / peak.replica_seconds:7.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=3, help="how many seeds from --seed")
    ap.add_argument("--duration", type=float, default=3600.0, help="simulated seconds")
    ap.add_argument("--slots", type=int, default=8, help="requests a replica serves at once")
    ap.add_argument("--budget", type=float, default=0.5, help="queue-wait budget, seconds")
    ap.add_argument("--idle", type=float, default=30.0, help="sustained idleness before a drain, seconds")
    ap.add_argument("--margin", type=float, default=0.0, help="elastic: Poisson margin in sigmas")
    ap.add_argument("--late", type=float, default=0.01, help="elastic: Erlang C share past the budget")
    args = ap.parse_args()
    for seed in range(args.seed, args.seed + args.seeds):
        t0 = time.perf_counter()
        results = run(seed, args.duration, args.slots, args.budget, args.idle, args.margin, args.late)
        report(results, args.budget)
        print(f"  ({time.perf_counter() - t0:.1f} s wall)")


if __name__ == "__main__":
    main()
