"""``[routing] policy = "cache_aware"`` in the pool (#29): the index fed from each replica's KV
events (full set, batches, a gap, a new epoch, a replica gone), the pick, and what a pool of one
replica does not pay (no tokenizing, no hashing)."""

from __future__ import annotations

import random

from gateway.routing.cache_aware import CacheAware
from gateway.routing.cache_metrics import cache_routing_metrics
from gateway.routing.config import RoutingSettings
from gateway.routing.pool import ModelPool
from gateway.routing.prefix import ChainMemo, PrefixHasher
from gateway.routing.routed import SubmitFactory
from tests.gateway.kv_doubles import KvWorker
from transport.common.prefix import chain_hashes
from transport.messages import Stats, Submit

BS = 16
rng = random.Random(7)
DOC = [rng.randrange(32, 127) for _ in range(40 * BS)]  # a 640-token shared document
OTHER = [rng.randrange(32, 127) for _ in range(40 * BS)]


def prompt(doc: list[int], query: int) -> list[int]:
    return doc + [query] * 24


def submit_of(ids: list[int]) -> SubmitFactory:
    return lambda rid: Submit(rid, "tiny", prompt_token_ids=tuple(ids))


def pool_of(workers: list[KvWorker], now: list[float] | None = None) -> tuple[ModelPool, CacheAware]:
    clock = now if now is not None else [0.0]
    policy = CacheAware(now=lambda: clock[0])
    pool = ModelPool(policy=policy)
    for w in workers:
        pool.add(w)  # type: ignore[arg-type]
    return pool, policy


def test_routes_a_long_prefix_to_the_replica_that_holds_it() -> None:
    ws = [KvWorker(f"w{i}") for i in range(4)]
    pool, policy = pool_of(ws)
    assert [w.subscriptions for w in ws] == [1, 1, 1, 1]  # each subscribed once, answered with its (empty) set
    ws[2].store(chain_hashes(DOC, BS))
    ws[1].store(chain_hashes(OTHER, BS))
    for q in range(5):
        assert pool.choose("tiny", None, make_submit=submit_of(prompt(DOC, q))) is ws[2]
        assert pool.choose("tiny", None, make_submit=submit_of(prompt(OTHER, q))) is ws[1]
    assert policy.unhashed == 0


def test_a_saturated_holder_gives_the_next_request_to_a_second_replica() -> None:
    ws = [KvWorker(f"w{i}") for i in range(4)]
    pool, _ = pool_of(ws)
    ws[0].store(chain_hashes(DOC, BS))
    ws[0].in_flight = 6  # beyond 1.3 x the mean (+1): the bound
    ws[1].in_flight = ws[2].in_flight = ws[3].in_flight = 1
    assert pool.choose("tiny", None, make_submit=submit_of(prompt(DOC, 1))) is ws[1]


def test_the_bound_bends_for_a_warm_holder_with_nothing_to_prefill() -> None:
    ws = [KvWorker(f"w{i}") for i in range(4)]
    now = [0.0]
    pool, _ = pool_of(ws, now)
    ws[0].store(chain_hashes(DOC, BS))
    ws[0].in_flight, ws[1].in_flight, ws[2].in_flight, ws[3].in_flight = 3, 1, 1, 2
    # ceil(1.3 x 8 / 4) = 3 in flight, but it holds the prompt and nothing waits there: up to 8 / 4 + 2
    assert pool.choose("tiny", None, make_submit=submit_of(prompt(DOC, 1))) is ws[0]
    # at once again: the query it was just sent is still to prefill there (the policy's backlog)
    assert pool.choose("tiny", None, make_submit=submit_of(prompt(DOC, 2))) is ws[1]
    now[0] = 10.0  # done; but its Stats now say a prefill waits
    ws[0].latest_stats = Stats(queue_depth=1, running=2, kv_blocks_free=100, kv_blocks_total=200)
    assert pool.choose("tiny", None, make_submit=submit_of(prompt(DOC, 3))) is ws[1]


def test_evictions_a_gap_and_a_new_epoch() -> None:
    w0, w1 = KvWorker("w0"), KvWorker("w1")
    pool, policy = pool_of([w0, w1])
    chain = chain_hashes(DOC, BS)
    w0.store(chain)
    index, slot = policy.index, policy.feed.slots([w0])[0]
    assert index.longest_prefix(slot, chain) == 40
    w0.evict(chain[30:])
    assert index.longest_prefix(slot, chain) == 30
    w0.store(chain[30:35], lost=True)  # a batch the gateway never sees
    w0.store(chain[35:])  # the next one shows the gap: resync, which brings the full set
    assert w0.subscriptions == 2 and policy.feed.resyncs == 1
    assert index.longest_prefix(slot, chain) == 40
    w0.restart_cache(epoch=9)  # emptied: its next Stats say so, the next choice sees it at once
    pool.choose("tiny", None, make_submit=submit_of(prompt(DOC, 0)))
    assert index.blocks(slot) == 0 and policy.feed.epochs == 1 and w0.subscriptions == 3
    w0.store(chain[:5], lost=True)
    w0.stats()  # Stats after it name its seq
    pool.choose("tiny", None, make_submit=submit_of(prompt(DOC, 0)))  # Stats' kv_seq is past what was seen
    assert w0.subscriptions == 4 and index.longest_prefix(slot, chain) == 5


