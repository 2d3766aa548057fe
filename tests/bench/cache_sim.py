"""Cache-aware routing in simulated time: policies over a trace, against an ideal cache.

How it works: ``replicas`` engines, each an LRU prefix cache of ``capacity`` blocks (a
:class:`~gateway.routing.cache_index.CacheIndex` of one row per replica: the truth) and a
chunked-prefill engine by a :class:`~gateway.routing.cache_policy.CostModel`: each step
computes up to ``chunk`` queued prefill tokens (FIFO) and one token of every running
sequence. A request's first token comes at the end of the step that finishes its prefill; it
then decodes ``output_tokens - 1`` more steps. At each arrival every replica is advanced to
that time, the policy sees their loads and picks one; the prompt's longest prefix held there
is its hit (the rest is prefill work), and its chain is stored there. The truth's stored and
evicted blocks are replayed as events into the index the exact policies read, as workers'
KV events will be.

Simplifications: blocks count as held from the moment a request is routed (a queued twin
shares them); the KV memory of running sequences is not taken from the prefix cache.

The oracle is one LRU cache of ``replicas * capacity`` blocks seeing the whole trace in order.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.routing.cache_index import BlocksEvicted, BlocksStored, CacheIndex
from gateway.routing.cache_policy import CachePolicy, CacheRequest, CostModel, ReplicaLoad

from .trace_gen import TraceRequest

__all__ = ["SimResult", "simulate", "oracle_hit_rate", "percentile", "steady_end", "bind", "placement_floor",
           "sample_balance"]


def percentile(xs: Sequence[float], p: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]


@dataclass(frozen=True, slots=True)
class SimResult:
    policy: str
    hit_rate: float  # prompt tokens served from cache / prompt tokens
    ttft_p50: float
    ttft_p90: float
    imbalance: float  # max / mean requests per replica
    inflight_p99: float  # p99 over 100 ms samples of max / mean in-flight tokens per replica
    per_replica: tuple[int, ...]
    floor_p99: float = 0.0  # p99 of placement_floor at the same samples: the best any placement of those requests reads


class _Replica:
    __slots__ = ("cost", "clock", "step", "waiting", "queued_tokens", "running", "inflight_tokens", "ttft", "trace")

    def __init__(self, cost: CostModel, ttft: list[float], trace: Sequence[TraceRequest]) -> None:
        self.cost, self.ttft, self.trace = cost, ttft, trace
        self.clock = 0.0
        self.step = 0
        self.waiting: deque[list[int]] = deque()  # [request, prefill tokens left]
        self.queued_tokens = 0
        self.running: list[tuple[int, int]] = []  # (last step, request)
        self.inflight_tokens = 0

    def load(self) -> ReplicaLoad:
        w, r = len(self.waiting), len(self.running)
        return ReplicaLoad(w + r, w, self.queued_tokens, r, self.inflight_tokens)

    def submit(self, rid: int, uncached: int) -> None:
        self.waiting.append([rid, uncached])
        self.queued_tokens += uncached
        self.inflight_tokens += self.trace[rid].prompt_tokens

    def _finish(self) -> None:
        while self.running and self.running[0][0] <= self.step:
            _, rid = heapq.heappop(self.running)
            self.inflight_tokens -= self.trace[rid].prompt_tokens

    def advance(self, until: float) -> None:
        cost = self.cost
        while self.clock < until:
            if self.waiting:
                budget, used, done = cost.chunk, 0, []
                while self.waiting and budget:
                    w = self.waiting[0]
                    take = min(budget, w[1])
                    w[1] -= take
                    used += take
                    budget -= take
                    if w[1] == 0:
                        done.append(self.waiting.popleft()[0])
                self.clock += cost.step_s(used, len(self.running))
                self.step += 1
                self.queued_tokens -= used
                self._finish()
                for rid in done:
                    req = self.trace[rid]
                    self.ttft[rid] = self.clock - req.t
                    heapq.heappush(self.running, (self.step + max(0, req.output_tokens - 1), rid))
                self._finish()
            elif self.running:
                dt = cost.step_s(0, len(self.running))
                n = max(1, min(self.running[0][0] - self.step, math.ceil((until - self.clock) / dt)))
                self.clock += n * dt
                self.step += n
                self._finish()
            else:
                self.clock = until


def simulate(trace: Sequence[TraceRequest], make_policy: Callable[[CacheIndex], CachePolicy], *,
             replicas: int = 4, capacity: int, cost: CostModel, block_size: int,
             sample_s: float = 0.1, measure_from: int = 0, gateways: int = 1, stats_s: float = 0.0,
             sample_until: float = math.inf) -> SimResult:
    """Run ``trace`` through the policy ``make_policy(index)`` builds (the index is exact: fed
    the replicas' stored/evicted events); figures over the requests from ``measure_from`` on (the
    ones before: a warm-up).

    ``gateways`` > 1: request ``i`` goes through gateway ``i % gateways``, each with its own policy
    and its own index, fed the same events. ``stats_s`` > 0: a gateway sees each replica's load as
    its Stats every ``stats_s`` said it, plus what this gateway sent there since (else the truth).
    ``sample_until``: the in-flight token samples stop there (:func:`steady_end`)."""
    truth = CacheIndex(replicas, capacity)
    indexes = [CacheIndex(replicas, capacity) for _ in range(gateways)]
    routers = [make_policy(ix) for ix in indexes]
    ttft = [math.nan] * len(trace)
    reps = [_Replica(cost, ttft, trace) for _ in range(replicas)]
    counts = [0] * replicas
    hit = total = 0
    samples: list[float] = []
    floors: list[float] = []
    next_sample = sample_s
    stats: list[ReplicaLoad] = [ReplicaLoad()] * replicas
    # per gateway and replica: (requests, prefill tokens, prompt tokens) sent since the last Stats
    since = [[(0, 0, 0)] * replicas for _ in range(gateways)]
    next_stats = 0.0
    for rid, req in enumerate(trace):
        while next_sample <= req.t:
            for rep in reps:
                rep.advance(next_sample)
            if rid >= measure_from and next_sample <= sample_until:
                sample_balance(reps, samples, floors)
            next_sample += sample_s
        for rep in reps:
            rep.advance(req.t)
        g = rid % gateways
        if stats_s > 0:
            if req.t >= next_stats:
                stats = [rep.load() for rep in reps]
                since = [[(0, 0, 0)] * replicas for _ in range(gateways)]
                next_stats = req.t + stats_s
            loads = [ReplicaLoad(x.in_flight + n, x.queued + n, x.queued_tokens + t, x.running, x.tokens + p)
                     for x, (n, t, p) in zip(stats, since[g], strict=True)]
        else:
            loads = [rep.load() for rep in reps]
        r = routers[g].choose(CacheRequest(req.chain, req.prompt_tokens, block_size), loads)
        cached = bind(truth, indexes, reps[r], r, rid, req, block_size)
        if stats_s > 0:
            n, t, p = since[g][r]
            since[g][r] = (n + 1, t + req.prompt_tokens - cached, p + req.prompt_tokens)
        if rid >= measure_from:
            counts[r] += 1
            hit += cached
            total += req.prompt_tokens
    for rep in reps:
        _drain(rep)
    done = [x for x in ttft[measure_from:] if not math.isnan(x)]
    return SimResult(routers[0].name, hit / max(1, total), percentile(done, 50), percentile(done, 90),
                     max(counts) * replicas / max(1, sum(counts)), percentile(samples, 99), tuple(counts),
                     percentile(floors, 99))


def bind(truth: CacheIndex, indexes: Sequence[CacheIndex], rep: _Replica, r: int, rid: int, req: TraceRequest,
         block_size: int) -> int:
    """Send request ``rid`` to replica ``r``: its hit is the longest prefix the truth holds there (all
    but its last token at most), its chain is stored there and the truth's events replayed into each
    gateway's index. Returns the cached tokens."""
    cached = min(truth.longest_prefix(r, req.chain) * block_size, req.prompt_tokens - 1)
    evicted = truth.store(r, req.chain)
    for index in indexes:
        index.apply(BlocksStored(r, req.chain))
        if evicted:
            index.apply(BlocksEvicted(r, tuple(evicted)))
    rep.submit(rid, req.prompt_tokens - cached)
    return cached


