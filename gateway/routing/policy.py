"""Routing policies: which replica of a model pool gets a request.

A policy is a plain object with :meth:`RoutingPolicy.choose`: it sees the
parsed request (:class:`RouteRequest`: model, prompt-token estimate, the
prompt's prefix block hashes when the pool can compute them) and the replicas
that may take it (each with this gateway's in-flight count and the worker's
last :class:`~transport.messages.Stats`), and returns one or None. It never
raises HTTP errors and never does I/O; the pool turns "none" into a
:class:`~gateway.routing.errors.NoReplica`.

Adding a policy: a class with ``choose`` in a module of this package, and a
name for it in :data:`POLICIES` (``[routing] policy`` picks it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from transport.api import WorkerConnection

__all__ = ["RouteRequest", "Describe", "model_only", "RoutingPolicy", "LeastLoaded", "load_score", "POLICIES"]


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


POLICIES: dict[str, type[RoutingPolicy]] = {"least_loaded": LeastLoaded}
