"""Elastic pool vs static pools and a reactive autoscaler, on the simulator (issue #35).

Same run, same trace, same seed for every pool: a diurnal base (one simulated hour per cycle by
default) with bursts of 5x for 60 s, Poisson arrivals within, lognormal service times; replicas
start in a lognormal time around 0.7 s. The elastic controller begins with a measured start-up
history (16 draws from the same distribution, a different stream) as the gateway would have from
earlier starts. Pools compared:

  static-mean   sized for the trace's mean rate at the target utilisation
  static-peak   sized for its peak rate (a burst on the diurnal crest) at the target utilisation
  reactive      starts replicas once the queue's head passes the wait budget
  elastic-bare  the elastic controller's forecast, sized by the write-up's rule: a replica more when
                the forecast over the P90 + 2 sigma start-up horizon exceeds ready + starting
                capacity at the target utilisation (0.75)
  elastic       the controller as the gateway runs it (gateway/workers/elastic.py, defaults): a slow
                rate (~10 s) plus the fast Holt forecast once it passes the slow rate by 3 sigma of
                its noise (a burst); sized by Erlang C for at most 5% of requests past the budget at
                that forecast, the wait's scale corrected by observed / predicted queue length (the
                Dynamo planner's correction; it ends at 0.39 / 0.35 / 0.51 / 0.25 / 0.67 / 0.25 on
                seeds 0-5, 0.25 its floor, where Allen-Cunneen would give 0.625 for the service's
                cv 0.5); scale-in once the slow rate's upper bound
                (+2 sigma) has needed fewer replicas for its memory (10 s, at most idle_s)

It prints p50/p95/p99 queue wait, the share of requests that waited at all and past the budget,
replica-seconds and the ratios to the peak-sized pool, then per seed a verdict line on the issue's
bars: elastic p95 <= 1.2x static-peak's with <= 0.6x its replica-seconds, and ahead of reactive on
both (a tie where both p95 are 0; p99 is shown beside it). ``--sweep-idle`` adds both scalers at
other idleness settings, the cost/wait frontier of each.

    .venv/bin/python tests/bench/bench_elastic.py [--seed N] [--seeds K] [--duration S] [--slots N]

Last measured (this controller, same run, seeds 0-5; defaults: one simulated hour, mean 6.4-8.6
rps, peak 40 rps, 8 slots x 2 s mean service = 4 rps per replica, budget 0.5 s, idle 30 s;
static-mean 3, static-peak 14 replicas; horizon from the measured start-ups 1.36-1.67 s):

  seed                       0       1       2       3       4       5
  static-peak   p95 ms       0       0       0       0       0       0      (1.00x replica-s)
  elastic       p95 ms       0       0       0       0       0       0
                p99 ms     294     265     211     228     216     215
                >budget  0.28%   0.29%   0.20%   0.28%   0.35%   0.13%
                repl-s   13238   12613   11119   13707   12359   11107
                /peak    0.263   0.250   0.221   0.272   0.245   0.220
  reactive      p95 ms      59     134       0      92       0       0
                p99 ms     489     477     349     451     471     398
                >budget  0.93%   0.91%   0.50%   0.82%   0.87%   0.71%
                repl-s   16743   15785   11957   16534   14397   13094
  elastic / reactive     0.791   0.799   0.930   0.829   0.858   0.848   replica-seconds

So on every seed the elastic pool meets the bars against the peak-sized pool (p95 0 = 0, 0.22-0.27x
its replica-seconds) and is ahead of the reactive one on replica-seconds (7-21% fewer) and on p95
where reactive's p95 is above 0 (seeds 0, 1, 3); on seeds 2, 4, 5 both p95 are 0 (a tie), and
elastic is ahead on p99 (211-216 vs 349-471 ms) and on the share past the budget. Before this
controller (Erlang C at 1%, one Holt forecast, drains after idle_s with no start) elastic was 4-23%
dearer than reactive on seeds 0-2 (0.35 / 0.34 / 0.29x of peak vs 0.33 / 0.31 / 0.24x): noise in
the fast forecast started replicas, and the sliding maximum of its need held them for idle_s.

Fairness, both ways. The reactive scaler is unchanged: it starts once the queue's head passes the
budget and drains one replica per idle_s (30 s) of a whole replica's slots free. The elastic one
drains after 10 s once its forecast says the surplus lasts, so its rows at idle 10 / 20 / 30 s
coincide. Against reactive at idle 20 s elastic is still cheaper on every seed (reactive@20s 15674 /
14269 / 11234 / 15133 / 13124 / 11668 replica-s). Against reactive at idle 10 s -- the same 10 s
before a drain -- elastic is NOT cheaper: 1.06 / 1.04 / 1.11 / 1.04 / 1.07 / 1.08x of reactive@10s's
replica-seconds (12542 / 12090 / 10053 / 13139 / 11499 / 10252), which pays with p95 203 / 163 / 93 /
198 / 132 / 74 ms and 1.2-1.5% of requests past the budget. So the issue's comparison (the same
idle_s) is met on all six seeds; along the frontier, elastic buys its zero p95 with 4-11% more
replica-seconds than the cheapest reactive setting here.

Off the defaults (seeds 0-2, same run each): with --idle 60 elastic is unchanged and 0.64 / 0.65 /
0.80x of reactive's replica-seconds (p95 0 vs 50 / 117 / 0 ms). With --budget 1.0 it is 0.67 /
0.77 / 0.95x of reactive's at p95 11 / 14 / 0 ms (reactive 541 / 383 / 254 ms), so it misses the
1.2x-of-peak bar (peak's p95 is 0) on seeds 0-1: a looser budget lets Erlang C size for short
waits under it. With --slots 4 (27 replicas at peak) it is 0.60 / 0.64 / 0.78x of reactive's at p95
47 / 44 / 0 ms (reactive 40 / 128 / 0 ms): behind reactive on p95 on seed 0, and over peak's 0 on
seeds 0-1. The defaults are the issue's setting; the sizing target (late_target) is per budget,
not a bound on waiting at all.
"""

