"""Cache-aware routing (#29): the cache index, each policy on hand-made states, and a small simulation."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing.cache_index import BlocksEvicted, BlocksStored, CacheIndex, ReplicaReset
from gateway.routing.cache_policy import (
    ApproxRadix,
    CacheRequest,
    CostBased,
    CostModel,
    FirstBlockAffinity,
    LeastLoadedIndex,
    ReplicaLoad,
    RoundRobin,
)
from tests.bench.bench_cache_routing import capacity_for, fleet_rate, policies
from tests.bench.cache_sim import oracle_hit_rate, simulate
from tests.bench.trace_gen import TraceSpec, context_demand_blocks, generate
from transport.common.prefix import chain_hashes

BS = 16
A = chain_hashes(list(range(1, 1 + 6 * BS)), BS)  # 6 blocks
B = chain_hashes(list(range(1, 1 + 2 * BS)) + [999] * (4 * BS), BS)  # A's first 2 blocks, then its own
C = chain_hashes([7] * (3 * BS), BS)  # a stranger


def idle(n: int = 4) -> list[ReplicaLoad]:
    return [ReplicaLoad() for _ in range(n)]


# -- the index ---------------------------------------------------------------------------------

def test_longest_prefix_per_replica() -> None:
    ix = CacheIndex(3, 100)
    ix.store(0, A)
    ix.store(1, A[:2])
    assert ix.longest_prefixes(A) == [6, 2, 0]
    assert ix.longest_prefixes(B) == [2, 2, 0]  # the shared 2 blocks, then B's own miss
    assert ix.longest_prefixes(C) == [0, 0, 0]
    assert [ix.longest_prefix(r, A) for r in range(3)] == [6, 2, 0]


def test_a_hole_in_the_chain_ends_the_prefix() -> None:
    ix = CacheIndex(1, 100)
    ix.store(0, A)
    ix.evict(0, [A[2]])
    assert ix.longest_prefixes(A) == [2]  # blocks 3.. are held but unusable without block 2


def test_lru_evicts_the_tail_of_the_least_recent_chain() -> None:
    ix = CacheIndex(1, 8)
    ix.store(0, A)  # 6 blocks
    ix.store(0, C)  # 3 more: one over
    evicted = ix.store(0, C)  # touching changes nothing
    assert evicted == [] and ix.blocks(0) == 8
    assert ix.longest_prefix(0, A) == 5  # A lost its leaf, not its root
    ix.touch(0, A[:5])
    assert ix.store(0, (C[0], 42)) == [C[2]]  # now C is the least recent: its leaf goes


def test_events_and_reset() -> None:
    ix = CacheIndex(2, 100)
    ix.apply(BlocksStored(0, A))
    ix.apply(BlocksStored(1, A))
    ix.apply(BlocksEvicted(1, A[3:]))
    assert ix.longest_prefixes(A) == [6, 3]
    ix.apply(ReplicaReset(0))
    assert ix.longest_prefixes(A) == [0, 3] and ix.blocks(0) == 0
    ix.apply(BlocksEvicted(1, A + C))  # unknown hashes are ignored
    assert len(ix) == 0


def test_memory_is_bounded_by_capacity() -> None:
    ix = CacheIndex(4, 500)
    for i in range(50_000):  # 50,000 distinct 4-block prompts, 200,000 blocks
        ix.store(i % 4, chain_hashes([i] * (4 * BS), BS))
    assert [ix.blocks(r) for r in range(4)] == [500] * 4
    assert len(ix) <= 4 * 500


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["store", "evict", "reset"]), st.integers(0, 2),
                          st.sampled_from([A, B, C, A[:3], B[:4]]), st.integers(0, 5)), max_size=40))
def test_index_fed_events_matches_the_caches_it_mirrors(ops: list[tuple[str, int, tuple[int, ...], int]]) -> None:
    """A mirror fed each cache's events answers as the cache itself, whatever the sequence."""
    truth, mirror = CacheIndex(3, 7), CacheIndex(3, 7)
    for op, r, chain, k in ops:
        if op == "store":
            evicted = truth.store(r, chain)
            mirror.apply(BlocksStored(r, chain))
            mirror.apply(BlocksEvicted(r, tuple(evicted)))
        elif op == "evict":
            truth.evict(r, chain[k:])
            mirror.apply(BlocksEvicted(r, chain[k:]))
        else:
            truth.reset(r)
            mirror.apply(ReplicaReset(r))
        for q in (A, B, C):
            assert mirror.longest_prefixes(q) == truth.longest_prefixes(q) \
                == [truth.longest_prefix(x, q) for x in range(3)]
        assert all(truth.blocks(x) <= 7 for x in range(3)) and len(truth) == len(mirror)


