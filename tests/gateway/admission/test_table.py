"""LimiterTable: bounded, idle limiters dropped first, then one unused for longest (second chance)."""

from __future__ import annotations

from gateway.admission.limits import LimiterTable
from gateway.admission.window import SlidingWindowLimiter


def _table(max_keys: int) -> LimiterTable:
    return LimiterTable(lambda value: SlidingWindowLimiter(100, 10.0), max_keys)


def test_a_used_limiter_survives_and_the_unused_one_goes() -> None:
    t = _table(3)
    for v in "abc":
        t.get(v, 0.0).try_take(1.0, 0.0)
    t.get("a", 1.0).try_take(1.0, 1.0)  # a is used again (a hit: nothing recorded by the table)
    t.get("d", 2.0).try_take(1.0, 2.0)  # full: a had its second chance, b was unused since it came
    assert set(t.items) == {"a", "c", "d"} and t.evicted_busy == 1
    t.get("e", 3.0)  # c is next in line, unused since
    assert set(t.items) == {"a", "d", "e"} and t.evicted_busy == 2


def test_idle_limiters_go_first() -> None:
    t = _table(3)
    t.get("old", 0.0).try_take(1.0, 0.0)
    for v in "ab":
        t.get(v, 9.0).try_take(1.0, 9.0)
    t.get("c", 10.5)  # old's admission left its 10 s window: dropped as idle, no busy eviction
    assert set(t.items) == {"a", "b", "c"} and t.evicted_busy == 0


def test_memory_stays_bounded_whatever_the_churn() -> None:
    t = _table(64)
    for i in range(5000):
        now = i * 0.001
        t.get(f"client-{i}", now).try_take(1.0, now)
        t.get("steady", now).try_take(1.0, now)  # one busy limiter through it all
        assert len(t) <= 64
    assert "steady" in t.items
