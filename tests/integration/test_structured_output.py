"""Structured output and tools through the real thing: `quicserve serve --engine jax` (its defaults:
the tiny random-weight model in a worker process) and the official openai SDK, sync and async,
streamed and not.

The model's weights are random: whatever it finishes is valid only because decoding was masked.
tests/integration/json_schemas.json holds the schemas (nested objects, bounded arrays, enums,
anyOf, $ref, string formats, patterns; made for this test): every answer that ends by itself must
validate (jsonschema, formats checked), answered as response_format json_schema and as the
arguments of a tool call under tool_choice "required".
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.integration.conftest import KEY
from tests.integration.test_gateway_e2e import Gateway

pytest.importorskip("jax")
pytest.importorskip("llguidance")

SCHEMAS: list[dict[str, Any]] = json.loads((Path(__file__).parent / "json_schemas.json").read_text())
MAX_TOKENS = 200
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
             "additionalProperties": False}}}]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def gw(jax_gateway: Gateway) -> Gateway:
    """The session's one JAX gateway (conftest.py): API keys on, every client sends KEY."""
    return jax_gateway


def validator(schema: dict[str, Any]) -> jsonschema.protocols.Validator:
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)  # type: ignore[no-any-return]


def as_parameters(schema: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters are an object: other schemas go in as its one property."""
    if schema.get("type") == "object":
        return schema
    defs = schema.get("$defs")
    inner = {k: v for k, v in schema.items() if k != "$defs"}
    wrapped: dict[str, Any] = {"type": "object", "properties": {"value": inner}, "required": ["value"],
                               "additionalProperties": False}
    if defs:
        wrapped["$defs"] = defs
    return wrapped


async def _each(gw: Gateway, make: Any) -> list[Any]:
    client = openai.AsyncOpenAI(base_url=gw.http + "/v1", api_key=KEY, max_retries=0, timeout=600)
    sem = asyncio.Semaphore(32)

    async def one(i: int, entry: dict[str, Any]) -> Any:
        async with sem:
            return await client.chat.completions.create(**make(i, entry))

    try:
        return list(await asyncio.gather(*(one(i, e) for i, e in enumerate(SCHEMAS))))
    finally:
        await client.close()


def test_every_finished_answer_is_valid_for_its_schema(gw: Gateway) -> None:
    assert len(SCHEMAS) >= 100

    def make(i: int, e: dict[str, Any]) -> dict[str, Any]:
        return dict(model="tiny", messages=[{"role": "user", "content": e["prompt"]}], max_tokens=MAX_TOKENS, seed=i,
                    response_format={"type": "json_schema",
                                     "json_schema": {"name": e["name"], "schema": e["schema"], "strict": True}})

    answers = asyncio.run(_each(gw, make))
    finished = 0
    for e, r in zip(SCHEMAS, answers, strict=True):
        choice = r.choices[0]
        assert choice.finish_reason in ("stop", "length")
        if choice.finish_reason == "stop":
            finished += 1
            validator(e["schema"]).validate(json.loads(choice.message.content))
    print(f"{finished} of {len(SCHEMAS)} finished by themselves, all valid")
    assert finished >= len(SCHEMAS) // 2


def test_every_finished_tool_call_is_valid_for_its_parameters(gw: Gateway) -> None:
    def make(i: int, e: dict[str, Any]) -> dict[str, Any]:
        tool = {"type": "function", "function": {"name": "answer", "parameters": as_parameters(e["schema"])}}
        return dict(model="tiny", messages=[{"role": "user", "content": e["prompt"]}], max_tokens=MAX_TOKENS, seed=i,
                    tools=[tool], tool_choice="required", parallel_tool_calls=False)

    answers = asyncio.run(_each(gw, make))
    finished = 0
    for e, r in zip(SCHEMAS, answers, strict=True):
        choice = r.choices[0]
        if choice.finish_reason == "length":
            continue
        finished += 1
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "answer" and call.id.startswith("call_")
        validator(as_parameters(e["schema"])).validate(json.loads(call.function.arguments))
    print(f"{finished} of {len(SCHEMAS)} tool calls finished by themselves, all valid")
    assert finished >= len(SCHEMAS) // 2


def test_json_object_and_json_schema_sync_and_async_streamed_and_not(gw: Gateway) -> None:
    with openai.OpenAI(base_url=gw.http + "/v1", api_key=KEY, max_retries=0) as client:
        r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=MAX_TOKENS, seed=1,
                                           response_format={"type": "json_object"})
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
        fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
        whole = client.chat.completions.create(model="tiny", messages=USER, max_tokens=MAX_TOKENS, seed=7,
                                               temperature=0, response_format=fmt)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=MAX_TOKENS, seed=7, temperature=0, response_format=fmt,
            stream=True) if c.choices)
    assert whole.choices[0].finish_reason == "stop"
    assert streamed == whole.choices[0].message.content
    validator(WEATHER).validate(json.loads(streamed))

    async def async_side() -> None:
        client = openai.AsyncOpenAI(base_url=gw.http + "/v1", api_key=KEY, max_retries=0)
        r = await client.chat.completions.create(model="tiny", messages=USER, max_tokens=MAX_TOKENS, seed=7,
                                                 temperature=0, response_format=fmt)
        assert r.choices[0].message.content == streamed
        text = ""
        async for c in await client.chat.completions.create(model="tiny", messages=USER, max_tokens=MAX_TOKENS,
                                                            seed=7, temperature=0, response_format=fmt, stream=True):
            text += c.choices[0].delta.content or "" if c.choices else ""
        assert text == streamed
        await client.close()

    asyncio.run(async_side())


def test_regex_choice_and_grammar_extensions_on_both_routes(gw: Gateway) -> None:
    with openai.OpenAI(base_url=gw.http + "/v1", api_key=KEY, max_retries=0) as client:
        r = client.completions.create(model="tiny", prompt="Code: ", max_tokens=40, seed=2,
                                      extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}})
        assert r.choices[0].finish_reason == "stop"
        assert len(r.choices[0].text) == 6 and r.choices[0].text[3] == "-"
        r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=20, seed=3,
                                           extra_body={"structured_outputs": {"choice": ["sunny", "rainy"]}})
        assert r.choices[0].message.content in ("sunny", "rainy")
        text = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt="x", max_tokens=40, seed=4, stream=True,
            extra_body={"structured_outputs": {"grammar": 'start: "ab" | "cd" ("!")?'}}))
        assert text in ("ab", "cd", "cd!")


def test_tool_choice_required_named_and_none_sync_and_async(gw: Gateway) -> None:
    kw: dict[str, Any] = dict(model="tiny", messages=USER, max_tokens=MAX_TOKENS, temperature=0, seed=5, tools=TOOLS)
    with openai.OpenAI(base_url=gw.http + "/v1", api_key=KEY, max_retries=0) as client:
        named = client.chat.completions.create(**kw, tool_choice={"type": "function",
                                                                  "function": {"name": "get_time"}})
        (call,) = named.choices[0].message.tool_calls or []
        assert call.function.name == "get_time" and named.choices[0].finish_reason == "tool_calls"
        assert json.loads(call.function.arguments)["zone"] in ("utc", "cet")
        assert named.choices[0].message.content is None
        required = client.chat.completions.create(**kw, tool_choice="required")
        calls = required.choices[0].message.tool_calls or []
        assert calls and all(c.function.name in ("get_weather", "get_time") for c in calls)
        assert len({c.id for c in calls}) == len(calls)
        none = client.chat.completions.create(**{**kw, "max_tokens": 8}, tool_choice="none")
        assert none.choices[0].message.tool_calls is None and none.choices[0].message.content is not None

    async def async_required() -> None:
        client = openai.AsyncOpenAI(base_url=gw.http + "/v1", api_key=KEY, max_retries=0)
        r = await client.chat.completions.create(**kw, tool_choice="required")
        assert [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls or []] == \
            [(c.function.name, c.function.arguments) for c in calls]
        await client.close()

    asyncio.run(async_required())


def test_a_streamed_tool_call_reassembles_to_the_unstreamed_one(gw: Gateway) -> None:
    kw: dict[str, Any] = dict(model="tiny", messages=USER, max_tokens=MAX_TOKENS, temperature=0, seed=11, tools=TOOLS,
                              tool_choice="required", parallel_tool_calls=False)
    with openai.OpenAI(base_url=gw.http + "/v1", api_key=KEY, max_retries=0) as client:
        whole = client.chat.completions.create(**kw)
        _, calls, reason, chunks = _reassemble(list(client.chat.completions.create(**kw, stream=True)))
    expected = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls or []]
    assert expected and calls == expected
    assert chunks > len(expected)  # the arguments came in pieces, as OpenAI streams them
    assert reason == "tool_calls" == whole.choices[0].finish_reason


def test_tool_results_go_back_into_the_template(gw: Gateway) -> None:
    """The prompt the worker counted is exactly the tiny template's rendering of the tools, the
    assistant's call and the tool's result (one byte a token, plus <s>)."""
    from inference.tokenizer import ByteTokenizer

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "c"}'}}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    with openai.OpenAI(base_url=gw.http + "/v1", api_key=KEY, max_retries=0) as client:
        r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=4)  # type: ignore
    rendered = ByteTokenizer().encode_chat(messages, tools=TOOLS)
    assert r.usage is not None and r.usage.prompt_tokens == len(rendered)
    assert b"21 degrees" in bytes(t for t in rendered if t < 256)


def test_a_schema_that_cannot_be_enforced_is_a_400_naming_why_and_the_server_goes_on(gw: Gateway) -> None:
    deep = '{"type": "object", "properties": {"a": ' * 250 + "{}" + "}}" * 250
    with openai.OpenAI(base_url=gw.http + "/v1", api_key=KEY, max_retries=0) as client:
        for schema, words in ((json.loads(deep), "too complex"), ({"type": "array", "uniqueItems": True},
                                                                  "uniqueItems")):
            for stream in (False, True):
                with pytest.raises(openai.BadRequestError) as ei:
                    client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, stream=stream,
                                                   response_format={"type": "json_schema",
                                                                    "json_schema": {"name": "x", "schema": schema}})
                assert words in str(ei.value)
        r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=4)
        assert r.choices[0].finish_reason in ("stop", "length")


def _reassemble(chunks: list[Any]) -> tuple[str, list[tuple[str, str]], str | None, int]:
    """A streamed chat answer as the SDK's chunks give it: (content, [(name, arguments)] by index,
    finish_reason, how many tool-call deltas came)."""
    text, reason, pieces = "", None, 0
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reason = chunk.choices[0].finish_reason or reason
        text += delta.content or ""
        for tc in delta.tool_calls or []:
            pieces += 1
            acc = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            acc["id"] += tc.id or ""
            acc["name"] += tc.function.name or "" if tc.function else ""
            acc["arguments"] += tc.function.arguments or "" if tc.function else ""
    assert all(c["id"].startswith("call_") for c in calls.values())
    return text, [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)], reason, pieces


def _whole(r: Any) -> tuple[str, list[tuple[str, str]], str | None]:
    m = r.choices[0].message
    return m.content or "", [(c.function.name, c.function.arguments) for c in m.tool_calls or []], \
        r.choices[0].finish_reason


# (what each case checks; the chat request's arguments): every one asked sync and async, streamed and whole
CASES: list[tuple[str, dict[str, Any]]] = [
    ("json_object", dict(messages=USER, response_format={"type": "json_object"})),
    ("choice", dict(messages=USER, extra_body={"structured_outputs": {"choice": ["sunny", "rainy"]}})),
    ("regex", dict(messages=USER, max_tokens=40, extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}})),
    ("grammar", dict(messages=USER, max_tokens=40,
                     extra_body={"structured_outputs": {"grammar": 'start: "ab" | "cd" ("!")?'}})),
    ("auto", dict(messages=USER, tools=TOOLS, tool_choice="auto")),
    ("required", dict(messages=USER, tools=TOOLS, tool_choice="required")),
    ("required-one", dict(messages=USER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)),
    ("named", dict(messages=USER, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})),
    ("none", dict(messages=USER, tools=TOOLS, tool_choice="none", max_tokens=8)),
    ("tool-result", dict(tools=TOOLS, max_tokens=8, messages=[
        *USER, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}])),
]


def _check(case: str, text: str, calls: list[tuple[str, str]], reason: str | None) -> None:
    """What each case promises of one answer, whatever the random weights sampled."""
    assert reason in ("stop", "length", "tool_calls"), reason
    if case in ("required", "required-one", "named"):
        assert reason in ("tool_calls", "length")
        # no content under a forced choice, even when max_tokens cuts a call in its head (seen: two whole
        # calls, then '<tool_call>{"name": "get_wea', finish_reason "length": that fragment is dropped)
        assert text == ""
        if reason == "tool_calls":
            assert calls and all(name in ("get_weather", "get_time") for name, _ in calls)
            for name, args in calls:
                validator(TOOLS[name == "get_time"]["function"]["parameters"]).validate(json.loads(args))
        assert case != "named" or all(name == "get_time" for name, _ in calls)
        assert case != "required-one" or len(calls) <= 1
    elif case == "none" or case.startswith(("json", "choice", "regex", "grammar")):
        assert not calls and reason != "tool_calls"
    if reason != "stop":
        return
    if case == "json_object":
        assert isinstance(json.loads(text), dict)
    elif case == "choice":
        assert text in ("sunny", "rainy")
    elif case == "regex":
        assert len(text) == 6 and text[:3].isupper() and text[3] == "-" and text[4:].isdigit()
    elif case == "grammar":
        assert text in ("ab", "cd", "cd!")
    elif case == "auto" and calls:
        assert reason == "tool_calls"


@pytest.mark.parametrize("case", [c for c, _ in CASES])
def test_each_parameter_sync_and_async_streamed_and_whole_agree(gw: Gateway, case: str) -> None:
    """Greedy and seeded, the four ways of asking give one answer: the streamed one reassembled by
    the SDK (tool calls by index, arguments in pieces) equals the whole one, sync and async."""
    kw: dict[str, Any] = dict(model="tiny", max_tokens=MAX_TOKENS, temperature=0, seed=13) | dict(CASES)[case]
    with openai.OpenAI(base_url=gw.http + "/v1", api_key=KEY, max_retries=0, timeout=120) as client:
        whole = _whole(client.chat.completions.create(**kw))
        text, calls, reason, pieces = _reassemble(list(client.chat.completions.create(**kw, stream=True)))
    _check(case, *whole)
    assert (text, calls, reason) == whole
    assert pieces >= len(calls)

    async def async_side() -> None:
        async with openai.AsyncOpenAI(base_url=gw.http + "/v1", api_key=KEY, max_retries=0, timeout=120) as client:
            assert _whole(await client.chat.completions.create(**kw)) == whole
            chunks = [c async for c in await client.chat.completions.create(**kw, stream=True)]
            assert _reassemble(chunks)[:3] == whole

    asyncio.run(async_side())
