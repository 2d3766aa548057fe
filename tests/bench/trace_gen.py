"""Seeded request traces for cache-aware routing (issue #29): prompts as block hash chains.

A trace is a list of :class:`TraceRequest` in arrival order. Each prompt is
``[common prefix] + tenant context + [session history] + query``:

- ``tenants`` tenants, picked with Zipf(``zipf_s``) popularity (rank k has weight k^-s);
  ``hot_share`` > 0 gives tenant 0 that share of the traffic and the rest Zipf among the others.
- each tenant has one shared context of ``context_tokens`` tokens (its system prompt and
  documents), fixed for the trace; ``common_tokens`` > 0 puts one prompt shared by every tenant
  before it (so the first block no longer names the tenant).
- each request adds a fresh query of ``query_tokens`` (uniform in [q/2, 3q/2]).
- a request opens a multi-turn session with probability ``multi_turn``; a session has
  ``max_turns`` turns (``turns_uniform``: uniform in [1, ``max_turns``]; ``conversations`` > 0:
  no more sessions than that, every one to its last turn), each one later by ``think_s``
  (exponential), its prompt the previous prompt, the previous answer (``output_tokens``) and a
  new query: sessions grow.
- each answer is ``output_tokens`` long; ``output_spread`` > 0 makes each request's uniform in
  [o(1 - s), o(1 + s)], from a draw of its own (prompts and arrivals stay those of the spread-less
  trace; a session's history still grows by ``output_tokens``).
- arrivals are Poisson at ``rate`` per second, or ``bursty``: the rate switches between
  ``burst_factor`` times and ``1/burst_factor`` times ``rate`` every ``burst_s`` on average.

Tokens are random u32s from the seed (``vocab`` <= 256: random bytes modulo it, ids a byte-level
tokenizer takes, for a live run; ``keep_tokens`` keeps each prompt's in
:attr:`TraceRequest.tokens`); chains are :func:`transport.common.prefix.block_hash` chains with
``block_size`` tokens per block (a shared prefix is hashed once and extended). :func:`warmup` is
one request per tenant, to run before a trace.
:func:`context_demand_blocks` is the working set a fleet cache should hold (every tenant's
context, and the common prefix), to size caches as a share of it.
"""

from __future__ import annotations

import bisect
import heapq
import random
from array import array
from dataclasses import dataclass, field

from transport.common.prefix import ROOT_HASH, block_hash

__all__ = ["TraceSpec", "TraceRequest", "generate", "warmup", "context_demand_blocks"]


@dataclass(frozen=True, slots=True)
class TraceSpec:
    requests: int = 4000
    tenants: int = 64
    zipf_s: float = 1.1
    hot_share: float = 0.0
    context_tokens: int = 2048
    common_tokens: int = 0
    query_tokens: int = 128
    output_tokens: int = 64
    multi_turn: float = 0.3
    max_turns: int = 4
    think_s: float = 5.0
    rate: float = 10.0
    arrivals: str = "poisson"  # or "bursty"
    burst_factor: float = 3.0
    burst_s: float = 10.0
    block_size: int = 16
    seed: int = 0
    vocab: int = 1 << 32  # or at most 256
    keep_tokens: bool = False
    conversations: int = 0  # > 0: start no more sessions than this, and end the trace with their last turns
    turns_uniform: bool = False  # a session's turns uniform in [1, max_turns] (else max_turns)
    output_spread: float = 0.0  # > 0: each request's output_tokens uniform in [o(1 - s), o(1 + s)]


@dataclass(frozen=True, slots=True)
class TraceRequest:
    t: float  # arrival, seconds
    tenant: int
    session: int  # -1: a single turn
    turn: int
    prompt_tokens: int
    output_tokens: int
    chain: tuple[int, ...] = field(repr=False)
    tokens: array[int] | None = field(default=None, repr=False)  # the prompt (TraceSpec.keep_tokens)


