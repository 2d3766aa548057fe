"""Replica health (gateway/routing/health.py) on a fake clock: breakers, probes, outliers, the
ejection cap, panic routing and the retry budget."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing.health import Breaker, Health, HealthSettings, RetryBudget

S = HealthSettings(consecutive=3, error_rate=0.5, window=10, min_requests=6, base_ejection=5.0, max_ejection=12.0,
                   outlier_factor=3.0, outlier_min_ms=50.0, max_ejected_share=0.5)


def _pool(n: int) -> tuple[Health, list[str]]:
    h = Health(S)
    pool = [f"r{i}" for i in range(n)]
    for r in pool:
        h.breaker(r, r)
    return h, pool


def test_consecutive_failures_eject_then_one_probe_closes() -> None:
    h, pool = _pool(4)
    for _ in range(2):
        h.outcome("r0", pool, True, None, 0.0)
    assert h.usable(pool, 0.0) == pool
    h.outcome("r0", pool, True, None, 0.0)  # the third in a row
    assert h.usable(pool, 1.0) == ["r1", "r2", "r3"] and h.breakers["r0"].state == "open"
    assert "r0" in h.usable(pool, 5.0)  # half open after 5 s: one probe may go
    h.breakers["r0"].picked()
    assert "r0" not in h.usable(pool, 5.1)  # ... and only one at a time
    h.outcome("r0", pool, False, 0.01, 5.2)
    assert h.breakers["r0"].state == "closed" and h.usable(pool, 5.3) == pool


def test_a_failed_probe_ejects_longer_each_time_up_to_the_cap() -> None:
    h, pool = _pool(4)
    b = h.breakers["r1"]
    t = 0.0
    for expected in (5.0, 10.0, 12.0, 12.0):
        if b.state == "closed":
            for _ in range(3):
                h.outcome("r1", pool, True, None, t)
        assert b.state == "open"
        assert "r1" not in h.usable(pool, t + expected - 0.01) and "r1" in h.usable(pool, t + expected)
        b.picked()
        t += expected
        h.outcome("r1", pool, True, None, t)  # the probe fails: open again, for longer


def test_error_rate_over_the_window_ejects() -> None:
    h, pool = _pool(4)
    for i in range(10):  # every other request fails: never 3 in a row, but 60% of the last 10
        h.outcome("r2", pool, i % 5 in (0, 2, 4), None, float(i))
    assert h.breakers["r2"].state == "open" and "of its last" in h.breakers["r2"].reason


def test_a_latency_outlier_is_ejected() -> None:
    h, pool = _pool(4)
    for _ in range(10):
        for r, ttft in (("r0", 0.05), ("r1", 0.06), ("r2", 0.055), ("r3", 0.3)):
            h.outcome(r, pool, False, ttft, 0.0)
    assert h.breakers["r3"].state == "open" and "median" in h.breakers["r3"].reason
    assert all(h.breakers[r].state == "closed" for r in ("r0", "r1", "r2"))


def test_never_more_than_the_share_and_never_the_last() -> None:
    h, pool = _pool(4)  # a share of 0.5: two of four at most
    for r in pool:
        for _ in range(3):
            h.outcome(r, pool, True, None, 0.0)
    assert sum(b.state == "open" for b in h.breakers.values()) == 2
    h1, one = _pool(1)
    for _ in range(10):
        h1.outcome("r0", one, True, None, 0.0)
    assert h1.breakers["r0"].state == "closed"  # the last replica is never ejected


def test_panic_uses_the_whole_pool_when_every_replica_is_out() -> None:
    h, pool = _pool(2)
    for b in h.breakers.values():
        b.trip("test", S, 0.0)
    assert h.usable(pool, 1.0) == pool and h.panics == 1


def test_retry_budget_is_a_share_of_requests_in_flight_with_a_floor() -> None:
    b = RetryBudget(0.2, 3)
    assert [b.acquire(5) for _ in range(4)] == [True, True, True, False]  # the floor: 3
    b.release()
    assert b.acquire(5) and not b.acquire(5)
    assert all(b.acquire(100) for _ in range(17)) and not b.acquire(100)  # 20 of 100
    assert b.refused == 3


def test_to_heal_one_replica_of_a_pool_never_its_last() -> None:
    from gateway.routing.health import to_heal

    s = HealthSettings(heal_error_rate=0.05, heal_window=60.0, heal_min_requests=20)
    h = Health(s)
    pools = {"m": ["a", "b", "c"], "solo": ["z"]}
    for r in ("a", "b", "c", "z"):
        h.breaker(r, r)
    for i in range(40):
        for r in ("a", "b", "z"):  # 10% failed: a, b (and the lone z) past 5%
            h.breakers[r].outcome(i % 10 == 0, 0.01, s, float(i))
        h.breakers["c"].outcome(False, 0.01, s, float(i))
    picked = to_heal(h, pools, 40.0)
    assert [r for r, _ in picked] == ["a"] and "10.0% of its 40 requests" in picked[0][1]  # one per pool; not z
    h.breakers["a"].healed()
    assert [r for r, _ in to_heal(h, pools, 40.0)] == ["b"]
    assert to_heal(h, pools, 200.0) == []  # the window passed: nothing recent to judge


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=80))
def test_the_compact_window_trips_as_a_plain_one_would(outcomes: list[bool]) -> None:
    """The breaker keeps only a count while no failure is in its window: it must eject exactly when
    a plain list of the last ``window`` outcomes says so."""
    from collections import deque

    s = HealthSettings(consecutive=1000, error_rate=0.3, window=10, min_requests=6)
    b = Breaker("r")
    plain: deque[bool] = deque(maxlen=10)
    for i, failed in enumerate(outcomes):
        plain.append(failed)
        why = b.outcome(failed, None, s, float(i))
        expected = failed and len(plain) >= 6 and sum(plain) / len(plain) > 0.3
        assert (why is not None) == expected, (i, list(plain))
        if why is not None:
            b.trip(why, s, float(i))
            b.state = "closed"  # keep judging the same stream
            plain.clear()


class _Replica:
    """A worker connection as the pool sees it (hashable by identity, like the real one)."""

    def __init__(self, name: str) -> None:
        from transport.messages import Hello
        self.peer_hello = Hello(role="worker", identity=name, models=("m",))
        self.closed = self.draining = False
        self.latest_stats = None
        self.in_flight = 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from([200, 200, 200, 500, 502, 504, 499, 503, 400]),
                          st.sampled_from([None, 0.01, 0.02, 0.4])), min_size=1, max_size=120))
def test_the_pools_inline_outcome_is_the_breakers(ends: list[tuple[int, int, float | None]]) -> None:
    """ModelPool.outcome writes the usual case out (a success on a clean breaker): every sequence of
    request ends must leave its breakers exactly as Health.outcome (the breaker's own method) does."""
    from gateway.routing.pool import ModelPool

    pool = ModelPool()
    pool.health = Health(S)
    conns = [_Replica(f"r{i}") for i in range(3)]
    for c in conns:
        pool.add(c)  # type: ignore[arg-type]
    ref, names = _pool(3)
    fields = ("state", "clean", "outcomes", "failures", "ttft", "ttft_samples", "times_opened", "_recent_n",
              "_recent_failed", "_failures_in_row", "reason")
    for i, (r, status, ttft) in enumerate(ends):
        now = i * 0.5
        pool.outcome(conns[r], "m", status, ttft, now)  # type: ignore[arg-type]
        if not (status < 200 or 400 <= status < 500 or status == 503 or (status == 504 and ttft)):
            ref.outcome(names[r], names, status >= 500, ttft, now)
        for c, name in zip(conns, names, strict=True):
            got, want = pool.health.breakers[c], ref.breakers[name]
            assert [getattr(got, f) for f in fields] == [getattr(want, f) for f in fields], (i, name)
        for c, name in zip(conns, names, strict=True):  # the routing view: same usable replicas
            assert pool.health.breakers[c].usable(now) == ref.breakers[name].usable(now)