# -- the policies on hand-made states ----------------------------------------------------------

def req(chain: tuple[int, ...], extra: int = 8) -> CacheRequest:
    return CacheRequest(chain, len(chain) * BS + extra, BS)


def test_round_robin_and_least_loaded() -> None:
    rr = RoundRobin()
    assert [rr.choose(req(A), idle(3)) for _ in range(4)] == [0, 1, 2, 0]
    loads = [ReplicaLoad(3, 1), ReplicaLoad(2, 0), ReplicaLoad(1, 1), ReplicaLoad(2, 1)]
    assert LeastLoadedIndex().choose(req(A), loads) == 1  # scores 4, 2, 2, 3: the first of equals


def test_first_block_affinity_sees_only_the_first_block() -> None:
    ix = CacheIndex(4, 100)
    ix.store(2, A[:1])  # replica 2 holds only A's root
    ix.store(3, A)
    p = FirstBlockAffinity(ix, slack=4)
    loads = [ReplicaLoad(0), ReplicaLoad(0), ReplicaLoad(1), ReplicaLoad(2)]
    assert p.choose(req(A), loads) == 2  # the least loaded root holder, not the one holding all of A
    assert p.choose(req(B), loads) == 2  # B shares the root: same pick
    assert p.choose(req(C), loads) == 0  # no holder: least loaded
    assert p.choose(req(A), [ReplicaLoad(0), ReplicaLoad(0), ReplicaLoad(5), ReplicaLoad(9)]) == 0  # beyond slack


def test_approx_radix_threshold_smallest_tree_and_balance() -> None:
    p = ApproxRadix(4, 1000)
    p.tree.store(1, A)
    p.tree.store(2, C)
    p.tree.store(3, C + (1, 2))
    assert p.choose(req(A), idle()) == 1  # full match
    assert p.choose(req(B, 40), idle()) == 0  # 32 of 136 tokens < 0.3 of the prompt: smallest tree (empty 0)
    assert p.tree.longest_prefix(0, B) == 6  # and it remembers where it sent B
    skewed = [ReplicaLoad(10), ReplicaLoad(80), ReplicaLoad(12), ReplicaLoad(20)]
    assert p.choose(req(A), skewed) == 0  # 80 - 10 > 64 and 80 > 1.5 * 10: shortest queue, match ignored
    # 80 - 40 <= 64: by match again, and A now sits in 0's tree too (the first of the longest)
    assert p.choose(req(A), [ReplicaLoad(40), ReplicaLoad(80), ReplicaLoad(45), ReplicaLoad(50)]) == 0
    assert p.tree.longest_prefixes(A) == [6, 6, 0, 0]


COST = CostModel()


def test_cost_based_follows_the_longest_prefix_when_queues_match() -> None:
    ix = CacheIndex(4, 1000)
    ix.store(1, A[:3])
    ix.store(2, A)
    assert CostBased(ix, COST).choose(req(A), idle()) == 2
    assert CostBased(ix, COST).choose(req(B), idle()) in (1, 2)  # both hold B's 2 shared blocks
    assert CostBased(ix, COST).choose(req(B), idle()) == 1  # tie on cost: the first


def test_cost_based_starts_a_second_copy_when_the_holder_is_saturated() -> None:
    ix = CacheIndex(4, 1000)
    ix.store(2, A)
    p = CostBased(ix, COST)
    full = req(A).prompt_tokens  # what a replica without A must prefill
    # holder's queue costs less than a full prefill elsewhere: stay
    loads = [ReplicaLoad(1, 1, 500), ReplicaLoad(1, 1, 300), ReplicaLoad(1, 1, full - 40), ReplicaLoad(1, 1, 900)]
    assert p.choose(req(A), loads) == 2
    # holder's queue now dearer than the cheapest full prefill: the least queued other replica takes it
    loads[2] = ReplicaLoad(1, 1, 4 * full)
    assert p.choose(req(A), loads) == 1
    est = p.estimates(req(A), loads)
    assert est[1] == min(est) and est[2] > est[1]


def test_cost_based_bounded_load() -> None:
    ix = CacheIndex(4, 1000)
    ix.store(0, A)
    loads = [ReplicaLoad(6), ReplicaLoad(2), ReplicaLoad(2), ReplicaLoad(2)]
    # ceil(1.3 * 13 / 4) = 5: the holder, at 6 in flight, may not take a 7th
    assert CostBased(ix, COST).choose(req(A), loads) == 1
    assert CostBased(ix, COST, bound=2.0).choose(req(A), loads) == 0  # ceil(2 * 13 / 4) = 7


