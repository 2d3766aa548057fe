"""The late-binding experiment (#29's balance line, tests/bench/late_binding.py): its binders on
hand-made states, the placement floor by hand, and a small simulation that holds requests."""

from __future__ import annotations

import math

from gateway.routing.cache_index import CacheIndex
from gateway.routing.cache_policy import CacheRequest, CostModel, ReplicaLoad
from tests.bench.cache_sim import placement_floor
from tests.bench.late_binding import HoldForHolder, UnderBudget, simulate_late
from tests.bench.trace_gen import TraceSpec, generate
from transport.common.prefix import chain_hashes

BS = 16
COST = CostModel()
LONG = chain_hashes([5] * (256 * BS), BS)  # 4,096 tokens
OTHER = chain_hashes([9] * (8 * BS), BS)


def load(tokens: int, running: int = 0) -> ReplicaLoad:
    return ReplicaLoad(in_flight=running, running=running, tokens=tokens)


def test_placement_floor_by_hand() -> None:
    assert placement_floor([], 4) == 0.0
    assert placement_floor([100] * 8, 4) == 1.0  # two each
    # five equal requests on four replicas: one holds two, the mean is 5/4 -> 2 / 1.25
    assert placement_floor([100] * 5, 4) == 1.6
    # one request larger than the mean of all: it alone sets the floor, 300 / (400 / 4)
    assert placement_floor([300, 50, 25, 25], 4) == 3.0


def test_under_budget_skips_replicas_over_it_and_an_idle_one_takes_anything() -> None:
    ub = UnderBudget(CacheIndex(3, 1 << 12), COST, budget=1000)
    req = CacheRequest(OTHER, 300, BS)
    assert ub.place([(0, req, 0.0)], [load(900), load(200, 1), load(0)], 0.0) == [(0, 2)]  # idle: no decode
    assert ub.place([(0, req, 0.0)], [load(900), load(200, 1), load(800, 1)], 0.0) == [(0, 1)]
    big = CacheRequest(OTHER, 3000, BS)
    assert ub.place([(0, big, 0.0)], [load(5000), load(0), load(900)], 0.0) == [(0, 1)]  # over budget, but idle
    assert ub.place([(0, big, 0.0)], [load(5000), load(10), load(900)], 0.0) == []  # held


def test_under_budget_fifo_head_blocks_shortest_first_lets_a_small_one_by() -> None:
    index = CacheIndex(2, 1 << 12)
    held = [(0, CacheRequest(OTHER, 300, BS), 0.0), (1, CacheRequest(OTHER, 100, BS), 0.0)]
    loads = [load(900, 3), load(850, 3)]
    assert UnderBudget(index, COST, 1000, "fifo").place(held, loads, 0.0) == []
    assert UnderBudget(index, COST, 1000, "spf").place(held, loads, 0.0) == [(1, 1)]  # 950 <= 1000, fewer tokens
    # aged: the large one, held 1 s at 10,000 tokens a second, goes first -- and still fits nowhere
    assert UnderBudget(index, COST, 1000, "spf").place([held[0], (1, held[1][1], 1.0)], loads, 1.0) == [(1, 1)]


def test_hold_for_holder_waits_when_the_wait_is_cheaper_than_a_prefill_elsewhere() -> None:
    """Replica 0 holds the 4,096-token prompt. At 10,000 tokens in flight against replica 1's 6,000 it
    is over the cap (1.1 x (16,000 + 4,100) / 2 = 11,055): the wait there, (14,100 - 11,055) tokens
    to shed at 10,000 a second, is 0.30 s, with 4 tokens to prefill 0.32 s in all; replica 1 would
    prefill 4,100 tokens in 3 steps: 0.045 + 0.41 = 0.455 s. So it waits, and is bound to replica 0
    once that one drains below replica 1. When requests stay in flight 2 s (the wait 0.61 s), it goes
    to replica 1 at once."""
    index = CacheIndex(2, 1 << 12)
    index.store(0, LONG)
    req = CacheRequest(LONG, 4100, BS)
    hold = HoldForHolder(index, COST, 1.1)
    assert hold.place([(0, req, 0.0)], [load(10_000), load(6000)], 0.0) == []
    assert hold.place([(0, req, 0.0)], [load(5000), load(6000)], 0.5) == [(0, 0)]
    for _ in range(200):
        hold.finished(2.0)
    assert math.isclose(hold.in_flight_s, 2.0, rel_tol=1e-3)
    assert hold.place([(0, req, 0.0)], [load(10_000), load(6000)], 0.0) == [(0, 1)]


def test_hold_for_holder_queues_behind_an_earlier_held_request() -> None:
    """A second request for the same holder counts the first one's tokens ahead of it there: its wait,
    (4,100 + 14,100 - 11,055) / 10,000 = 0.71 s, is dearer than replica 1's 0.455 s prefill, so it goes
    there at once (a second copy of the prefix) while the first waits."""
    index = CacheIndex(2, 1 << 12)
    index.store(0, LONG)
    req = CacheRequest(LONG, 4100, BS)
    hold = HoldForHolder(index, COST, 1.1)
    assert hold.place([(0, req, 0.0), (1, req, 0.0)], [load(10_000), load(6000)], 0.0) == [(1, 1)]


def test_simulated_holding_ends_every_request_once_and_counts_the_wait() -> None:
    spec = TraceSpec(requests=300, tenants=8, context_tokens=512, query_tokens=64, multi_turn=0.0, rate=40.0, seed=9)
    trace = generate(spec)
    free = simulate_late(trace, lambda ix: UnderBudget(ix, COST, math.inf), capacity=256, cost=COST, block_size=BS)
    assert (free.held_share, free.wait_max, free.queue_max) == (0.0, 0.0, 0)
    tight = simulate_late(trace, lambda ix: UnderBudget(ix, COST, 1), capacity=256, cost=COST, block_size=BS)
    # one request per replica at a time: most wait, and their TTFT includes the wait
    assert tight.held_share > 0.5 and tight.queue_max > 0
    assert tight.ttft_p90 >= tight.wait_p90 > 0
    assert tight.ttft_p50 > free.ttft_p50
    # at most one request each: the in-flight figure's samples read 4 / busy replicas at most
    assert tight.inflight_p99 <= 4.0