from __future__ import annotations

import argparse
import math
import random
import time

from gateway.workers.elastic import ElasticController, PoolLimits, ReactiveController
from gateway.workers.elastic_sim import SimResult, Startup, StaticController, bursty_trace, simulate


def run(seed: int, duration: float, slots: int, budget: float, idle: float,
        margin: float = 0.0, late: float | None = None, sweep: tuple[float, ...] = ()) -> dict[str, SimResult]:
    trace = bursty_trace(seed=seed, duration_s=duration)
    startup = Startup()
    capacity = slots / (sum(trace.service) / len(trace.service))
    util = 0.75
    mean_n = math.ceil(trace.mean_rps / (capacity * util))
    peak_n = math.ceil(trace.peak_rps / (capacity * util))
    limits = PoolLimits(min_replicas=1, max_replicas=2 * peak_n, queue_budget_s=budget, idle_s=idle,
                        target_utilisation=util)
    tuned = {"late_target": late} if late is not None else {}  # else the controller's default
    elastic = ElasticController(limits, margin_sigmas=margin, **tuned)
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
        e = ElasticController(lim, margin_sigmas=margin, **tuned)
        for d in measured:
            e.observe_startup(d)
        out[f"elastic@{other:g}s"] = simulate(trace, e, slots=slots, initial=1, seed=seed)
    print(f"seed {seed}: {len(trace.arrivals)} requests over {duration:.0f} s, mean {trace.mean_rps:.1f} rps,"
          f" peak {trace.peak_rps:.1f} rps, {len(trace.bursts)} bursts; replica capacity {capacity:.2f} rps"
          f" ({slots} slots); static-mean {mean_n}, static-peak {peak_n} replicas;"
          f" elastic horizon {elastic.startup.horizon() * 1000:.0f} ms, wait correction"
          f" {elastic.correction.factor:.2f} at the end")
    return out


