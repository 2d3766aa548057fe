"""The façade: rate limits with OpenAI headers, token reservations settled by use, release once."""

from __future__ import annotations

import pytest

from gateway.admission import Admission, AdmissionContext, AdmissionSettings, parse_rule
from gateway.admission.schema import parse_schema_entry
from gateway.errors import APIError


def _ctx(client: str = "10.0.0.1", prompt: int = 100, out: int = 100, model: str = "tiny",
         deadline: float | None = None) -> AdmissionContext:
    return AdmissionContext(None, client, model, "/v1/chat/completions", prompt, out, deadline)


def test_request_limit_headers_and_429() -> None:
    adm = Admission.from_settings(AdmissionSettings(limits=["client requests 3/1m"]))
    grants = [adm.admit(_ctx(), float(i)) for i in range(3)]
    assert dict(grants[0].headers) == {b"x-ratelimit-limit-requests": b"3",
                                       b"x-ratelimit-remaining-requests": b"2",
                                       b"x-ratelimit-reset-requests": b"1m0s"}
    assert dict(grants[2].headers)[b"x-ratelimit-remaining-requests"] == b"0"
    with pytest.raises(APIError) as e:
        adm.admit(_ctx(), 10.0)
    err = e.value
    assert (err.status, err.code, err.type) == (429, "rate_limit_exceeded", "requests")
    assert err.retry_after == pytest.approx(50.0)  # the first admission (t=0) leaves the window at 60
    assert dict(err.headers)[b"x-ratelimit-remaining-requests"] == b"0"
    adm.admit(_ctx("10.0.0.2"), 10.0)  # per client address
    adm.admit(_ctx(), 60.0)


def test_tokens_reserved_then_settled_by_use() -> None:
    adm = Admission.from_settings(AdmissionSettings(limits=["model tokens 1000/1s"]))
    g = [adm.admit(_ctx(prompt=100, out=300), 0.0) for _ in range(2)]  # 800 reserved
    assert dict(g[1].headers)[b"x-ratelimit-remaining-tokens"] == b"200"
    with pytest.raises(APIError) as e:
        adm.admit(_ctx(prompt=100, out=300), 0.1)
    assert e.value.type == "tokens"
    adm.release(g[0], used_tokens=150, now=0.2)  # 250 of the 400 reserved come back
    adm.admit(_ctx(prompt=100, out=300), 0.3)
    with pytest.raises(APIError) as e:
        adm.admit(_ctx(prompt=1000, out=1), 0.3)
    assert e.value.retry_after is None and "too large" in e.value.message


def test_refusal_takes_nothing() -> None:
    """A request refused by one rule consumes nothing from the others, nor a shedding slot."""
    adm = Admission.from_settings(AdmissionSettings(
        limits=["client requests 100/1m", "model requests 1/1m"], queue_limit=10))
    adm.admit(_ctx(), 0.0)
    for i in range(20):
        with pytest.raises(APIError):
            adm.admit(_ctx(), 1.0 + i)
    assert adm.outstanding() == 1 and adm.shedder.outstanding("tiny") == 1
    assert adm.shedder.tracked() == (1, 0)
    free = Admission.from_settings(AdmissionSettings(limits=["client requests 100/1m"]))
    assert free.limits.check({"client": "10.0.0.1"}, 0.0, 30.0).wait == 0.0
    (limiter,) = [adm.limits._tables[0].get("10.0.0.1", 30.0)]
    assert limiter.remaining(30.0) == 99


def test_release_exactly_once_and_shedding_through_facade() -> None:
    adm = Admission.from_settings(AdmissionSettings(queue_limit=2, priority_classes=1))
    a, b = adm.admit(_ctx(), 0.0), adm.admit(_ctx(), 0.0)
    with pytest.raises(APIError) as e:
        adm.admit(_ctx(), 0.0)
    assert (e.value.status, e.value.code) == (503, "overloaded") and e.value.retry_after is not None
    adm.release(a, 10, 1.0)
    with pytest.raises(RuntimeError, match="twice"):
        adm.release(a, 10, 1.0)
    adm.admit(_ctx(), 1.0)
    adm.release(b, 10, 2.0)
    assert adm.outstanding() == 1


