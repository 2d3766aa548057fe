"""Cache-aware routing policies side by side in simulated time, against the ideal cache (issue #29).

Run: ``.venv/bin/python -m tests.bench.bench_cache_routing [--requests N]``.

Per trace: 4 replicas, each an LRU prefix cache sized so the tenants' contexts fill
``demand`` of the fleet's cache; arrivals at ``load`` of the fleet's throughput at the
oracle's hit rate (:func:`fleet_rate`). Columns: token hit rate, the same as a share of the
oracle's (one LRU cache of the whole fleet's capacity on the same trace) and of round robin's,
p50/p90 TTFT (and p90 as a share of round robin's), requests per replica max/mean, and the
p99 over 100 ms samples of in-flight tokens max/mean.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import replace

from gateway.routing.cache_index import CacheIndex
from gateway.routing.cache_policy import (
    ApproxRadix,
    CachePolicy,
    CostBased,
    CostModel,
    FirstBlockAffinity,
    LeastLoadedIndex,
    RoundRobin,
)

from .cache_sim import SimResult, oracle_hit_rate, simulate
from .trace_gen import TraceSpec, context_demand_blocks, generate

REPLICAS = 4
COST = CostModel()
BATCH = 16  # the batch a request's decode shares its steps with, to size the arrival rate


def policies(replicas: int, capacity: int, cost: CostModel) -> list[Callable[[CacheIndex], CachePolicy]]:
    return [
        lambda ix: RoundRobin(),
        lambda ix: LeastLoadedIndex(),
        lambda ix: FirstBlockAffinity(ix),
        lambda ix: ApproxRadix(replicas, capacity),
        lambda ix: CostBased(ix, cost),
        lambda ix: CostBased(ix, cost, bound=math.inf),
    ]


def capacity_for(spec: TraceSpec, demand: float, replicas: int = REPLICAS) -> int:
    """Blocks per replica such that the contexts are ``demand`` of the fleet's cache."""
    return math.ceil(context_demand_blocks(spec) / (demand * replicas))


def fleet_rate(spec: TraceSpec, hit_rate: float, load: float, cost: CostModel = COST,
               replicas: int = REPLICAS) -> float:
    """Arrivals per second that keep the fleet ``load`` busy when ``hit_rate`` of prompt tokens are cached."""
    prompt = spec.common_tokens + spec.context_tokens + spec.query_tokens
    service = cost.prefill_s * prompt * (1 - hit_rate) + spec.output_tokens * (cost.decode_seq_s + cost.decode_s / BATCH)
    return load * replicas / service


def run_trace(name: str, spec: TraceSpec, demand: float, load: float) -> list[SimResult]:
    cap = capacity_for(spec, demand)
    probe = generate(replace(spec, rate=1.0))  # the oracle's hit rate barely depends on the rate
    rate = fleet_rate(spec, oracle_hit_rate(probe, cap * REPLICAS, spec.block_size), load)
    spec = replace(spec, rate=rate)
    trace = generate(spec)
    oracle = oracle_hit_rate(trace, cap * REPLICAS, spec.block_size)
    t0 = time.perf_counter()
    results = [simulate(trace, mk, replicas=REPLICAS, capacity=cap, cost=COST, block_size=spec.block_size)
               for mk in policies(REPLICAS, cap, COST)]
    print(f"\n{name}: {len(trace)} requests, {spec.tenants} tenants, Zipf {spec.zipf_s}, hot share {spec.hot_share},"
          f" {spec.common_tokens}+{spec.context_tokens}-token contexts, {spec.multi_turn:.0%} multi-turn;"
          f" {REPLICAS} x {cap} blocks of {spec.block_size} (demand {demand:.0%}), {rate:.1f} req/s"
          f" (load {load:.0%}); oracle hit rate {oracle:.3f}  [{time.perf_counter() - t0:.1f} s]")
    rr = results[0]
    print(f"{'policy':<22}{'hit':>7}{'/oracle':>9}{'/rr':>7}{'p50 s':>9}{'p90 s':>9}{'p90/rr':>8}"
          f"{'req max/mean':>14}{'tok p99':>9}  per replica")
    for r in results:
        print(f"{r.policy:<22}{r.hit_rate:>7.3f}{r.hit_rate / oracle:>9.3f}{r.hit_rate / rr.hit_rate:>7.2f}"
              f"{r.ttft_p50:>9.3f}{r.ttft_p90:>9.3f}{r.ttft_p90 / rr.ttft_p90:>8.3f}"
              f"{r.imbalance:>14.2f}{r.inflight_p99:>9.2f}  {r.per_replica}")
    return results


T1 = TraceSpec(tenants=150, zipf_s=1.1, context_tokens=6144, query_tokens=128, multi_turn=0.3, seed=1)
T1_HOT = replace(T1, hot_share=0.5, seed=2)
T2 = TraceSpec(tenants=64, zipf_s=1.1, common_tokens=1024, context_tokens=2048, query_tokens=128,
               multi_turn=0.0, seed=3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--load", type=float, default=0.7)
    args = ap.parse_args()
    for name, spec in (("T1", T1), ("T1, one tenant 50%", T1_HOT), ("T2", T2)):
        run_trace(name, replace(spec, requests=args.requests), demand=0.73, load=args.load)


if __name__ == "__main__":
    main()
