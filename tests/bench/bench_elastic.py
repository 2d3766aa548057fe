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
undefined; the line then says whether elastic's p95 is 0 too.) Both scalers drain after ``--idle``
seconds of surplus; ``--sweep-idle`` adds rows at other settings, the cost/wait frontier of each.

    .venv/bin/python tests/bench/bench_elastic.py [--seed N] [--seeds K] [--duration S] [--slots N]

Last measured (defaults: one simulated hour, mean 6.4-7.8 rps, peak 40 rps, 8 slots x 2 s mean
service = 4 rps per replica, budget 0.5 s, idle 30 s; static-mean 3, static-peak 14 replicas;
horizon from the measured start-ups 1.36-1.66 s), seeds 0 / 1 / 2:

  static-peak   p95 0 / 0 / 0 ms, p99 0, 0% past budget, 1.00x replica-seconds
  elastic       p95 0 / 0 / 0 ms, p99 62 / 0 / 0 ms, 0.13 / 0.15 / 0.05% past budget,
                0.35 / 0.34 / 0.29x replica-seconds
  elastic-bare  p95 0, p99 16 / 0 / 0 ms, 0.09 / 0.07 / 0.05%, 0.36 / 0.35 / 0.29x
  reactive      p95 59 / 134 / 0 ms, p99 489 / 478 / 349 ms, 0.93 / 0.91 / 0.50%, 0.33 / 0.31 / 0.24x
  static-mean   p95 107-234 s (it cannot absorb a burst), 0.21x

So the issue's target against the peak pool holds (p95 0 = 0, <= 0.6x its replica-seconds) and the
elastic pool is ahead of the reactive one on waits (p95, p99, share past budget) but NOT on
replica-seconds at the same idleness setting: reactive is 5-18% cheaper, paid for with ~1% of
requests past the budget. Along the frontier, elastic at idle 10 s (0.30 / 0.29 / 0.26x, p95 0)
beats reactive at idle 30 s on seeds 0-1 (0.33 / 0.31x) but not on seed 2 (0.24x).
Erlang C (exponential service) is pessimistic here: --late 0.25 still leaves only 0.16 / 0.18 /
0.09% past the budget, at 0.30 / 0.30 / 0.25x (reactive 0.33 / 0.31 / 0.24x). Correcting the
model by observed vs predicted waits (as Dynamo's planner corrects its latency model) is the
next step before the elastic pool can claim to be cheaper than reactive.
"""

from __future__ import annotations

import argparse
import math
import random
import time

from gateway.workers.elastic import ElasticController, PoolLimits, ReactiveController
from gateway.workers.elastic_sim import SimResult, Startup, StaticController, bursty_trace, simulate


def run(seed: int, duration: float, slots: int, budget: float, idle: float,
        margin: float = 0.0, late: float = 0.01, sweep: tuple[float, ...] = ()) -> dict[str, SimResult]:
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
    measured = [startup.draw(history) for _ in range(16)]
    for d in measured:
        elastic.observe_startup(d)
        bare.observe_startup(d)
    out = {}
    out["static-mean"] = simulate(trace, StaticController(), slots=slots, initial=mean_n, seed=seed)
    out["static-peak"] = simulate(trace, StaticController(), slots=slots, initial=peak_n, seed=seed)
    out["reactive"] = simulate(trace, ReactiveController(limits), slots=slots, initial=1, seed=seed)
    out["elastic-bare"] = simulate(trace, bare, slots=slots, initial=1, seed=seed)
    out["elastic"] = simulate(trace, elastic, slots=slots, initial=1, seed=seed)
    for other in sweep:  # the cost/wait frontier: both scalers at other idleness settings
        lim = PoolLimits(min_replicas=1, max_replicas=2 * peak_n, queue_budget_s=budget, idle_s=other,
                         target_utilisation=util)
        out[f"reactive@{other:g}s"] = simulate(trace, ReactiveController(lim), slots=slots, initial=1, seed=seed)
        e = ElasticController(lim, margin_sigmas=margin, late_target=late)
        for d in measured:
            e.observe_startup(d)
        out[f"elastic@{other:g}s"] = simulate(trace, e, slots=slots, initial=1, seed=seed)
    print(f"seed {seed}: {len(trace.arrivals)} requests over {duration:.0f} s, mean {trace.mean_rps:.1f} rps,"
          f" peak {trace.peak_rps:.1f} rps, {len(trace.bursts)} bursts; replica capacity {capacity:.2f} rps"
          f" ({slots} slots); static-mean {mean_n}, static-peak {peak_n} replicas;"
          f" elastic horizon {elastic.startup.horizon() * 1000:.0f} ms")
    return out


def report(results: dict[str, SimResult], budget: float) -> None:
    peak = results["static-peak"]
    print(f"  {'pool':<14} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'>budget':>8} {'repl-s':>9}"
          f" {'starts':>6} {'max':>4} {'p95/peak':>9} {'rs/peak':>8}")
    for name, r in results.items():
        late = sum(w > budget for w in r.waits) / len(r.waits)
        p95_ratio = f"{r.p(0.95) / peak.p(0.95):.2f}x" if peak.p(0.95) > 0 else (
            "0=0" if r.p(0.95) == 0 else "inf")
        print(f"  {name:<14} {r.p(0.5) * 1e3:8.1f} {r.p(0.95) * 1e3:8.1f} {r.p(0.99) * 1e3:8.1f}"
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
    ap.add_argument("--sweep-idle", default="10,20", help="more idle_s values for both scalers ('' for none)")
    args = ap.parse_args()
    for seed in range(args.seed, args.seed + args.seeds):
        t0 = time.perf_counter()
        results = run(seed, args.duration, args.slots, args.budget, args.idle, args.margin, args.late,
                      tuple(float(x) for x in args.sweep_idle.split(",") if x))
        report(results, args.budget)
        print(f"  ({time.perf_counter() - t0:.1f} s wall)")


if __name__ == "__main__":
    main()