def test_limiter_memory_bounded_over_many_clients() -> None:
    adm = Admission.from_settings(AdmissionSettings(limits=["client requests 10/1s"], limiter_max_keys=64))
    for i in range(10_000):
        adm.release(adm.admit(_ctx(client=f"10.{i // 256 % 256}.{i % 256}.1"), i * 0.001), 1, i * 0.001)
    assert adm.limits.sizes() == (64,)


@pytest.mark.parametrize("text, scope, unit, limit, window, algorithm, match", [
    ("key requests 600/1m", "key", "requests", 600, 60.0, "window", "*"),
    ("client tokens 100000/1h bucket burst=2000", "client", "tokens", 100000, 3600.0, "bucket", "*"),
    ("model=tiny requests 50/0.5s slices=10", "model", "requests", 50, 0.5, "window", "tiny"),
    ("route=/v1/completions requests 5/2", "route", "requests", 5, 2.0, "window", "/v1/completions"),
])
def test_parse_rule(text: str, scope: str, unit: str, limit: float, window: float, algorithm: str,
                    match: str) -> None:
    r = parse_rule(text)
    assert (r.scope, r.unit, r.limit, r.window, r.algorithm, r.match) == (
        scope, unit, limit, window, algorithm, match)


@pytest.mark.parametrize("text, needle", [
    ("key requests", "expected"), ("key requests 600", "<limit>/<window>"), ("user requests 1/1s", "scope"),
    ("key bytes 1/1s", "unit"), ("key requests 0/1s", "limit"), ("key requests 1/xs", "window"),
    ("key requests 1/1s fast", "unknown option"),
])
def test_bad_rules_and_settings_say_why(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        parse_rule(text)
    problems: list[str] = []
    AdmissionSettings(limits=[text])._validate(problems)
    assert problems and needle in problems[0]


def test_settings_validation() -> None:
    problems: list[str] = []
    AdmissionSettings(auth="maybe", redis_url="http://x", redis_fail="sometimes", queue_limit=0,
                      priority_classes=3, priority_headroom=0.6)._validate(problems)
    text = "\n".join(problems)
    for needle in ("admission.auth", "redis_url", "redis_fail", "queue_limit", "priority_headroom"):
        assert needle in text
    with pytest.raises(ValueError, match="expected"):
        parse_schema_entry("route=/x")
    assert parse_schema_entry("model:tiny=/a=b.json") == ("model", "tiny=/a", "b.json")


def test_buckets_can_be_shared_in_redis() -> None:
    """Both limiter kinds are shared (the bucket as GCRA on the Redis server's clock)."""
    for url in ("redis://127.0.0.1:6379/0", ""):
        problems: list[str] = []
        AdmissionSettings(redis_url=url, limits=["key requests 10/1s bucket"])._validate(problems)
        assert problems == []


def test_pipeline_release_counts_the_prompt() -> None:
    """The pipeline knows only the completion tokens at the end: the reserved prompt estimate stays
    counted (before, it was refunded with the unused output, so token rules counted completions only)."""
    adm = Admission.from_settings(AdmissionSettings(limits=["model tokens 1000/1s"]))
    g = adm.admit(AdmissionContext(None, "10.0.0.1", "tiny", "/v1/chat/completions", 100, 300), 0.0)
    assert dict(g.headers)[b"x-ratelimit-remaining-tokens"] == b"600"
    adm.release_completion(g, 50, 0.1)  # 100 prompt + 50 completion used
    g2 = adm.admit(AdmissionContext(None, "10.0.0.1", "tiny", "/v1/chat/completions", 0, 1), 0.2)
    assert dict(g2.headers)[b"x-ratelimit-remaining-tokens"] == b"849"
    with pytest.raises(RuntimeError, match="twice"):
        adm.release(g, 150, 0.3)
