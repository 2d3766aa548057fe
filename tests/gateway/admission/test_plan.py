"""Compiled rate plans against RateLimits.take: the same answers, headers and limiter state."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.admission.limits import SCOPES, RateLimits, RateRule, Verdict

VALUES = {"key": ["a", "b", None], "client": ["10.0.0.1", "10.0.0.2", None], "model": ["tiny", "big"],
          "route": ["/v1/chat/completions", "/v1/completions"]}

rules = st.builds(
    RateRule,
    scope=st.sampled_from(SCOPES),
    unit=st.sampled_from(["requests", "tokens"]),
    limit=st.sampled_from([1.0, 3.0, 10.0, 50.0, 200.0, 1e9, 1e9]),
    window=st.sampled_from([0.3, 1.0, 2.0]),
    algorithm=st.sampled_from(["window"] * 5 + ["bucket"]),
    slices=st.sampled_from([1, 3, 10, 100]),
    match=st.sampled_from(["*"] * 6 + ["tiny", "a", "/v1/completions"]),
)
USUAL = ("a", "10.0.0.1", "tiny", "/v1/chat/completions")  # every rule applies (but a match on others)
usual_rules = st.builds(  # windows whose rules all apply to USUAL: the plan's own case, and its edges
    RateRule, scope=st.sampled_from(SCOPES), unit=st.sampled_from(["requests", "tokens"]),
    limit=st.sampled_from([3.0, 50.0, 200.0, 1e9]), window=st.sampled_from([0.3, 1.0]),
    slices=st.sampled_from([1, 10, 100]))
ops = st.lists(st.tuples(
    st.one_of(st.just(USUAL), st.just(USUAL), st.just(USUAL),
              st.tuples(*(st.sampled_from(v) for v in VALUES.values()))),  # one value per scope
    st.sampled_from([0.0, 1.0, 7.0, 40.0]),  # token cost
    st.sampled_from([0.0] * 6 + [0.0001, 0.001, 0.01, 0.1, 0.3, 1.0]),  # time step
    st.sampled_from([None, 0.0, 3.0, 100.0]),  # settle with this many tokens used (None: keep)
), min_size=10, max_size=80)


def _state(limits: RateLimits, now: float) -> list[object]:
    return [sorted((v, lim.status(now), lim.idle(now)) for v, lim in t.items.items())  # type: ignore[attr-defined]
            for t in limits._tables]


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.lists(rules, min_size=1, max_size=4), st.lists(usual_rules, min_size=1, max_size=3)), ops,
       st.floats(0.0, 5.0))
def test_plan_then_take_is_take(rule_list: list[RateRule], steps: list[tuple[tuple[str | None, ...], float, float,
                                                                                    float | None]],
                                t0: float) -> None:
    fast, ref = RateLimits(rule_list), RateLimits(rule_list)
    now = t0
    for values, tokens, dt, used in steps:
        now += dt
        key, client, model, route = values
        got = fast.fast(key, client, model, route, tokens, now)  # type: ignore[arg-type]
        if got is None:
            a = fast.take(values, tokens, now)
        else:
            a = got
        b = ref.take(values, tokens, now)
        if isinstance(b, Verdict):
            assert got is None  # the compiled plan never refuses: take does
            assert isinstance(a, Verdict) and a == b
        else:
            assert not isinstance(a, Verdict)
            assert a[0] == b[0]  # the x-ratelimit-* headers, byte for byte
            assert (a[1] is None) == (b[1] is None)
            if a[1] is not None and b[1] is not None:
                assert a[1][:2] == b[1][:2] and len(a[1][2]) == len(b[1][2])
                if used is not None:
                    fast.settle(a[1], used, now)
                    ref.settle(b[1], used, now)
        assert _state(fast, now) == _state(ref, now)


def test_the_usual_case_is_compiled() -> None:
    """Rules that all apply, windows with room: after each limiter's first request (which creates
    it) the plan admits without take, with take's headers."""
    limits = RateLimits([RateRule("key", "requests", 100, 60.0), RateRule("model", "tokens", 1e6, 60.0),
                         RateRule("client", "requests", 50, 1.0)])
    assert limits.fast("k", "c", "m", "/r", 10.0, 5.005) is None  # no limiter yet
    first = limits.take(("k", "c", "m", "/r"), 10.0, 5.005)
    assert not isinstance(first, Verdict)
    second = limits.fast("k", "c", "m", "/r", 10.0, 5.006)
    assert second is not None
    assert dict(second[0]) == {b"x-ratelimit-limit-requests": b"50", b"x-ratelimit-remaining-requests": b"48",
                               b"x-ratelimit-reset-requests": b"1s", b"x-ratelimit-limit-tokens": b"1000000",
                               b"x-ratelimit-remaining-tokens": b"999980", b"x-ratelimit-reset-tokens": b"1m0s"}
    assert second[1] is not None and second[1][:2] == (10.0, 5.006)
    assert limits.fast(None, "c", "m", "/r", 10.0, 5.007) is None  # a rule that does not apply: take decides
    assert "def plan(key, client, model, route, tokens, now)" in (limits.fast.__doc__ or "")
