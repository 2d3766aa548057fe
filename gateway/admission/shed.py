"""Load shedding: bounded outstanding requests per model pool, per-key concurrency, deadlines.

How it works: each pool (model) admits at most ``queue_limit`` outstanding
requests (admitted and not yet released: queued at a worker or running).
Priority classes get nested shares of that bound: class ``p`` of ``classes``
may only enter while the pool holds fewer than
``queue_limit * (1 - headroom * (classes - 1 - p))`` -- so as load rises the
lowest class is refused first and the top class keeps the last ``headroom``
share to itself. Each key may hold at most its ``max_concurrency``. Past the
bounds the request is refused at once (no waiting at the gateway: a queue
that is not bounded by count *and* time is where gateways fall over).

The wait estimate: a pool completes requests at some rate while busy; the
estimator keeps an EWMA of the time between completions *within busy
periods* (idle time is not service), so a newcomer behind ``n`` outstanding
requests waits about ``n * gap``. A request whose deadline is shorter than
that is refused with 503 now rather than timing out later at a worker's
expense. Everything is sans-I/O: ``now`` comes in, nothing sleeps.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import APIError

__all__ = ["LoadShedder", "Pool", "ShedTicket", "WaitEstimator", "DEFAULT_QUEUE_LIMIT", "DEFAULT_CLASSES",
           "DEFAULT_HEADROOM", "DEFAULT_PRIORITY"]

DEFAULT_QUEUE_LIMIT = 1024  # outstanding requests per model pool
DEFAULT_CLASSES = 3  # priority classes 0 (shed first) .. 2
DEFAULT_HEADROOM = 0.1  # share of the bound each higher class keeps for itself
DEFAULT_PRIORITY = 1  # the class of a request without a key


class WaitEstimator:
    """EWMA of the busy-period time between completions of one pool. Its busy period is public:
    :meth:`LoadShedder.enter_plain` (and admission's fast path, which writes that out) sets it as
    :meth:`started` would."""

    __slots__ = ("alpha", "gap", "_last", "busy_since")

    def __init__(self, alpha: float = 0.2) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        self.alpha = alpha
        self.gap: float | None = None  # seconds per completion while busy; None until observed
        self._last = 0.0  # when the latest request completed
        self.busy_since: float | None = None  # when the pool's current busy period began; None: idle

    def started(self, now: float, outstanding_before: int) -> None:
        """A request entered a pool that held ``outstanding_before``: the first starts a busy period."""
        if outstanding_before == 0:
            self.busy_since = now

    def completed(self, now: float, outstanding_after: int) -> None:
        """A request finished; ``outstanding_after`` are left (0 ends the busy period)."""
        since, last = self.busy_since, self._last
        self._last = now
        if since is not None:  # (not busy: no sample)
            sample = now - (last if last > since else since)
            if sample > 0.0:
                gap = self.gap
                self.gap = sample if gap is None else gap + self.alpha * (sample - gap)
        if outstanding_after == 0:
            self.busy_since = None

    def wait(self, ahead: int) -> float:
        """Predicted seconds before a newcomer behind ``ahead`` requests starts finishing."""
        return 0.0 if self.gap is None else ahead * self.gap


@dataclass(frozen=True, slots=True, eq=False)
class ShedTicket:
    """What :meth:`LoadShedder.release` needs; one per admitted request (compared by identity)."""

    pool: str
    key_id: str | None


@dataclass(slots=True)
class Pool:
    outstanding: int
    estimator: WaitEstimator


class LoadShedder:
    """Bounded pools, per-key concurrency and deadline checks; ``admit``/``release`` pair up."""

    __slots__ = ("queue_limit", "classes", "headroom", "max_pools", "pools", "_per_key", "shed", "shed_by", "_bounds")

    def __init__(self, queue_limit: int = DEFAULT_QUEUE_LIMIT, classes: int = DEFAULT_CLASSES,
                 headroom: float = DEFAULT_HEADROOM,
                 max_pools: int = 1024) -> None:
        if queue_limit < 1 or classes < 1 or max_pools < 1:
            raise ValueError("queue_limit, classes and max_pools must be >= 1")
        if not 0.0 <= headroom * (classes - 1) < 1.0:
            raise ValueError(f"headroom {headroom!r} x {classes - 1} higher classes must leave the lowest a share")
        self.queue_limit = queue_limit
        self.classes = classes
        self.headroom = headroom
        self.max_pools = max_pools
        self.pools: dict[str, Pool] = {}  # read by Admission.admit_call's plain case (enter_plain, written out)
        self._per_key: dict[str, int] = {}
        self.shed = 0  # refusals, for a counter
        self.shed_by: dict[tuple[int, str], int] = {}  # (class, reason) -> refusals, on /metrics
        self._bounds = tuple(max(1, int(queue_limit * (1.0 - headroom * (classes - 1 - p)))) for p in range(classes))

    def bound(self, priority: int) -> int:
        """Outstanding requests a pool may hold when one of class ``priority`` arrives."""
        return self._bounds[min(max(priority, 0), self.classes - 1)]

    def check(self, pool: str, key_id: str | None, key_cap: int, priority: int,
              deadline: float | None) -> None:
        """Raise :class:`APIError` (503 overloaded; 429 for the key's own cap) if ``admit`` would refuse."""
        st = self.pools.get(pool)
        outstanding = 0 if st is None else st.outstanding
        est = _NO_ESTIMATE if st is None else st.estimator
        bound = self._bounds[priority] if 0 <= priority < self.classes else self.bound(priority)
        if outstanding >= bound:
            self._refused(priority, "queue_bound")
            raise APIError(503, f"The server is overloaded ({pool!r} is at its queue bound); retry shortly.",
                           "server_error", None, "overloaded",
                           max(est.wait(outstanding - bound + 1), _MIN_RETRY))
        if deadline is not None and est.wait(outstanding) > deadline:
            self._refused(priority, "deadline")
            raise APIError(503, f"The predicted wait for {pool!r} ({est.wait(outstanding):.3g} s) exceeds the "
                           f"request's deadline ({deadline:.3g} s).", "server_error", None, "overloaded",
                           max(est.wait(1), _MIN_RETRY))
        if key_id is not None and key_cap > 0 and self._per_key.get(key_id, 0) >= key_cap:
            self._refused(priority, "key_concurrency")
            raise APIError(429, f"Too many concurrent requests for this key (limit {key_cap}).",
                           "requests", None, "rate_limit_exceeded", max(est.wait(1), _MIN_RETRY))

    def _refused(self, priority: int, reason: str) -> None:
        self.shed += 1
        cls = min(max(priority, 0), self.classes - 1)
        self.shed_by[cls, reason] = self.shed_by.get((cls, reason), 0) + 1

    def take(self, pool: str, key_id: str | None, key_cap: int, priority: int, deadline: float | None,
             now: float) -> str | None:
        """:meth:`check` and :meth:`enter` in one call (the admission hot path); returns the
        ``capped_key`` to :meth:`leave` with. :meth:`untake` gives the slot back if a later check
        refuses the request."""
        st = self.pools.get(pool)
        if st is None or st.outstanding >= self._bounds[0] or deadline is not None or key_cap > 0 \
                or not 0 <= priority < self.classes:  # anything but the plain case: the general path
            self.check(pool, key_id, key_cap, priority, deadline)
            capped = key_id if key_cap > 0 else None
            self.enter(pool, capped, now)
            return capped
        self.enter_plain(st, now)  # an existing pool below even the lowest class's bound, no deadline, no key cap
        return None

    def enter_plain(self, st: Pool, now: float) -> None:
        """Take a slot in ``st`` in :meth:`take`'s plain case, which the caller saw hold: an existing
        pool holding fewer than ``bound(0)``, a request with no deadline and no key cap (no check can
        refuse it). Admission's fast path (``Admission.admit_call``) writes this out."""
        if st.outstanding == 0:  # WaitEstimator.started, written out (once per request)
            st.estimator.busy_since = now
        st.outstanding += 1

    def untake(self, pool: str, capped_key: str | None) -> None:
        """Undo the :meth:`take` just made (nothing completed: the wait estimate is left as it was)."""
        st = self.pools[pool]
        st.outstanding -= 1
        if st.outstanding == 0:  # a busy period this request began never was
            st.estimator.busy_since = None
        if capped_key is not None:
            held = self._per_key[capped_key] - 1
            if held > 0:
                self._per_key[capped_key] = held
            else:
                del self._per_key[capped_key]

    def admit(self, pool: str, key_id: str | None, key_cap: int, priority: int, deadline: float | None,
              now: float) -> ShedTicket:
        """Take a slot (after the same checks as :meth:`check`) and return the ticket to release."""
        self.check(pool, key_id, key_cap, priority, deadline)
        capped = key_id if key_cap > 0 else None
        self.enter(pool, capped, now)
        return ShedTicket(pool, capped)

    def enter(self, pool: str, capped_key: str | None, now: float) -> None:
        """Take a slot that :meth:`check` allowed (the caller ran nothing in between); ``capped_key``
        is the key id when the key has a concurrency cap, else None."""
        st = self.pools.get(pool)
        if st is None:
            if len(self.pools) >= self.max_pools:
                self._drop_idle_pool()
            st = self.pools[pool] = Pool(0, WaitEstimator())
        if capped_key is not None:
            self._per_key[capped_key] = self._per_key.get(capped_key, 0) + 1
        st.estimator.started(now, st.outstanding)
        st.outstanding += 1

    def release(self, ticket: ShedTicket, now: float) -> None:
        self.leave(ticket.pool, ticket.key_id, now)

    def leave(self, pool: str, capped_key: str | None, now: float) -> None:
        """Free what :meth:`enter` took."""
        st = self.pools.get(pool)
        if st is not None and st.outstanding > 0:
            st.outstanding -= 1
            st.estimator.completed(now, st.outstanding)
        if capped_key is not None:
            held = self._per_key.get(capped_key, 0) - 1
            if held > 0:
                self._per_key[capped_key] = held
            else:
                self._per_key.pop(capped_key, None)

    def outstanding(self, pool: str) -> int:
        st = self.pools.get(pool)
        return 0 if st is None else st.outstanding

    def tracked(self) -> tuple[int, int]:
        """(pools, keys) held in memory: bounded by ``max_pools`` and by outstanding requests."""
        return len(self.pools), len(self._per_key)

    def _drop_idle_pool(self) -> None:
        for name, st in self.pools.items():
            if st.outstanding == 0:
                del self.pools[name]
                return
        raise APIError(503, "The server is tracking too many model pools.", "server_error", None, "overloaded",
                       _MIN_RETRY)


_MIN_RETRY = 1.0  # Retry-After is whole seconds on the wire; never tell a client 0
_NO_ESTIMATE = WaitEstimator()  # never fed: predicts no wait
