"""Cache-aware routing policies side by side in simulated time, against the ideal cache (issue #29).

Run: ``.venv/bin/python -m tests.bench.bench_cache_routing [--requests N]``.

Per trace: 4 replicas, each an LRU prefix cache sized so the tenants' contexts fill
``demand`` of the fleet's cache; arrivals at ``load`` of the fleet's throughput at the
oracle's hit rate (:func:`fleet_rate`). Columns: token hit rate, the same as a share of the
oracle's (one LRU cache of the whole fleet's capacity on the same trace) and of round robin's,
p50/p90 TTFT (and p90 as a share of round robin's), requests per replica max/mean, and the
p99 over 100 ms samples of in-flight tokens max/mean, sampled while requests open (up to the trace's last
opening request, :func:`~tests.bench.cache_sim.steady_end`: the whole trace but for T3's last turns).
Two yardsticks read what no gateway knows, each replica's in-flight prompt tokens as they are
(marked ``*``): ``least_tokens*`` sends each request where the fewest are (the best a router that
balances the figure alone does), ``cost_tok*`` is cost_based with its bound on those tokens
(``TOKEN_BOUND`` times the mean) instead of requests. ``floor``: the p99 over the same samples of
the least max/mean any placement of the requests then in flight could read
(:func:`~tests.bench.cache_sim.placement_floor`): the part of ``tok p99`` that requests' sizes alone
explain, whatever a router that sends each request on arrival chose.

``--late-binding``: the same traces through a gateway that holds requests (issue #29's balance
line; :mod:`tests.bench.late_binding`), one row per budget beside cost_based.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from gateway.routing.cache_index import CacheIndex
from gateway.routing.cache_policy import (
    ApproxRadix,
    CachePolicy,
    CacheRequest,
    CostBased,
    CostModel,
    FirstBlockAffinity,
    LeastLoadedIndex,
    ReplicaLoad,
    RoundRobin,
)

from .cache_sim import SimResult, oracle_hit_rate, simulate, steady_end
from .late_binding import binder_maker, simulate_late
from .trace_gen import TraceRequest, TraceSpec, context_demand_blocks, generate

REPLICAS = 4
COST = CostModel()
BATCH = 16  # the batch a request's decode shares its steps with, to size the arrival rate


TOKEN_BOUND = 1.2


class LeastTokens:
    """Yardstick: the replica with the fewest prompt tokens in flight (the simulator's truth)."""

    __slots__ = ()
    name = "least_tokens*"

    def choose(self, req: CacheRequest, loads: Sequence[ReplicaLoad]) -> int:
        return min(range(len(loads)), key=lambda r: (loads[r].tokens, loads[r].in_flight))


class TokenBounded:
    """Yardstick: cost_based's estimate among the replicas whose in-flight prompt tokens (the truth),
    this one's included, stay under ``bound`` times the mean; else the fewest tokens."""

    __slots__ = ("core", "bound")
    name = "cost_tok*"

    def __init__(self, index: CacheIndex, cost: CostModel, bound: float = TOKEN_BOUND) -> None:
        self.core, self.bound = CostBased(index, cost, math.inf), bound

    def choose(self, req: CacheRequest, loads: Sequence[ReplicaLoad]) -> int:
        est = self.core.estimates(req, loads)
        p = req.prompt_tokens
        cap = self.bound * (sum(x.tokens for x in loads) + p) / len(loads)
        return min(range(len(loads)), key=lambda r: (loads[r].tokens + p > cap, est[r], loads[r].tokens))


def policies(replicas: int, capacity: int, cost: CostModel) -> list[Callable[[CacheIndex], CachePolicy]]:
    return [
        lambda ix: RoundRobin(),
        lambda ix: LeastLoadedIndex(),
        lambda ix: FirstBlockAffinity(ix),
        lambda ix: ApproxRadix(replicas, capacity),
        lambda ix: CostBased(ix, cost),
        lambda ix: CostBased(ix, cost, bound=math.inf),
        lambda ix: LeastTokens(),
        lambda ix: TokenBounded(ix, cost),
    ]


def capacity_for(spec: TraceSpec, demand: float, replicas: int = REPLICAS) -> int:
    """Blocks per replica such that the contexts are ``demand`` of the fleet's cache."""
    return math.ceil(context_demand_blocks(spec) / (demand * replicas))


def working_set_blocks(trace: Sequence[TraceRequest], spec: TraceSpec) -> int:
    """The most blocks live at once: the tenants' contexts and every conversation between its first
    and last turn at its longest (a growing history is the working set of T3)."""
    span: dict[int, tuple[float, float, int]] = {}
    for r in trace:
        if r.session >= 0:
            t0, _, _ = span.get(r.session, (r.t, r.t, 0))
            span[r.session] = (t0, r.t, len(r.chain))
    base = context_demand_blocks(spec)
    own = (spec.common_tokens + spec.context_tokens) // spec.block_size
    events = sorted([(t0, n - own) for t0, _, n in span.values()] + [(t1, own - n) for _, t1, n in span.values()])
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    return base + peak


def fleet_rate(spec: TraceSpec, hit_rate: float, load: float, cost: CostModel = COST,
               replicas: int = REPLICAS, prompt_tokens: float = 0.0) -> float:
    """Arrivals per second that keep the fleet ``load`` busy when ``hit_rate`` of prompt tokens are
    cached (``prompt_tokens``: the mean prompt, else the spec's context and query)."""
    prompt = prompt_tokens or spec.common_tokens + spec.context_tokens + spec.query_tokens
    service = cost.prefill_s * prompt * (1 - hit_rate) + spec.output_tokens * (cost.decode_seq_s + cost.decode_s / BATCH)
    return load * replicas / service


def _sized(spec: TraceSpec, demand: float, load: float) -> tuple[TraceSpec, int]:
    """``spec`` at ``load`` of the fleet at the oracle's hit rate, and the blocks per replica that make
    its working set ``demand`` of the fleet's (a conversation trace's own rate sets its working set:
    sized on a probe at the rate, then again on the trace)."""
    cap = capacity_for(spec, demand)
    probe = generate(replace(spec, rate=1.0))  # the oracle's hit rate barely depends on the rate
    if not spec.conversations:
        hit = oracle_hit_rate(probe, cap * REPLICAS, spec.block_size)
        return replace(spec, rate=fleet_rate(spec, hit, load)), cap
    turns = len(probe) / spec.conversations
    mean = sum(r.prompt_tokens for r in probe) / len(probe)
    spec = replace(spec, rate=1.0)
    for _ in range(2):  # the working set at the rate, the rate at that working set's hit rate
        probe = generate(spec)
        cap = math.ceil(working_set_blocks(probe, spec) / (demand * REPLICAS))
        hit = oracle_hit_rate(probe, cap * REPLICAS, spec.block_size)
        spec = replace(spec, rate=fleet_rate(spec, hit, load, prompt_tokens=mean) / turns)
    cap = math.ceil(working_set_blocks(generate(spec), spec) / (demand * REPLICAS))
    return spec, cap


def run_trace(name: str, spec: TraceSpec, demand: float, load: float, gateways: int = 1,
              stats_s: float = 0.0, late: Sequence[str] = ()) -> list[SimResult]:
    spec, cap = _sized(spec, demand, load)
    trace = generate(spec)
    oracle = oracle_hit_rate(trace, cap * REPLICAS, spec.block_size)
    t0 = time.perf_counter()
    until = steady_end(trace)
    results = [simulate(trace, mk, replicas=REPLICAS, capacity=cap, cost=COST, block_size=spec.block_size,
                        gateways=gateways, stats_s=stats_s, sample_until=until) for mk in policies(REPLICAS, cap, COST)]
    span = trace[-1].t - trace[0].t
    how = f"; {gateways} gateways" if gateways > 1 else ""
    how += f", each seeing Stats every {stats_s} s and its own requests" if stats_s else ""
    print(f"\n{name}: {len(trace)} requests over {span:.0f} s ({len(trace) / span:.1f} req/s, load {load:.0%}),"
          f" {spec.tenants} tenants, Zipf {spec.zipf_s}, hot share {spec.hot_share},"
          f" {spec.common_tokens}+{spec.context_tokens}-token contexts, {spec.multi_turn:.0%} multi-turn"
          f" (up to {spec.max_turns} turns); {REPLICAS} x {cap} blocks of {spec.block_size} (demand {demand:.0%})"
          f"{how}; oracle hit rate {oracle:.3f}; balance sampled to {min(until, trace[-1].t):.0f} s"
          f"  [{time.perf_counter() - t0:.1f} s]")
    rr = results[0]
    print(f"{'policy':<22}{'hit':>7}{'/oracle':>9}{'/rr':>7}{'p50 s':>9}{'p90 s':>9}{'p90/rr':>8}"
          f"{'req max/mean':>14}{'tok p99':>9}{'floor':>7}  per replica")
    for r in results:
        print(f"{r.policy:<22}{r.hit_rate:>7.3f}{r.hit_rate / oracle:>9.3f}{r.hit_rate / rr.hit_rate:>7.2f}"
              f"{r.ttft_p50:>9.3f}{r.ttft_p90:>9.3f}{r.ttft_p90 / rr.ttft_p90:>8.3f}"
              f"{r.imbalance:>14.2f}{r.inflight_p99:>9.2f}{r.floor_p99:>7.2f}  {r.per_replica}", flush=True)
    if late:
        _late_rows(trace, cap, spec.block_size, until, oracle, rr, results[4], late, gateways)
    return results


def _late_rows(trace: Sequence[TraceRequest], cap: int, block_size: int, until: float, oracle: float,
               rr: SimResult, ours: SimResult, specs: Sequence[str], gateways: int) -> None:
    """The late-binding table (:mod:`tests.bench.late_binding`) under the trace's, beside cost_based."""
    if gateways > 1:
        print("late binding: one gateway only (not simulated for several)")
        return
    mean = sum(r.prompt_tokens for r in trace) / len(trace)
    print(f"late binding (mean prompt {mean:.0f} tokens; held requests are in flight nowhere: wait = time at"
          f" the gateway, counted in TTFT)")
    print(f"{'binder':<36}{'hit':>7}{'/oracle':>9}{'p50 s':>9}{'p90 s':>9}{'p90/rr':>8}{'tok p99':>9}{'floor':>7}"
          f"{'held':>7}{'wait p90':>10}{'wait max':>10}{'queue max':>10}")
    print(f"{ours.policy + ' (sends at once)':<36}{ours.hit_rate:>7.3f}{ours.hit_rate / oracle:>9.3f}"
          f"{ours.ttft_p50:>9.3f}{ours.ttft_p90:>9.3f}{ours.ttft_p90 / rr.ttft_p90:>8.3f}{ours.inflight_p99:>9.2f}"
          f"{ours.floor_p99:>7.2f}{0:>7.2f}{0:>10.3f}{0:>10.3f}{0:>10}")
    for spec in specs:
        for mk in binder_maker(spec, COST, mean):
            r = simulate_late(trace, mk, replicas=REPLICAS, capacity=cap, cost=COST, block_size=block_size,
                              sample_until=until)
            print(f"{r.policy:<36}{r.hit_rate:>7.3f}{r.hit_rate / oracle:>9.3f}{r.ttft_p50:>9.3f}{r.ttft_p90:>9.3f}"
                  f"{r.ttft_p90 / rr.ttft_p90:>8.3f}{r.inflight_p99:>9.2f}{r.floor_p99:>7.2f}{r.held_share:>7.2f}"
                  f"{r.wait_p90:>10.3f}{r.wait_max:>10.3f}{r.queue_max:>10}"
                  + (f"  stopped at {r.stopped_at:.0f} s: held past 1,000" if r.stopped_at == r.stopped_at else ""),
                  flush=True)


T1 = TraceSpec(tenants=150, zipf_s=1.1, context_tokens=6144, query_tokens=128, multi_turn=0.3, seed=1)
T1_HOT = replace(T1, hot_share=0.5, seed=2)
T2 = TraceSpec(tenants=64, zipf_s=1.1, common_tokens=1024, context_tokens=2048, query_tokens=128,
               multi_turn=0.0, seed=3)
# 500 conversations of up to 8 turns (uniform), each turn ~200 tokens more (a ~100-token query and a
# 100-token answer), after one of 8 system prompts of 512 tokens; interleaved (5 s to think)
T3 = TraceSpec(requests=100_000, tenants=8, zipf_s=1.1, context_tokens=512, query_tokens=100, output_tokens=100,
               multi_turn=1.0, max_turns=8, turns_uniform=True, conversations=500, think_s=5.0, seed=4)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--load", type=float, default=0.7)
    ap.add_argument("--traces", default="T1,T1-hot,T2,T2-two-gateways,T3")
    ap.add_argument("--output-spread", type=float, default=0.0,
                    help="answer lengths uniform in [o(1-s), o(1+s)] instead of all o (the same prompts and arrivals)")
    ap.add_argument("--late-binding", nargs="*", default=[], metavar="tokens:M,..|share:K,..",
                    help="also hold requests at the gateway: per-replica budgets of M mean prompts, or caps of K x the"
                         " mean in flight (tests/bench/late_binding.py)")
    args = ap.parse_args()
    n = args.requests
    runs = {"T1": ("T1", replace(T1, requests=n), {}),
            "T1-hot": ("T1, one tenant 50%", replace(T1_HOT, requests=n), {}),
            "T2": ("T2", replace(T2, requests=n), {}),
            "T2-two-gateways": ("T2, two gateways each taking half", replace(T2, requests=n),
                                {"gateways": 2, "stats_s": 0.5}),
            "T2-stats": ("T2, one gateway (as the two see loads)", replace(T2, requests=n), {"stats_s": 0.5}),
            "T3": ("T3", T3, {})}
    for key in args.traces.split(","):
        name, spec, kw = runs[key]
        if args.output_spread:
            spec, name = replace(spec, output_spread=args.output_spread), f"{name}, answers +-{args.output_spread:.0%}"
        run_trace(name, spec, demand=0.73, load=args.load, late=args.late_binding, **kw)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
