"""Late binding at the gateway in simulated time: does holding requests reach issue #29's balance line?

The line: max/mean of in-flight prompt tokens per replica, sampled every 100 ms, <= 1.2 at the p99
sample, with the token hit rate >= 0.97x the ideal cache's and TTFT no worse than cost_based's.

How it works: the replicas, caches and samples of :mod:`tests.bench.cache_sim`, but a request is not
sent on arrival: it joins the gateway's queue, and at every event (an arrival, a replica's step end
while something is held) a *binder* says which held requests go where now; the rest wait. Time held
counts in TTFT (measured from arrival); held requests are not in flight at any replica, so the
samples do not count them -- the result says how many waited, how long, and how many were held at
most, so where requests wait is in the figures. Two binders:

- :class:`UnderBudget` (``tokens:M``): a fixed budget of ``M`` times the trace's mean prompt per
  replica; the queue's head (FIFO, or ``spf``: shortest prompt first, aged) goes to the least
  estimated TTFT (:meth:`~gateway.routing.cache_policy.CostBased.estimates`) among the replicas whose
  in-flight tokens stay within the budget with it (an idle replica always takes one); none: it waits.
- :class:`HoldForHolder` (``share:K``): the cap follows the load, ``K`` times the mean in-flight
  tokens with the request (the replica with the fewest always under it); each held request, in
  arrival order, goes where its estimated TTFT *plus* its expected wait is least -- the wait for a
  replica over the cap being the tokens it must shed first over its drain rate (its in-flight tokens
  over the mean time a request stays in flight, measured) -- so a request waits for the replica that
  holds its prefix when that is cheaper than prefilling it elsewhere, and is bound when that replica
  is under the cap.

Run through ``bench_cache_routing --late-binding tokens:4,8 share:1.1,1.2``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.routing.cache_index import CacheIndex
from gateway.routing.cache_policy import CacheRequest, CostBased, CostModel, ReplicaLoad

from .cache_sim import _drain, _Replica, bind, percentile, sample_balance
from .trace_gen import TraceRequest

__all__ = ["Binder", "UnderBudget", "HoldForHolder", "LateResult", "simulate_late", "binder_maker"]

Held = tuple[int, CacheRequest, float]  # (request id, what the policy sees, arrival time)


class Binder(Protocol):
    name: str

    def place(self, held: Sequence[Held], loads: Sequence[ReplicaLoad], now: float) -> list[tuple[int, int]]:
        """(position in ``held``, replica) for each request bound now; the others stay held."""
        ...

    def finished(self, in_flight_s: float) -> None:
        """A request bound ``in_flight_s`` ago has finished."""
        ...


class UnderBudget:
    """A fixed per-replica budget of in-flight prompt tokens (see the module)."""

    __slots__ = ("core", "budget", "order", "aging", "name")

    def __init__(self, index: CacheIndex, cost: CostModel, budget: float, order: str = "fifo",
                 aging: float = 10_000.0, label: str = "") -> None:
        self.core = CostBased(index, cost, math.inf)
        self.budget, self.order, self.aging = budget, order, aging  # aging: prompt tokens a second held
        self.name = f"hold {label or budget} {order}"

    def place(self, held: Sequence[Held], loads: Sequence[ReplicaLoad], now: float) -> list[tuple[int, int]]:
        tok = [x.tokens for x in loads]
        loads = list(loads)
        order = range(len(held))
        if self.order == "spf":
            order = sorted(order, key=lambda k: held[k][1].prompt_tokens - self.aging * (now - held[k][2]))
        out: list[tuple[int, int]] = []
        for k in order:
            req = held[k][1]
            p = req.prompt_tokens
            ok = [t == 0 or t + p <= self.budget for t in tok]
            if not any(ok):
                if self.order == "fifo":
                    break
                continue
            est = self.core.estimates(req, loads)
            r = min((r for r in range(len(tok)) if ok[r]), key=lambda r: (est[r], tok[r]))
            out.append((k, r))
            tok[r] += p
            x = loads[r]
            loads[r] = x._replace(in_flight=x.in_flight + 1, queued=x.queued + 1, tokens=tok[r])
        return out

    def finished(self, in_flight_s: float) -> None:
        pass


class HoldForHolder:
    """A cap that follows the load, and a wait for the replica holding the prefix when cheaper (see
    the module)."""

    __slots__ = ("index", "cost", "share", "in_flight_s", "name")

    def __init__(self, index: CacheIndex, cost: CostModel, share: float) -> None:
        self.index, self.cost, self.share = index, cost, share
        self.in_flight_s = 1.0  # mean time a request stays in flight (EWMA of what finished)
        self.name = f"hold for holder, cap {share} x mean"

    def place(self, held: Sequence[Held], loads: Sequence[ReplicaLoad], now: float) -> list[tuple[int, int]]:
        n = len(loads)
        tok = [x.tokens for x in loads]
        waiting = [0] * n  # tokens of earlier held requests waiting for each replica
        out: list[tuple[int, int]] = []
        for k, (_, req, _) in enumerate(held):
            p = req.prompt_tokens
            cached = self.index.held_prefixes(req.chain)
            cap = self.share * (sum(tok) + p) / n
            fewest = min(range(n), key=tok.__getitem__)
            best, best_est, best_now = 0, math.inf, False
            for r, x in enumerate(loads):
                est = self.cost.prefill_wait_s(x.queued_tokens + max(0, p - cached[r] * req.block_size), x.running)
                now_ok = (tok[r] + p <= cap or r == fewest) and not waiting[r]
                if not now_ok:
                    est += max(0.0, waiting[r] + tok[r] + p - cap) * self.in_flight_s / max(1, tok[r])
                if est < best_est or (est == best_est and tok[r] < tok[best]):
                    best, best_est, best_now = r, est, now_ok
            if best_now:
                out.append((k, best))
                tok[best] += p
            else:
                waiting[best] += p
        return out

    def finished(self, in_flight_s: float) -> None:
        self.in_flight_s += 0.05 * (in_flight_s - self.in_flight_s)


@dataclass(frozen=True, slots=True)
class LateResult:
    policy: str
    hit_rate: float
    ttft_p50: float
    ttft_p90: float
    inflight_p99: float  # as SimResult's: held requests are in flight nowhere
    floor_p99: float
    held_share: float  # of requests, those that waited at the gateway at all
    wait_p90: float  # seconds held, p90 over all requests
    wait_max: float
    queue_max: int  # the most held at a sample
    stopped_at: float = math.nan  # the queue passed max_held then: the fleet past its capacity, figures so far


def simulate_late(trace: Sequence[TraceRequest], make_binder: Callable[[CacheIndex], Binder], *,
                  replicas: int = 4, capacity: int, cost: CostModel, block_size: int, sample_s: float = 0.1,
                  sample_until: float = math.inf, max_held: int = 1000) -> LateResult:
    """``trace`` through one gateway that holds requests as its binder says (see the module); stopped
    when more than ``max_held`` wait at once (a queue that only grows: :attr:`LateResult.stopped_at`)."""
    truth, index = CacheIndex(replicas, capacity), CacheIndex(replicas, capacity)
    binder = make_binder(index)
    ttft = [math.nan] * len(trace)
    reps = [_Replica(cost, ttft, trace) for _ in range(replicas)]
    bound_at: dict[int, float] = {}
    hit = total = 0
    samples: list[float] = []
    floors: list[float] = []
    waits: list[float] = []
    queue_max = 0
    held: list[Held] = []
    next_sample, i, now, stopped = sample_s, 0, 0.0, math.nan
    while i < len(trace) or held:
        if len(held) > max_held:
            stopped = now
            break
        nxt = min(trace[i].t, next_sample) if i < len(trace) else math.inf
        if held:  # the next step end of a busy replica, when something may drain
            nxt = min([nxt] + [rep.clock if rep.clock > now else now + cost.decode_s
                               for rep in reps if rep.waiting or rep.running])
        if nxt == math.inf:
            raise RuntimeError(f"{binder.name}: {len(held)} held with every replica idle")
        now = nxt
        for rep in reps:
            before = {rid for _, rid in rep.running} | {w[0] for w in rep.waiting}
            rep.advance(now)
            for rid in before - {rid for _, rid in rep.running} - {w[0] for w in rep.waiting}:
                binder.finished(rep.clock - bound_at.pop(rid))
        if now >= next_sample:
            if next_sample <= sample_until and sample_balance(reps, samples, floors):
                queue_max = max(queue_max, len(held))
            next_sample += sample_s
        while i < len(trace) and trace[i].t <= now:
            req = trace[i]
            held.append((i, CacheRequest(req.chain, req.prompt_tokens, block_size), req.t))
            i += 1
        if held:
            placed = binder.place(held, [rep.load() for rep in reps], now)
            for k, r in placed:
                rid = held[k][0]
                req = trace[rid]
                hit += bind(truth, [index], reps[r], r, rid, req, block_size)
                total += req.prompt_tokens
                bound_at[rid] = now
                waits.append(now - req.t)
            gone = {k for k, _ in placed}
            held = [h for k, h in enumerate(held) if k not in gone]
    for rep in reps:
        _drain(rep)
    done = [x for x in ttft if not math.isnan(x)] + [now - h[2] for h in held]  # the held ones: at least this
    return LateResult(binder.name, hit / max(1, total), percentile(done, 50), percentile(done, 90),
                      percentile(samples, 99), percentile(floors, 99), sum(w > 0 for w in waits) / max(1, len(waits)),
                      percentile(waits, 90), max(waits, default=0.0), max(queue_max, len(held)), stopped)


def binder_maker(spec: str, cost: CostModel, mean_prompt: float) -> list[Callable[[CacheIndex], Binder]]:
    """``tokens:4,8`` (UnderBudget, FIFO and shortest-first, M times ``mean_prompt``) or ``share:1.1,1.2``
    (HoldForHolder) -> one maker per value."""
    kind, _, values = spec.partition(":")
    out: list[Callable[[CacheIndex], Binder]] = []
    for v in (float(x) for x in values.split(",")):
        if kind == "tokens":
            for order in ("fifo", "spf"):
                out.append(lambda ix, v=v, order=order: UnderBudget(ix, cost, v * mean_prompt, order, label=f"{v:g}x mean"))
        elif kind == "share":
            out.append(lambda ix, v=v: HoldForHolder(ix, cost, v))
        else:
            raise ValueError(f"late binding {spec!r}: tokens:M,... or share:K,...")
    return out
