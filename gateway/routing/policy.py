"""Routing policies: which replica of a model pool gets a request.

A policy is a plain object with :meth:`RoutingPolicy.choose`: it sees the
parsed request (:class:`RouteRequest`: model, prompt-token estimate, the
prompt's prefix block hashes when the pool can compute them) and the replicas
that may take it (each with this gateway's in-flight count and the worker's
last :class:`~transport.messages.Stats`), and returns one or None. It never
raises HTTP errors and never does I/O; the pool turns "none" into a
:class:`~gateway.routing.errors.NoReplica`.

A policy that reads ``prefix_hashes`` says so (``uses_prefix_hashes = True``):
only then does its pool tokenize prompts (:class:`~gateway.routing.prefix.PrefixHasher`).
``cache_aware`` (:mod:`gateway.routing.cache_aware`) also keeps an exact index of the replicas'
prefix caches from their KV events, which its pool feeds.

Adding a policy: a class with ``choose`` and ``uses_prefix_hashes`` in this
module (or one it imports), and a name for it in :data:`POLICIES` (``[routing]
policy`` picks it; ``config check`` rejects unknown names).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar, NamedTuple, Protocol

from transport.api import WorkerConnection

from .cache_aware import CacheAware

__all__ = ["RouteRequest", "Describe", "model_only", "RoutingPolicy", "LeastLoaded", "RoundRobin", "PrefixAffinity",
           "load_score", "POLICIES"]


class RouteRequest(NamedTuple):
    """What a policy may look at. Built only when a policy is asked (more than one replica to
    choose from), from the request the pipeline handed the pool (:data:`Describe`)."""

    model: str
    prompt_tokens: int = 0  # an estimate (bytes / 4 for text) until the gateway tokenizes
    max_tokens: int = 0
    prefix_hashes: tuple[int, ...] = ()  # the worker's block hash chain over the prompt, when known


Describe = Callable[[str, object], RouteRequest]
"""(model, the pipeline's request, opaque to the pool) -> what the policy sees."""


def model_only(model: str, subject: object) -> RouteRequest:
    """The pool's default :data:`Describe`: the model name alone (the pipeline sets its own)."""
    return RouteRequest(model)


class RoutingPolicy(Protocol):
    uses_prefix_hashes: ClassVar[bool]  # True: the pool fills RouteRequest.prefix_hashes (costs a tokenization)

    def choose(self, req: RouteRequest, replicas: Sequence[WorkerConnection]) -> WorkerConnection | None:
        """One of ``replicas`` (all open and not draining), or None to refuse. (With a single open
        replica the pool does not ask: there is nothing to choose.)"""
        ...


def load_score(conn: WorkerConnection) -> int:
    """Lower is better: the larger of what this gateway has in flight there and what the worker
    last reported running, plus its queue."""
    s = conn.latest_stats
    if s is None:
        return conn.in_flight
    return max(conn.in_flight, s.running + s.queue_depth) + s.queue_depth


class LeastLoaded:
    """The replica with the lowest :func:`load_score`; the first of equals."""

    __slots__ = ()
    uses_prefix_hashes: ClassVar[bool] = False

    def choose(self, req: RouteRequest, replicas: Sequence[WorkerConnection]) -> WorkerConnection | None:
        if len(replicas) == 1:  # the common single-worker case: no scoring
            return replicas[0]
        best: WorkerConnection | None = None
        best_score = 0
        for c in replicas:
            score = load_score(c)
            if best is None or score < best_score:
                best, best_score = c, score
        return best


class RoundRobin:
    """Each replica in turn, whatever its load or cache (a baseline to measure the others by)."""

    __slots__ = ("_next",)
    uses_prefix_hashes: ClassVar[bool] = False

    def __init__(self) -> None:
        self._next = 0

    def choose(self, req: RouteRequest, replicas: Sequence[WorkerConnection]) -> WorkerConnection | None:
        self._next += 1
        return replicas[self._next % len(replicas)] if replicas else None


class PrefixAffinity:
    """The replica that reports the prompt's first block in its cache (``Stats.prefix_hashes``: the
    roots of a worker's cached chains, newest first), the least loaded of those, unless it is
    busier than the least-loaded replica by more than ``slack``; otherwise :class:`LeastLoaded`'s
    pick. A shared system prompt then lands where its KV blocks already are, and a hot prefix
    still spreads once its replica is ``slack`` requests ahead."""

    __slots__ = ("slack",)
    uses_prefix_hashes: ClassVar[bool] = True

    def __init__(self, slack: int = 4) -> None:
        self.slack = slack

    def choose(self, req: RouteRequest, replicas: Sequence[WorkerConnection]) -> WorkerConnection | None:
        best: WorkerConnection | None = None
        hit: WorkerConnection | None = None
        best_score = hit_score = 0
        root = req.prefix_hashes[0] if req.prefix_hashes else None
        for c in replicas:
            score = load_score(c)
            if best is None or score < best_score:
                best, best_score = c, score
            s = c.latest_stats
            if root is not None and s is not None and root in s.prefix_hashes and (hit is None or score < hit_score):
                hit, hit_score = c, score
        if hit is not None and hit_score <= best_score + self.slack:
            return hit
        return best


POLICIES: dict[str, type[RoutingPolicy]] = {"least_loaded": LeastLoaded, "prefix_affinity": PrefixAffinity,
                                             "cache_aware": CacheAware, "round_robin": RoundRobin}