def report(results: dict[str, SimResult], budget: float) -> None:
    peak = results["static-peak"]
    print(f"  {'pool':<14} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'waited':>7} {'>budget':>8} {'repl-s':>9}"
          f" {'starts':>6} {'max':>4} {'p95/peak':>9} {'rs/peak':>8}")
    for name, r in results.items():
        late = sum(w > budget for w in r.waits) / len(r.waits)
        waited = sum(w > 0 for w in r.waits) / len(r.waits)
        p95_ratio = f"{r.p(0.95) / peak.p(0.95):.2f}x" if peak.p(0.95) > 0 else (
            "0=0" if r.p(0.95) == 0 else "inf")
        print(f"  {name:<14} {r.p(0.5) * 1e3:8.1f} {r.p(0.95) * 1e3:8.1f} {r.p(0.99) * 1e3:8.1f}"
              f" {waited:7.2%} {late:8.2%} {r.replica_seconds:9.0f} {r.starts:6d} {r.peak_replicas:4d}"
              f" {p95_ratio:>9} {r.replica_seconds / peak.replica_seconds:7.2f}x")


def verdict(results: dict[str, SimResult]) -> str:
    """The issue's bars for this seed: elastic against static-peak and against reactive."""
    e, peak, r = results["elastic"], results["static-peak"], results["reactive"]

    def cmp(mine: float, theirs: float) -> str:
        return "ahead" if mine < theirs else "tie" if mine == theirs else "BEHIND"

    p95_ok = e.p(0.95) <= 1.2 * peak.p(0.95)
    rs_peak = e.replica_seconds / peak.replica_seconds
    rs_reactive = e.replica_seconds / r.replica_seconds
    return (f"  elastic vs static-peak: p95 {e.p(0.95) * 1e3:.0f} vs {peak.p(0.95) * 1e3:.0f} ms"
            f" ({'ok' if p95_ok else 'MISSED'} <= 1.2x), replica-seconds {rs_peak:.3f}x"
            f" ({'ok' if rs_peak <= 0.6 else 'MISSED'} <= 0.6x); vs reactive: p95 {e.p(0.95) * 1e3:.0f} vs"
            f" {r.p(0.95) * 1e3:.0f} ms ({cmp(e.p(0.95), r.p(0.95))}), p99 {e.p(0.99) * 1e3:.0f} vs"
            f" {r.p(0.99) * 1e3:.0f} ms ({cmp(e.p(0.99), r.p(0.99))}), replica-seconds {rs_reactive:.3f}x"
            f" of reactive's ({cmp(e.replica_seconds, r.replica_seconds)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=3, help="how many seeds from --seed")
    ap.add_argument("--duration", type=float, default=3600.0, help="simulated seconds")
    ap.add_argument("--slots", type=int, default=8, help="requests a replica serves at once")
    ap.add_argument("--budget", type=float, default=0.5, help="queue-wait budget, seconds")
    ap.add_argument("--idle", type=float, default=30.0, help="sustained idleness before a drain, seconds")
    ap.add_argument("--margin", type=float, default=0.0, help="elastic: Poisson margin in sigmas")
    ap.add_argument("--late", type=float, default=None,
                    help="elastic: the modelled share past the budget it sizes for (default: the controller's)")
    ap.add_argument("--sweep-idle", default="10,20", help="more idle_s values for both scalers ('' for none)")
    args = ap.parse_args()
    for seed in range(args.seed, args.seed + args.seeds):
        t0 = time.perf_counter()
        results = run(seed, args.duration, args.slots, args.budget, args.idle, args.margin, args.late,
                      tuple(float(x) for x in args.sweep_idle.split(",") if x))
        report(results, args.budget)
        print(verdict(results))
        print(f"  ({time.perf_counter() - t0:.1f} s wall)")


if __name__ == "__main__":
    main()