def context_demand_blocks(spec: TraceSpec) -> int:
    """Blocks of the shared working set: each tenant's context (after the common prefix) and the common prefix."""
    bs = spec.block_size
    return spec.tenants * ((spec.common_tokens + spec.context_tokens) // bs - spec.common_tokens // bs) \
        + spec.common_tokens // bs


class _Chain:
    """Tokens and the chain over their full blocks, extended without rehashing the prefix."""

    __slots__ = ("tokens", "chain", "bs")

    def __init__(self, bs: int, tokens: array[int] | None = None, chain: tuple[int, ...] = ()) -> None:
        self.bs = bs
        self.tokens: array[int] = array("I", tokens if tokens is not None else [])
        self.chain = list(chain)

    def extend(self, more: array[int]) -> _Chain:
        out = _Chain(self.bs, self.tokens, tuple(self.chain))
        out.tokens.extend(more)
        bs, n = self.bs, len(out.tokens) // self.bs
        parent = out.chain[-1] if out.chain else ROOT_HASH
        for i in range(len(out.chain), n):
            parent = block_hash(parent, out.tokens[i * bs:(i + 1) * bs])
            out.chain.append(parent)
        return out


def _tokens(rng: random.Random, n: int, vocab: int = 1 << 32) -> array[int]:
    if vocab < 1 << 32:
        return array("I", list(rng.randbytes(n)) if vocab == 256 else [b % vocab for b in rng.randbytes(n)])
    a = array("I")
    a.frombytes(rng.randbytes(4 * n))
    return a


def _arrivals(spec: TraceSpec, rng: random.Random) -> list[float]:
    out: list[float] = []
    t = 0.0
    switch, high = rng.expovariate(1 / spec.burst_s), True
    while len(out) < spec.requests:
        rate = spec.rate
        if spec.arrivals == "bursty":
            rate = spec.rate * spec.burst_factor if high else spec.rate / spec.burst_factor
        t += rng.expovariate(rate)
        if spec.arrivals == "bursty" and t > switch:
            t, high = switch, not high  # memoryless: restart the draw at the switch
            switch += rng.expovariate(1 / spec.burst_s)
            continue
        out.append(t)
    return out


def _contexts(spec: TraceSpec) -> tuple[random.Random, list[_Chain]]:
    if spec.arrivals not in ("poisson", "bursty"):
        raise ValueError(f"arrivals must be 'poisson' or 'bursty', not {spec.arrivals!r}")
    if not (1 <= spec.vocab <= 256 or spec.vocab == 1 << 32):
        raise ValueError("vocab must be in [1, 256] or 2**32")
    rng = random.Random(spec.seed)
    common = _Chain(spec.block_size).extend(_tokens(rng, spec.common_tokens, spec.vocab))
    return rng, [common.extend(_tokens(rng, spec.context_tokens, spec.vocab)) for _ in range(spec.tenants)]


def warmup(spec: TraceSpec, rate: float) -> list[TraceRequest]:
    """One request per tenant (its context and a fresh query), every ``1 / rate`` s: what a fleet that
    has served the trace for a while holds, to run before it (a live bench measures after it)."""
    rng, contexts = _contexts(spec)
    rng = random.Random(spec.seed + 1)
    out = []
    for k, ctx in enumerate(contexts):
        prompt = ctx.extend(_tokens(rng, spec.query_tokens, spec.vocab))
        out.append(TraceRequest(k / rate, k, -1, 0, len(prompt.tokens), spec.output_tokens, tuple(prompt.chain),
                                prompt.tokens if spec.keep_tokens else None))
    return out


def generate(spec: TraceSpec) -> list[TraceRequest]:
    """The trace for ``spec`` (the same list for the same spec)."""
    rng, contexts = _contexts(spec)
    v = spec.vocab
    weights = [k ** -spec.zipf_s for k in range(1, spec.tenants + 1)]
    if spec.hot_share > 0:
        rest = sum(weights[1:])
        weights = [rest * spec.hot_share / (1 - spec.hot_share)] + weights[1:]
    cum = [0.0]
    for w in weights:
        cum.append(cum[-1] + w)
    out: list[TraceRequest] = []
    # follow-up turns: (time, session, turn, its last turn, tenant, history)
    pending: list[tuple[float, int, int, int, int, _Chain]] = []
    sessions = 0
    q = spec.query_tokens
    outs = random.Random(spec.seed + 2)
    o, spread = spec.output_tokens, spec.output_spread
    lo, hi = max(1, round(o * (1 - spread))), max(1, round(o * (1 + spread)))

    def emit(t: float, tenant: int, session: int, turn: int, last: int, base: _Chain) -> None:
        prompt = base.extend(_tokens(rng, rng.randint(max(1, q // 2), max(1, q + q // 2)), v))
        n_out = outs.randint(lo, hi) if spread > 0 else o
        out.append(TraceRequest(t, tenant, session, turn, len(prompt.tokens), n_out, tuple(prompt.chain),
                                prompt.tokens if spec.keep_tokens else None))
        if session >= 0 and turn < last:
            history = prompt.extend(_tokens(rng, spec.output_tokens, v))
            heapq.heappush(pending, (t + rng.expovariate(1 / spec.think_s), session, turn + 1, last, tenant, history))

    for t in _arrivals(spec, rng):
        while pending and pending[0][0] <= t and len(out) < spec.requests:
            pt, s, turn, last, tenant, hist = heapq.heappop(pending)
            emit(pt, tenant, s, turn, last, hist)
        if len(out) >= spec.requests or (spec.conversations and sessions >= spec.conversations):
            break
        tenant = bisect.bisect_right(cum, rng.random() * cum[-1]) - 1
        session, last = -1, 0
        if rng.random() < spec.multi_turn:
            session, sessions = sessions, sessions + 1
            last = rng.randint(1, spec.max_turns) - 1 if spec.turns_uniform else spec.max_turns - 1
        emit(t, tenant, session, 0, last, contexts[tenant])
    while spec.conversations and pending and len(out) < spec.requests:  # the conversations' remaining turns
        pt, s, turn, last, tenant, hist = heapq.heappop(pending)
        emit(pt, tenant, s, turn, last, hist)
    return out
