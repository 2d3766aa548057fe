"""Cache-aware routing policies over replica indices (sans-I/O; issue #29's first milestone).

A policy sees a :class:`CacheRequest` (the prompt's block hash chain and its length in
tokens) and one :class:`ReplicaLoad` per replica, and returns the replica's index. Replicas
are numbered as in a :class:`~gateway.routing.cache_index.CacheIndex`. The simulator
(``tests/bench/cache_sim.py``) drives them today; the gateway's pool will adapt its
``WorkerConnection``\\ s to this shape when workers publish KV events.

- :class:`RoundRobin`, :class:`LeastLoadedIndex`: the anchors that ignore caches.
- :class:`FirstBlockAffinity`: today's :class:`~gateway.routing.policy.PrefixAffinity`
  (the replica holding the prompt's first block unless ``slack`` busier).
- :class:`ApproxRadix`: SGLang's ``cache_aware``: its own guess of each replica's tree (what it
  routed there, LRU-bounded), longest match if above ``cache_threshold`` of the prompt, the
  smallest tree otherwise, the shortest queue when loads drift apart.
- :class:`CostBased`: ours. Estimated time to first token on each replica, from the exact
  index (uncached tokens there) and its queued work, by a :class:`CostModel`. A hot prefix's
  holders, once their queues make them dearer than a full prefill elsewhere, lose the next
  request to the replica where that prefill costs least, which then holds a second copy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from gateway.routing.cache_index import CacheIndex

__all__ = ["CacheRequest", "ReplicaLoad", "CostModel", "CachePolicy", "RoundRobin", "LeastLoadedIndex",
           "FirstBlockAffinity", "ApproxRadix", "CostBased"]


class CacheRequest(NamedTuple):
    chain: tuple[int, ...]  # the prompt's block hash chain (transport.common.prefix.chain_hashes)
    prompt_tokens: int
    block_size: int


class ReplicaLoad(NamedTuple):
    """A replica's load as a gateway can know it (its own in-flight requests and the worker's stats)."""

    in_flight: int = 0  # requests sent and not finished
    queued: int = 0  # of those, waiting for their prefill
    queued_tokens: int = 0  # prefill tokens still to compute, queued requests' and the running chunk's
    running: int = 0  # sequences decoding
    tokens: int = 0  # prompt tokens of the requests in flight (the simulator's truth; no policy here reads it)


@dataclass(frozen=True, slots=True)
class CostModel:
    """An engine with chunked prefill: each step computes up to ``chunk`` prefill tokens at
    ``prefill_s`` each plus one token for every running sequence, in ``decode_s + decode_seq_s * b``."""

    prefill_s: float = 1e-4
    decode_s: float = 0.015
    decode_seq_s: float = 3e-4
    chunk: int = 2048

    def step_s(self, prefill_tokens: int, running: int) -> float:
        return self.decode_s + self.decode_seq_s * running + self.prefill_s * prefill_tokens

    def prefill_wait_s(self, tokens: int, running: int) -> float:
        """Time to compute ``tokens`` prefill tokens (ahead in the queue, then ours) with ``running`` decoding."""
        steps = max(1, -(-tokens // self.chunk))
        return steps * (self.decode_s + self.decode_seq_s * running) + self.prefill_s * tokens


class CachePolicy(Protocol):
    name: str

    def choose(self, req: CacheRequest, loads: Sequence[ReplicaLoad]) -> int:
        """The index of the replica that takes ``req`` (``loads`` has one entry per replica)."""
        ...


def _load_score(x: ReplicaLoad) -> int:
    return x.in_flight + x.queued  # policy.load_score with the worker's view equal to ours


def _least_loaded(loads: Sequence[ReplicaLoad]) -> int:
    return min(range(len(loads)), key=lambda r: _load_score(loads[r]))


class RoundRobin:
    __slots__ = ("_next",)
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, req: CacheRequest, loads: Sequence[ReplicaLoad]) -> int:
        r = self._next % len(loads)
        self._next = r + 1
        return r


class LeastLoadedIndex:
    __slots__ = ()
    name = "least_loaded"

    def choose(self, req: CacheRequest, loads: Sequence[ReplicaLoad]) -> int:
        return _least_loaded(loads)


class FirstBlockAffinity:
    """:class:`~gateway.routing.policy.PrefixAffinity` over the index: first block only."""

    __slots__ = ("index", "slack")
    name = "prefix_affinity"

    def __init__(self, index: CacheIndex, slack: int = 4) -> None:
        self.index, self.slack = index, slack

    def choose(self, req: CacheRequest, loads: Sequence[ReplicaLoad]) -> int:
        best = _least_loaded(loads)
        if not req.chain:
            return best
        root = req.chain[0]
        holders = [r for r in range(len(loads)) if self.index.holds(r, root)]
        if holders:
            hit = min(holders, key=lambda r: _load_score(loads[r]))
            if _load_score(loads[hit]) <= _load_score(loads[best]) + self.slack:
                return hit
        return best


class ApproxRadix:
    """SGLang's ``cache_aware``: a guessed tree per replica (what was routed there, LRU-capped
    at ``tree_blocks``), no events."""

    __slots__ = ("tree", "cache_threshold", "abs_threshold", "rel_threshold")
    name = "approx_radix"

    def __init__(self, replicas: int, tree_blocks: int, cache_threshold: float = 0.3,
                 abs_threshold: int = 64, rel_threshold: float = 1.5) -> None:
        self.tree = CacheIndex(replicas, tree_blocks)
        self.cache_threshold, self.abs_threshold, self.rel_threshold = cache_threshold, abs_threshold, rel_threshold

    def choose(self, req: CacheRequest, loads: Sequence[ReplicaLoad]) -> int:
        inflight = [x.in_flight for x in loads]
        hi, lo = max(inflight), min(inflight)
        if hi - lo > self.abs_threshold and hi > self.rel_threshold * lo:
            r = inflight.index(lo)
        else:
            matched = self.tree.longest_prefixes(req.chain)
            best = max(range(len(loads)), key=lambda i: matched[i])
            rate = matched[best] * req.block_size / max(1, req.prompt_tokens)
            if rate > self.cache_threshold:
                r = best
            else:
                r = min(range(len(loads)), key=self.tree.blocks)
        self.tree.store(r, req.chain)
        return r


class CostBased:
    """Least estimated TTFT: ``cost.prefill_wait_s(queued + uncached here, running)``, uncached
    from the exact index, among the replicas under a bounded load: at most ``bound`` times the
    mean in-flight requests (rounded up), so a cheap hit never piles onto one replica. A
    saturated holder of a hot prefix thus sends the next request to the cheapest full prefill
    elsewhere, which becomes a second holder; ties go to the less loaded.

    The bound bends for a *warm* replica -- one that holds at least ``warm_share`` of the prompt
    and has no prefill waiting (a conversation's next turn, at once) --, which may hold up to
    ``warm_bound`` times the mean (rounded up) or ``slack`` requests above it, whichever is more:
    under the one bound conversations were moved off their history when their replica was busy
    (T3: 0.961x the ideal; 0.962-0.976x over four seeds with the slack alone, 0.981-0.988x with
    both), while a hot prefix's holders, whose prefills queue, still hand the next request on."""

    __slots__ = ("index", "cost", "bound", "slack", "warm_bound", "warm_share", "name")

    def __init__(self, index: CacheIndex, cost: CostModel, bound: float = 1.3, slack: float = 2.0,
                 warm_share: float = 0.5, warm_bound: float = 1.5) -> None:
        self.index, self.cost, self.bound, self.slack, self.warm_share = index, cost, bound, slack, warm_share
        self.warm_bound = max(bound, warm_bound)
        changed = [f"{k}={v}" for k, v, default in (("bound", bound, 1.3), ("slack", slack, 2.0),
                                                    ("warm_bound", warm_bound, 1.5)) if v != default]
        self.name = f"cost_based({', '.join(changed)})" if changed else "cost_based"

    def estimates(self, req: CacheRequest, loads: Sequence[ReplicaLoad], cached: Sequence[int] | None = None
                  ) -> list[float]:
        """Estimated seconds to first token per replica (``cached``: its held blocks of the chain,
        from the index when not given)."""
        if cached is None:
            cached = self.index.held_prefixes(req.chain)
        wait, p, bs = self.cost.prefill_wait_s, req.prompt_tokens, req.block_size
        return [wait(x.queued_tokens + max(0, p - c * bs), x.running) for x, c in zip(loads, cached, strict=True)]

    def choose(self, req: CacheRequest, loads: Sequence[ReplicaLoad]) -> int:
        cached = self.index.held_prefixes(req.chain)
        need = self.warm_share * req.prompt_tokens
        warm = [c * req.block_size >= need and x.queued == 0 for x, c in zip(loads, cached, strict=True)]
        return self.pick([x.in_flight for x in loads], self.estimates(req, loads, cached),
                         [_load_score(x) for x in loads], warm)

    def pick(self, in_flight: Sequence[int], estimates: Sequence[float], scores: Sequence[int],
             warm: Sequence[bool] = ()) -> int:
        """The replica of least estimate among those under the bound, then of least score (in-flight
        requests plus queued ones); the first of equals. One entry per replica in each list
        (``warm``: which may go to the warm bound; none when empty)."""
        mean = (sum(in_flight) + 1) / len(in_flight)
        cap = self.bound * mean
        cap = math.ceil(cap) if cap < math.inf else cap
        bent = self.warm_bound * mean
        bent = max(cap, math.ceil(bent) if bent < math.inf else bent, mean + self.slack)
        best, best_key = 0, (True, math.inf, 0)
        for r, n in enumerate(in_flight):
            key = (n + 1 > (bent if warm and warm[r] else cap), estimates[r], scores[r])
            if key < best_key:
                best, best_key = r, key
        return best