def test_a_replica_that_leaves_takes_its_entries_and_a_newcomer_starts_empty() -> None:
    w0, w1 = KvWorker("w0"), KvWorker("w1")
    pool, policy = pool_of([w0, w1])
    w0.store(chain_hashes(DOC, BS))
    slot = policy.feed.slots([w0])[0]
    pool.remove(w0)  # type: ignore[arg-type]
    assert policy.index.blocks(slot) == 0 and len(policy.index) == 0
    w2 = KvWorker("w2", epoch=3)
    pool.add(w2)  # type: ignore[arg-type]
    assert policy.feed.slots([w2]) == [slot]  # the slot is reused, empty


def test_an_old_worker_without_kv_events_routes_by_load() -> None:
    old, new = KvWorker("old", kv_events=False), KvWorker("new")
    pool, policy = pool_of([old, new])
    assert old.subscriptions == 0 and policy.feed.slots([old, new])[0] == -1
    new.in_flight = 3
    assert pool.choose("tiny", None, make_submit=submit_of(prompt(DOC, 0))) is old


def test_one_replica_costs_no_tokenizing_or_hashing() -> None:
    calls: list[str] = []

    class Tok:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            calls.append(text)
            return list(text.encode())

        def encode_chat(self, messages: object, add_generation_prompt: bool = True) -> list[int]:
            raise AssertionError

    w = KvWorker("w0")
    pool, _ = pool_of([w])
    assert pool.prefix is not None
    pool.prefix = PrefixHasher(CacheAware.hash_blocks, load=lambda model: Tok())
    text = "x" * 2048
    assert pool.choose("tiny", None, make_submit=lambda rid: Submit(rid, "tiny", prompt=text)) is w
    assert calls == []
    pool.add(KvWorker("w1"))  # type: ignore[arg-type]
    pool.choose("tiny", None, make_submit=lambda rid: Submit(rid, "tiny", prompt=text))
    assert calls == [text]


def test_the_setting_builds_it_with_its_cost_model() -> None:
    built = RoutingSettings(policy="cache_aware", cache_load_bound=1.5, cache_prefill_us_per_token=50,
                            cache_index_blocks=1000).build()  # fmt: skip
    assert isinstance(built, CacheAware)
    assert built.core.bound == 1.5 and built.cost.prefill_s == 50e-6 and built.feed.max_blocks == 1000
    problems: list[str] = []
    RoutingSettings(policy="cache_aware", cache_load_bound=0.5)._validate(problems)
    assert problems and "cache_load_bound" in problems[0]


def test_the_memo_hashes_as_the_worker_does() -> None:
    memo = ChainMemo(max_edges=64)
    r = random.Random(3)
    for _ in range(200):
        ids = (DOC if r.random() < 0.5 else OTHER)[: r.randrange(0, 640)] + [r.randrange(1 << 32)
                                                                             for _ in range(r.randrange(0, 80))]
        bs, limit = r.choice([1, 4, 16]), r.choice([2, 40, 4096])
        assert memo.chain(ids, bs, limit) == chain_hashes(ids, bs, limit)
    assert memo.edges <= 64 + 640  # bounded: it starts over at max_edges


def test_the_feeds_counters_are_on_metrics() -> None:
    w0, w1 = KvWorker("w0"), KvWorker("w1")
    pool, policy = pool_of([w0, w1])
    chain = chain_hashes(DOC, BS)
    w0.store(chain)
    w0.store(chain[:3], lost=True)
    w0.store(chain[3:6])  # a gap: a resync
    w1.restart_cache(epoch=5)  # a new epoch, seen in its Stats at the next choice
    pool.choose("tiny", None, make_submit=submit_of(prompt(DOC, 0)))
    pool.choose("tiny", None, make_submit=lambda rid: Submit(rid, "tiny", prompt_token_ids=(-1,) * 40))  # unhashable
    got = {m.name: m.samples[0].value for m in cache_routing_metrics(pool)}
    assert got == {"quicserve_cache_routing_unhashed": 1, "quicserve_cache_routing_resyncs": 2,
                   "quicserve_cache_routing_epochs": 1, "quicserve_cache_index_hashes": len(chain)}
    assert list(cache_routing_metrics(ModelPool())) == []  # another policy: none


def test_round_robin_the_baseline_takes_each_replica_in_turn() -> None:
    ws = [KvWorker(f"w{i}") for i in range(3)]
    pool = ModelPool(policy=RoutingSettings(policy="round_robin").build())
    for w in ws:
        pool.add(w)  # type: ignore[arg-type]
    ws[0].in_flight = 9  # load does not matter to it
    picks = [pool.choose("tiny", None) for _ in range(6)]
    assert picks == [ws[1], ws[2], ws[0], ws[1], ws[2], ws[0]] and pool.prefix is None