def test_cost_based_bound_bends_for_a_warm_replica() -> None:
    ix = CacheIndex(4, 1000)
    ix.store(0, A)
    loads = [ReplicaLoad(3), ReplicaLoad(1), ReplicaLoad(1), ReplicaLoad(2)]
    # ceil(1.3 * 8 / 4) = 3 keeps a 4th off the holder, but it holds all of A and has nothing to
    # prefill: it may go slack (2) above the mean, 8 / 4 + 2 = 4
    assert CostBased(ix, COST).choose(req(A), loads) == 0
    assert CostBased(ix, COST, slack=0).choose(req(A), loads) == 1
    assert CostBased(ix, COST).choose(req(A), [ReplicaLoad(3, 1), *loads[1:]]) == 1  # a prefill waits there
    assert CostBased(ix, COST).choose(req(B), loads) == 1  # it holds a third of B: not warm
    assert CostBased(ix, COST).choose(req(A), [ReplicaLoad(4), *loads[1:]]) == 1  # 9 / 4 + 2 < 5
    # busier: ceil(1.3 x 29 / 4) = 10 keeps an 11th off; warm, ceil(1.5 x 29 / 4) = 11 lets it on
    busy = [ReplicaLoad(10), ReplicaLoad(6), ReplicaLoad(6), ReplicaLoad(6)]
    assert CostBased(ix, COST).choose(req(A), busy) == 0
    assert CostBased(ix, COST, warm_bound=1.3).choose(req(A), busy) == 1


# -- a small simulation ------------------------------------------------------------------------

def test_trace_is_seeded_and_sessions_grow() -> None:
    spec = TraceSpec(requests=300, tenants=8, context_tokens=256, multi_turn=0.5, max_turns=3, rate=50.0, seed=9)
    a, b = generate(spec), generate(spec)
    assert a == b and a != generate(replace(spec, seed=10)) and len(a) == 300
    assert all(x.t <= y.t for x, y in zip(a, a[1:], strict=False))  # follow-ups interleave in time order
    follow = [r for r in a if r.turn > 0]
    assert follow
    for r in follow[:20]:
        prev = next(p for p in a if p.session == r.session and p.turn == r.turn - 1)
        assert r.chain[:len(prev.chain)] == prev.chain and r.prompt_tokens > prev.prompt_tokens
    assert context_demand_blocks(spec) == 8 * 256 // 16


def test_trace_hot_tenant_common_prefix_and_bursts() -> None:
    n = 2000
    spec = TraceSpec(requests=n, tenants=16, context_tokens=64, common_tokens=64, multi_turn=0.0, hot_share=0.5,
                     rate=20.0, seed=3)
    trace = generate(spec)
    share = sum(r.tenant == 0 for r in trace) / n
    assert abs(share - 0.5) < 4.5 * (0.25 / n) ** 0.5  # binomial: 4.5 standard deviations
    assert len({r.chain[:4] for r in trace}) == 1  # the common 64 tokens: one 4-block prefix for all
    assert len({r.chain[:8] for r in trace}) == 16  # then one context per tenant

    def window_counts(arrivals: str) -> list[int]:
        ts = [r.t for r in generate(replace(spec, arrivals=arrivals, burst_s=5.0))]
        counts = [0] * (int(ts[-1]) + 1)
        for t in ts:
            counts[int(t)] += 1
        return counts

    def dispersion(xs: list[int]) -> float:  # variance / mean: 1 for Poisson counts
        m = sum(xs) / len(xs)
        return sum((x - m) ** 2 for x in xs) / len(xs) / m

    assert dispersion(window_counts("poisson")) < 1.5 < 3 < dispersion(window_counts("bursty"))


@pytest.mark.parametrize("common", [0, 512], ids=["tenant-first", "common-system-prompt"])
def test_cost_based_beats_round_robin_and_first_block_affinity(common: int) -> None:
    """Against an ideal fleet cache: more hits and a lower p90 TTFT than round robin and today's
    first-block affinity, with requests per replica within the policy's load bound."""
    spec = TraceSpec(requests=600, tenants=32, context_tokens=2048, common_tokens=common,
                     multi_turn=0.3 if not common else 0.0, seed=5 + common)
    cap = capacity_for(spec, 0.73)
    rate = fleet_rate(spec, oracle_hit_rate(generate(spec), cap * 4, BS), 0.7)
    trace = generate(replace(spec, rate=rate))
    makers = policies(4, cap, COST)
    rr, _, affinity, _, ours = (simulate(trace, mk, capacity=cap, cost=COST, block_size=BS) for mk in makers[:5])
    assert (rr.policy, affinity.policy, ours.policy) == ("round_robin", "prefix_affinity", "cost_based")
    assert ours.hit_rate > max(rr.hit_rate, affinity.hit_rate)
    assert ours.ttft_p90 < min(rr.ttft_p90, affinity.ttft_p90)
    assert ours.imbalance <= 1.3