def placement_floor(sizes: Sequence[int], replicas: int) -> float:
    """The least max/mean any placement of requests of these prompt sizes on ``replicas`` could read:
    some replica holds at least ceil(j / replicas) of the j largest, each at least the j-th largest,
    and at least the mean. What a router that sends every request on arrival cannot beat at a sample
    whatever it chose (for the requests in flight then)."""
    s = sorted(sizes, reverse=True)
    total = sum(s)
    if not total:
        return 0.0
    best = total / replicas
    for j, x in enumerate(s, 1):
        best = max(best, -(-j // replicas) * x)
    return best * replicas / total


def _in_flight_sizes(reps: Sequence[_Replica]) -> list[int]:
    """The prompt tokens of every request in flight on these replicas."""
    return [rep.trace[w[0]].prompt_tokens for rep in reps for w in rep.waiting] + \
        [rep.trace[rid].prompt_tokens for rep in reps for _, rid in rep.running]


def sample_balance(reps: Sequence[_Replica], samples: list[float], floors: list[float]) -> bool:
    """One balance sample, unless nothing is in flight: max / mean in-flight tokens per replica onto
    ``samples``, the :func:`placement_floor` of the same requests onto ``floors``; whether taken."""
    tok = [rep.inflight_tokens for rep in reps]
    if not sum(tok):
        return False
    samples.append(max(tok) * len(reps) / sum(tok))
    floors.append(placement_floor(_in_flight_sizes(reps), len(reps)))
    return True


def steady_end(trace: Sequence[TraceRequest]) -> float:
    """The arrival of the trace's last opening request (a single turn or a conversation's first): the
    balance is sampled up to there, alike for every policy. After it only the open conversations'
    last turns come, fewer and fewer (T3's last 10% of time holds 16 of its 2,212 requests: one
    conversation in flight reads 4.00 under any policy), which measures the trace's tail, not the
    router; in T1 and T2 requests open to the end, so that is the whole trace."""
    return max((r.t for r in trace if r.turn == 0), default=math.inf)


def _drain(rep: _Replica) -> None:
    while rep.waiting or rep.running:
        rep.advance(rep.clock + 60.0)


def oracle_hit_rate(trace: Sequence[TraceRequest], capacity: int, block_size: int, measure_from: int = 0) -> float:
    """The hit rate of one ideal LRU cache of ``capacity`` blocks seeing the whole trace (over the
    requests from ``measure_from`` on)."""
    cache = CacheIndex(1, capacity)
    hit = total = 0
    for i, req in enumerate(trace):
        cached = min(cache.longest_prefix(0, req.chain) * block_size, req.prompt_tokens - 1)
        cache.store(0, req.chain)
        if i >= measure_from:
            hit += cached
            total += req.prompt_tokens
    return hit / max(1, total)
