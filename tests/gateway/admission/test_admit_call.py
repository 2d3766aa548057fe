"""The pipeline's admit and release (Admission.admit_call and release_completion, the built-in checks'
usual case written out) against the checks themselves (Admission.admit, which decides every case, and
each check's release): the same grants and refusals, and the same state after, on random requests."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.admission import Admission, AdmissionContext, AdmissionSettings, Grant, hash_key
from gateway.admission.checks import RateCheck
from gateway.admission.gate import PRIORITY_OF_TIER
from gateway.api.params import parse_chat
from gateway.errors import APIError
from gateway.http.types import Request

ROUTE = "/v1/chat/completions"
KEYS = {"plain": "sk-plain-0123456789", "models": "sk-models-0123456789", "capped": "sk-capped-0123456789",
        "ruled": "sk-ruled-0123456789", "top": "sk-top-0123456789"}
KEY_FILE = "".join(textwrap.dedent(f"""
    [[keys]]
    id = "{kid}"
    sha256 = "{hash_key(key)}"
    """) + extra for kid, key, extra in [
    ("plain", KEYS["plain"], ""),
    ("models", KEYS["models"], 'models = ["tiny"]\n'),
    ("capped", KEYS["capped"], "max_concurrency = 1\n"),
    ("ruled", KEYS["ruled"], "[[keys.limits]]\nunit = \"requests\"\nlimit = 3\nwindow = 1.0\n"),
    ("top", KEYS["top"], "priority = 2\n"),
])

admit_op = st.tuples(
    st.just("admit"),
    st.sampled_from([*KEYS, "plain", "plain", "plain", "top", None, "bad"]),
    st.sampled_from(["tiny", "tiny", "big"]),
    st.sampled_from([("10.0.0.1", 5000), ("10.0.0.2", 5000), None]),
    st.sampled_from([None, None, "flex", "default", "auto", "priority", "scale"]),
    st.sampled_from([None] * 6 + [0.0, 0.05, 100.0]),  # the call's own deadline
    st.sampled_from([1, 16, 100]),  # max_tokens
    st.sampled_from(["hi", "x" * 400]),  # the prompt
)
ops = st.lists(st.one_of(
    admit_op, admit_op, admit_op,
    st.tuples(st.just("release"), st.integers(0, 7), st.sampled_from([0, 5, 16, 100])),
    st.tuples(st.just("tick"), st.sampled_from([0.0, 0.001, 0.02, 0.3, 1.1, 2.5])),
), min_size=20, max_size=80)


class Nothing:
    """A registered check that holds nothing: the reference's checks then run every admit and release."""

    name = "nothing"

    def admit(self, ctx: AdmissionContext, grant: Grant, now: float) -> None:
        pass

    def undo(self, ctx: AdmissionContext, grant: Grant, now: float) -> None:
        pass

    def release(self, grant: Grant, completion_tokens: int, now: float) -> None:
        pass


def _outcome(f: Any, *args: Any) -> tuple[tuple[object, ...], Grant | None]:
    try:
        g = f(*args)
    except APIError as e:
        return ("refused", e.status, e.message, e.type, e.param, e.code, e.retry_after, e.headers), None
    assert type(g) is Grant
    res = g.reservation
    return ("admitted", g.key_id, None if g.key is None else g.key.id, g.priority, g.headers, g.pool, g.capped_key,
            g.released, g.prompt, g.held, None if res is None else (res[0], res[1], len(res[2]))), g


def _state(adm: Admission, now: float) -> tuple[object, ...]:
    shed = adm.shedder
    pools = sorted((name, p.outstanding, p.estimator.gap, p.estimator.busy_since, p.estimator._last)
                   for name, p in shed.pools.items())
    tables = [t for c in adm.checks if isinstance(c, RateCheck) for t in c.tables()] or [*adm.limits.tables()]
    limiters = [sorted((v, lim.status(now)) for v, lim in t.items.items()) for t in tables]
    return adm.outstanding(), shed.tracked(), shed.shed, pools, limiters


@settings(max_examples=200, deadline=None)
@given(ops, st.sampled_from(["on", "off"]), st.sampled_from([0, 0, 2]), st.sampled_from([3, 6, 1024]))
def test_admit_call_is_admit(tmp_path_factory: Any, steps: list[tuple[Any, ...]], auth: str, key_cap: int,
                             queue_limit: int) -> None:
    f: Path = tmp_path_factory.mktemp("keys") / "keys.toml"
    f.write_text(KEY_FILE)
    settings_ = AdmissionSettings(keys_file=str(f), auth=auth, key_max_concurrency=key_cap, queue_limit=queue_limit,
                                  limits=["key requests 5/1s", "model tokens 2000/1s", "client requests 8/1s"])
    call, ref = Admission.from_settings(settings_), Admission.from_settings(settings_)
    ref.register(Nothing())
    held: list[tuple[Grant, Grant]] = []
    now = 10.0
    for op in steps:
        if op[0] == "tick":
            now += op[1]
            continue
        if op[0] == "release":
            if held:
                a, b = held.pop(op[1] % len(held))
                call.release_completion(a, op[2], now)
                ref.release_completion(b, op[2], now)
            assert _state(call, now) == _state(ref, now)
            continue
        _, key, model, client, tier, deadline, max_tokens, prompt = op
        token = None if key is None else KEYS.get(key, "sk-not-a-key")
        headers = [(b"host", b"gw"), (b"content-type", b"application/json")]
        if token is not None:
            headers.append((b"authorization", b"Bearer " + token.encode()))
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
        if tier is not None:
            body["service_tier"] = tier
        req = Request("POST", ROUTE, "", headers, b"", "http/1.1", "http", client)
        ga, gb = (parse_chat(body, default_max_tokens=16, max_tokens_limit=4096) for _ in range(2))
        a, grant_a = _outcome(call.admit_call, req, ga, now, deadline)
        ctx = AdmissionContext(req.header(b"authorization") if ref.auth_required else None,
                               None if client is None else client[0], model, ROUTE, gb.prompt_estimate(),
                               gb.params.max_tokens, deadline, None if tier is None else PRIORITY_OF_TIER.get(tier))
        b, grant_b = _outcome(ref.admit, ctx, now)
        assert a == b
        assert _state(call, now) == _state(ref, now)
        if grant_a is not None and grant_b is not None:
            held.append((grant_a, grant_b))
