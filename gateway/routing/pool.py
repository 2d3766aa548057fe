"""Model pools: which ready workers serve which model, and which one gets a request.

How it works: the supervisor :meth:`ModelPool.add`\\ s a connected worker under
the model names it announced in its Hello and :meth:`ModelPool.remove`\\ s it when
it dies. :meth:`ModelPool.open` asks the pool's :class:`~gateway.routing.policy.RoutingPolicy`
(:class:`~gateway.routing.policy.LeastLoaded` by default) for a replica among the
open, non-draining ones serving the model and returns a
:class:`~gateway.routing.routed.RoutedStream`. If that worker dies, drains or is
overloaded *before the first token*, the request moves to another replica, up to
``retries`` times; after the first token the error goes to the client. Routing
failures are :mod:`gateway.routing.errors`, rendered at the edge.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from transport.api import WorkerConnection

from .. import clock
from .cache_aware import CacheAware
from .errors import UnknownModel
from .health import Health, HealthSettings, RetryBudget
from .policy import Describe, LeastLoaded, RouteRequest, RoutingPolicy, model_only
from .prefix import PrefixHasher
from .routed import RoutedStream, SubmitFactory

__all__ = ["ModelPool"]

log = logging.getLogger("quicserve.routing")


class ModelPool:
    """Ready worker connections by served model name."""

    def __init__(self, retries: int = 1, on_retry: Callable[[], None] | None = None,
                 policy: RoutingPolicy | None = None, health: HealthSettings | None = None) -> None:
        self.policy: RoutingPolicy = policy if policy is not None else LeastLoaded()
        self.health = Health(health)  # breakers and outlier ejection per replica
        self.budget = RetryBudget(self.health.s.retry_budget_share, self.health.s.retry_budget_floor)
        self.active: Callable[[], int] = lambda: 0  # requests in flight (the app's count): the budget's base
        # prompt -> block hashes, only for a policy that reads them (tokenizing is not free)
        self.prefix: PrefixHasher | None = PrefixHasher() if self.policy.uses_prefix_hashes else None
        # cache_aware: its index, fed from the KV events of the replicas added here
        self.feed = self.policy.feed if isinstance(self.policy, CacheAware) else None
        if isinstance(self.policy, CacheAware):  # hashes only as far as some replica holds the prompt
            self.prefix = PrefixHasher(CacheAware.hash_blocks, held=self.policy.index.held)
        self.retries = retries
        self.on_retry = on_retry
        self._by_model: dict[str, list[WorkerConnection]] = {}
        self._known: set[str] = set()  # every model ever announced (404 vs 503)
        # per replica: its requests that have no token yet, oldest first (what a rebalance may move)
        self.unstarted: dict[WorkerConnection, dict[RoutedStream, None]] = {}  # RoutedStream joins and leaves these
        self.on_move: Callable[[int], None] | None = None  # metrics: requests moved by a rebalance
        # what a policy sees of a request (prompt estimate, max_tokens), built only when it is asked
        self.describe: Describe = model_only
        self.aliases: dict[str, str] = {}  # alias -> the model's name ([[models]] aliases)
        self.fallbacks: dict[str, str] = {}  # model -> the model that takes its traffic when it is unhealthy

    def configure(self, models: Iterable[tuple[str, Iterable[str]]]) -> None:
        """The models the configuration names, each with its aliases: a request may name any of
        them, and names nothing else once they are known (404 ``model_not_found`` before any worker
        of theirs is ready; 503 while none is)."""
        for name, aliases in models:
            self._known.add(name)
            for alias in aliases:
                self.aliases[alias] = name
                self._known.add(alias)

    def unconfigure(self, name: str) -> None:
        """A reload removed model ``name``: it and its aliases are names no more (404)."""
        self._known.discard(name)
        for alias in [a for a, m in self.aliases.items() if m == name]:
            del self.aliases[alias]
            self._known.discard(alias)

    def knows(self, model: str) -> bool:
        """Configured, or announced by a worker since start (what a metric label may name)."""
        return model in self._known

    def canonical(self, model: str) -> str:
        """The model an alias stands for (the name itself otherwise)."""
        return self.aliases.get(model, model)

    # -- membership (supervisor) ------------------------------------------------
    def add(self, conn: WorkerConnection, models: Iterable[str] | None = None) -> None:
        names = tuple(models) if models is not None else tuple(conn.peer_hello.models)
        self.health.breaker(conn, conn.peer_hello.identity or f"{'/'.join(names)}#{id(conn):x}")
        for name in names:
            self._known.add(name)
            conns = self._by_model.setdefault(name, [])
            if conn not in conns:
                conns.append(conn)
        if self.feed is not None:
            self.feed.attach(conn)
        for name in names:
            self.rebalance(name, conn)

    def remove(self, conn: WorkerConnection) -> None:
        self.unstarted.pop(conn, None)
        self.health.forget(conn)
        if self.feed is not None:
            self.feed.detach(conn)  # its cache's entries go at once (a restart is a new connection)
        for name in list(self._by_model):
            conns = self._by_model[name]
            if conn in conns:
                conns.remove(conn)
            if not conns:
                del self._by_model[name]

    def connections(self) -> list[WorkerConnection]:
        seen: dict[int, WorkerConnection] = {}
        for conns in self._by_model.values():
            for c in conns:
                seen.setdefault(id(c), c)
        return list(seen.values())

    # -- queries (handlers) --------------------------------------------------------
    def models(self) -> list[str]:
        """Models with at least one ready (open) worker, and their aliases, sorted."""
        ready = {m for m, conns in self._by_model.items() if any(not c.closed for c in conns)}
        return sorted(ready | {a for a, m in self.aliases.items() if m in ready})

    def ready_workers(self) -> int:
        return sum(1 for c in self.connections() if not c.closed)

    def choose(self, model: str, subject: object = None, exclude: tuple[WorkerConnection, ...] = (),
               make_submit: SubmitFactory | None = None) -> WorkerConnection | None:
        """The policy's pick among the open, non-draining replicas serving ``model``; ``subject``
        is the pipeline's request, described to the policy (:meth:`route_request`) only if it is
        asked."""
        conns = self._by_model.get(model)
        if not conns:
            return None
        if len(conns) == 1 and not exclude and not self.fallbacks:  # the common single-worker case: nothing to choose
            c = conns[0]
            return None if c.closed or c.draining else c
        live = [c for c in conns if not c.closed and not c.draining and c not in exclude]
        if not live:
            return None
        # open breakers skipped; all open: a fallback takes the traffic, else the whole pool (panic)
        live = self.health.usable(live, clock.now(), model not in self.fallbacks)
        pick = self.policy.choose(self.route_request(model, subject, make_submit, live), live)
        if pick is not None:
            b = self.health.breakers.get(pick)
            if b is not None:
                b.picked()
        return pick

    # -- health (the pipeline reports every end) ----------------------------------------------
    def outcome(self, conn: WorkerConnection | None, model: str, status: int, ttft: float | None, now: float) -> None:
        """A request ended on ``conn``: a worker failure (500, 502; a deadline passed with not one
        token: a replica that hangs) or a success, for its breaker. Once per request: the usual case
        (a success on a clean breaker: :meth:`Breaker.outcome`'s first lines) written out here, the
        rest through the breaker, the pool's rules only when they can matter."""
        b = self.health.breakers.get(conn)  # (None: no breaker either)
        if b is None:
            return
        if status == 200 and b.clean:
            b.outcomes += 1
            if ttft is not None:
                n = b.ttft_samples = b.ttft_samples + 1
                b.ttft = ttft if n == 1 else b.ttft + 0.2 * (ttft - b.ttft)
                if not n & 7:  # every 8th answer: is it a latency outlier?
                    self.health.judge(b, None, self._by_model.get(model, []), now, model in self.fallbacks)
            return
        if status < 200 or 400 <= status < 500 or status == 503 or (status == 504 and ttft):
            return  # the client's doing, load (shedding, overloaded), or a slow answer (latency judges it)
        failed = status >= 500
        why = b.outcome(failed, ttft, self.health.s, now)
        if why is not None or (not failed and ttft is not None and not b.ttft_samples & 7):
            self.health.judge(b, why, self._by_model.get(model, []), now, model in self.fallbacks)

    def failed(self, conn: WorkerConnection | None, model: str) -> None:
        """A request left ``conn`` before its first token because the worker failed it."""
        b = self.health.breakers.get(conn) if conn is not None else None
        if b is not None:
            now = clock.now()
            self.health.judge(b, b.outcome(True, None, self.health.s, now), self._by_model.get(model, []), now,
                              model in self.fallbacks)

    def route_request(self, model: str, subject: object, make_submit: SubmitFactory | None,
                      replicas: list[WorkerConnection]) -> RouteRequest:
        """What the policy sees of a request: the pipeline's description of it (:attr:`describe`),
        with the prompt's prefix block hashes when the policy reads them (:attr:`prefix`)."""
        req = self.describe(model, subject)
        if self.prefix is not None and make_submit is not None:
            req = self.prefix.annotate(req, make_submit, replicas)
        return req

    def replicas(self) -> dict[str, list[WorkerConnection]]:
        """Every model's replicas (open or not)."""
        return {m: list(conns) for m, conns in self._by_model.items()}

    def degraded(self) -> dict[str, str]:
        """Models that cannot serve as configured now, and why (for ``/readyz`` and the logs)."""
        out: dict[str, str] = {}
        now = clock.now()
        for model in sorted(self._known - set(self.aliases)):
            conns = [c for c in self._by_model.get(model, ()) if not c.closed and not c.draining]
            if not conns:
                out[model] = "no ready replica"
            elif not self.health.usable(conns, now, panic=False):
                out[model] = "every replica ejected: " + "; ".join(
                    b.reason for c in conns if (b := self.health.breakers.get(c)) is not None and b.reason)
            else:
                continue
            if model in self.fallbacks:
                out[model] += f" (its traffic goes to {self.fallbacks[model]})"
        return out

    def waiting(self, conn: WorkerConnection) -> int:
        """Requests on ``conn`` that have no token yet."""
        return len(self.unstarted.get(conn, ()))

    def rebalance(self, model: str, target: WorkerConnection) -> int:
        """Move requests of ``model`` that have no token yet from the other replicas to ``target``
        (just ready, or idle), newest first (a worker's queue is first come, first served: the newest
        are the ones still queued; the oldest may be running a prefill), until the two sides are even: ``target``'s load, plus
        what it got, against each source's waiting requests, less what it gave. Returns how many
        moved."""
        if target.closed or target.draining:
            return 0
        moved = 0
        load = self._load(target)
        for src in self._by_model.get(model, ()):
            if src is target:
                continue
            waiting = [r for r in self.unstarted.get(src, ()) if r.model == model and r.on_moved is not None]
            left = len(waiting)
            for routed in reversed(waiting):  # the newest: still queued behind the older ones, which run
                if left - 1 < load + 1:
                    break
                if routed.move(target):
                    moved += 1
                    load += 1
                    left -= 1
        if moved:
            log.info("rebalance: %d request(s) of %s moved to a replica that became ready", moved, model)
            if self.on_move is not None:
                self.on_move(moved)
        return moved

    @staticmethod
    def _load(conn: WorkerConnection) -> int:
        s = conn.latest_stats
        return conn.in_flight if s is None else max(conn.in_flight, s.running + s.queue_depth)

    def open(self, model: str, make_submit: SubmitFactory, subject: object = None) -> RoutedStream:
        """Submit ``subject`` (the pipeline's request: opaque here, see :attr:`describe`) to the
        replica of ``model`` the policy picks.

        Raises :class:`UnknownModel` if no worker has ever announced the model (and some worker
        has announced something), :class:`NoReplica` if none serving it can take it now.
        """
        if model not in self._known and self._known:
            raise UnknownModel(model)
        budget = self.budget
        budget.requests += 1
        routed = RoutedStream(self, model, subject, make_submit)
        routed.submit()
        return routed
