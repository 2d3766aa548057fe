"""Request-body schemas: 400s that name the JSON path and keyword, operator schemas, caching,
and a Hypothesis differential test of the shipped engine against the reference ``jsonschema``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.admission.schema import (
    SchemaRegistry,
    available_engines,
    builtin_schema,
    check_schema_entries,
    compile_schema,
    json_param,
)
from gateway.errors import APIError

CHAT = "/v1/chat/completions"
GOOD_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@pytest.fixture(scope="module")
def reg() -> SchemaRegistry:
    return SchemaRegistry()


@pytest.mark.parametrize("body, param, keyword", [
    ({"messages": [{"role": "user", "content": "x"}]}, "model", "required"),
    ({**GOOD_CHAT, "temperature": 3}, "temperature", "maximum"),
    ({**GOOD_CHAT, "max_tokens": "8"}, "max_tokens", "type"),
    ({**GOOD_CHAT, "messages": []}, "messages", "minItems"),
    ({**GOOD_CHAT, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "enum"),
    ({**GOOD_CHAT, "messages": [{"role": "user"}]}, "messages[0].content", "required"),
    ({**GOOD_CHAT, "frobnicate": 1}, "frobnicate", "additionalProperties"),
    ({**GOOD_CHAT, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "type"),
])
def test_errors_name_path_and_keyword(reg: SchemaRegistry, body: dict[str, Any], param: str, keyword: str) -> None:
    with pytest.raises(APIError) as e:
        reg.validate(CHAT, "tiny", body)
    err = e.value
    code = {"type": "invalid_type", "required": "missing_required_parameter",
            "additionalProperties": "unknown_parameter"}.get(keyword, "invalid_value")
    assert (err.status, err.code, err.param) == (400, code, param)
    assert f"failed keyword: {keyword}" in err.message and param in err.message


def test_valid_bodies_pass(reg: SchemaRegistry) -> None:
    reg.validate(CHAT, "tiny", GOOD_CHAT)
    reg.validate(CHAT, "tiny", {**GOOD_CHAT, "messages": [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}], "stop": ["\n"], "seed": -1})
    reg.validate("/v1/completions", "tiny", {"model": "tiny", "prompt": [[1, 2, 3]], "logprobs": 2})
    reg.validate("/v1/models", None, {"anything": True})  # routes without a schema
    with pytest.raises(APIError) as e:
        reg.validate("/v1/completions", "tiny", {"model": "tiny", "prompt": [-1]})
    assert e.value.param == "prompt"


def test_operator_schema_per_route_and_model(tmp_path: Path) -> None:
    f = tmp_path / "short.json"
    f.write_text(json.dumps({"properties": {"max_tokens": {"maximum": 16}}}))
    reg = SchemaRegistry([f"model:small={f}"])
    reg.validate(CHAT, "big", {**GOOD_CHAT, "max_tokens": 100})
    with pytest.raises(APIError) as e:
        reg.validate(CHAT, "small", {**GOOD_CHAT, "max_tokens": 100})
    assert e.value.param == "max_tokens" and "maximum" in e.value.message
    route = SchemaRegistry([f"route:{CHAT}={f}"])
    with pytest.raises(APIError):
        route.validate(CHAT, "big", {**GOOD_CHAT, "max_tokens": 100})


def test_config_check_reports_bad_entries(tmp_path: Path) -> None:
    bad_schema = tmp_path / "bad.json"
    bad_schema.write_text(json.dumps({"type": "frob"}))
    draft7 = tmp_path / "d7.json"
    draft7.write_text(json.dumps({"$schema": "http://json-schema.org/draft-07/schema#"}))
    not_json = tmp_path / "x.json"
    not_json.write_text("{")
    problems = check_schema_entries([f"route:/x={bad_schema}", f"model:m={tmp_path / 'missing.json'}",
                                     "nonsense", f"model:m={draft7}", f"model:m={not_json}"])
    assert len(problems) == 5
    assert "not a valid 2020-12 schema" in problems[0] and "cannot read" in problems[1]
    assert "expected" in problems[2] and "2020-12" in problems[3]
    with pytest.raises(ValueError, match="admission.schemas"):
        SchemaRegistry([f"route:/x={bad_schema}"])


def test_checker_is_the_engine_call_and_agrees(tmp_path: Path) -> None:
    reg = SchemaRegistry()
    check = reg.checker(CHAT)
    assert check is not None and check(GOOD_CHAT) and not check({**GOOD_CHAT, "n": 0})
    assert reg.checker("/v1/models") is None  # no schema: nothing to bind
    f = tmp_path / "s.json"
    f.write_text("{}")
    assert SchemaRegistry([f"model:m={f}"]).checker(CHAT) is None  # per-model schemas: use validate


def test_compiled_once_per_schema_hash() -> None:
    a = compile_schema({"type": "object", "required": ["a"]})
    b = compile_schema(json.loads('{"required": ["a"], "type": "object"}'))  # same schema, other key order
    assert a is b
    assert compile_schema({"type": "array"}) is not a


def test_schemas_ship_as_package_data() -> None:
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).parents[3] / "setup.cfg")
    assert "schemas/*.json" in cfg["options.package_data"]["gateway.admission"]
    assert builtin_schema("chat_completions.json")["$schema"].endswith("2020-12/schema")


def test_json_param() -> None:
    assert json_param(()) is None
    assert json_param(("messages", 0, "content", 2, "text")) == "messages[0].content[2].text"


# --- differential: shipped engine vs the reference on the OpenAI chat schema ------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
    max_leaves=8)
_text = st.text(max_size=4)
# Valid building blocks first, so that a good share of the bodies is valid ...
_ok_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant"]),
     "content": _text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _text}), min_size=1,
                                 max_size=2)},
    optional={"name": _text})
_ok_fields = {
    "max_tokens": st.integers(1, 10**6) | st.none(),
    "temperature": st.floats(0, 2) | st.integers(0, 2),
    "top_p": st.floats(0, 1),
    "n": st.integers(1, 128),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": _text | st.lists(_text, max_size=4) | st.none(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20),
    "frequency_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(st.integers(0, 2**32 - 1).map(str), st.integers(-100, 100) | st.floats(-100, 100),
                                  max_size=2),
    "presence_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.01, 100), "min_tokens": st.integers(0, 9),
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
    "tool_choice": st.sampled_from(["none", "auto", "required"]),
    "metadata": st.dictionaries(_text, _text, max_size=3),
    "service_tier": st.sampled_from(["auto", "flex", None]),
}
_ok_chat = st.fixed_dictionaries(
    {"model": st.text(min_size=1, max_size=4), "messages": st.lists(_ok_message, min_size=1, max_size=3)},
    optional=_ok_fields)
# ... then near misses: one field (top level or in a message) replaced by values at and past the edges.
_wild = st.one_of(_json, st.integers(-(2**65), 2**65), st.floats(-3, 3, allow_nan=False),
                  st.sampled_from(["robot", "tool", "text", "auto", "", None, [], {}]))
_keys = st.sampled_from(["model", "messages", "unknown_field", *_ok_fields])
_msg_keys = st.sampled_from(["role", "content", "name", "tool_call_id", "tool_calls", "refusal"])


@st.composite
def _near_miss(draw: st.DrawFn) -> dict[str, Any]:
    body = dict(draw(_ok_chat))
    if draw(st.booleans()):
        key = draw(_keys)
        if draw(st.integers(0, 3)) == 0:
            body.pop(key, None)
        else:
            body[key] = draw(_wild)
    else:
        msgs = [dict(m) for m in body["messages"]]
        m = msgs[draw(st.integers(0, len(msgs) - 1))]
        key = draw(_msg_keys)
        if draw(st.integers(0, 3)) == 0:
            m.pop(key, None)
        else:
            m[key] = draw(_wild)
        body["messages"] = msgs
    return body


_chat = _ok_chat | _near_miss()


@pytest.mark.skipif("jsonschema-rs" not in available_engines(), reason="needs both engines")
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=_chat | _json)
def test_differential_against_reference(body: Any) -> None:
    schema = builtin_schema("chat_completions.json")
    fast, ref = compile_schema(schema, "jsonschema-rs"), compile_schema(schema, "jsonschema")
    valid = ref.is_valid(body)
    assert fast.is_valid(body) == valid
    assert (fast.first_error(body) is None) == valid


def test_differential_generator_reaches_both_outcomes() -> None:
    """The strategy is only useful if it produces valid bodies too, not just garbage."""
    ref = compile_schema(builtin_schema("chat_completions.json"), "jsonschema")
    seen: set[bool] = set()

    @settings(max_examples=100, deadline=None, database=None)
    @given(body=_chat)
    def probe(body: Any) -> None:
        seen.add(ref.is_valid(body))

    probe()
    assert seen == {True, False}
