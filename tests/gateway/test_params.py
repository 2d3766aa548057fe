"""Request validation: every bad input is a 400 naming the parameter, then the app still serves.

Types, ranges and shapes are the built-in JSON Schema's (its 400 names the JSON path and the failed
keyword), always enforced, admission on or off; the rest (integer representation, rules across fields,
this server's limits and unsupported features) is params.py's own."""

from __future__ import annotations

import orjson
import pytest

from gateway.api.params import parse_chat, parse_completion
from gateway.errors import APIError

from .doubles import RecordingSink, ScriptedWorkerConnection
from .test_app import CHAT, call, make_app, req

LIMITS = {"default_max_tokens": 16, "max_tokens_limit": 100}


def chat_err(body: object = None, raw: bytes | None = None) -> APIError:
    data = raw if raw is not None else orjson.dumps(body)
    with pytest.raises(APIError) as ei:
        parse_chat(data, **LIMITS)
    assert ei.value.status == 400
    return ei.value


@pytest.mark.parametrize(
    "raw, code, needle",
    [
        (b"", "invalid_json", "empty"),
        (b"{", "invalid_json", "not valid JSON"),
        (b'{"model": "tiny",}', "invalid_json", "not valid JSON"),
        (b"[1, 2]", "invalid_json", "must be a JSON object, not an array"),
        (b'"hi"', "invalid_json", "not a string"[:0] + "a string"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}', "invalid_utf8", "UTF-8"),
        (b'{"model": "ti\xc3', "invalid_utf8", "UTF-8"),
    ],
)
def test_malformed_bodies(raw: bytes, code: str, needle: str) -> None:
    e = chat_err(raw=raw)
    assert e.code == code and needle in e.message


@pytest.mark.parametrize(
    "patch, param, needle",
    [
        ({"model": None}, "model", "failed keyword: required"),
        ({"model": 3}, "model", "failed keyword: type"),
        ({"messages": None}, "messages", "failed keyword: required"),
        ({"messages": "hi"}, "messages", "failed keyword: type"),
        ({"messages": []}, "messages", "failed keyword: minItems"),
        ({"messages": [1]}, "messages[0]", "failed keyword: type"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "robot"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "failed keyword: anyOf"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content", "anyOf"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]},
         "messages[0].content", "only text parts"),
        ({"max_tokens": "5"}, "max_tokens", "failed keyword: type"),
        ({"max_tokens": 1.5}, "max_tokens", "failed keyword: type"),
        ({"max_tokens": 2.0}, "max_tokens", "expected an integer, but got a number"),  # a JSON Schema integer
        ({"max_tokens": True}, "max_tokens", "failed keyword: type"),
        ({"max_tokens": 0}, "max_tokens", "failed keyword: minimum"),
        ({"max_tokens": 101}, "max_tokens", "at most 100"),
        ({"max_tokens": None, "max_completion_tokens": 500}, "max_completion_tokens", "at most 100"),
        ({"max_completion_tokens": 3}, "max_tokens", "not both"),
        ({"temperature": "hot"}, "temperature", "failed keyword: type"),
        ({"temperature": 2.5}, "temperature", "failed keyword: maximum"),
        ({"top_p": 1.5}, "top_p", "failed keyword: maximum"),
        ({"top_p": 0}, "top_p", "> 0"),
        ({"seed": 1.5}, "seed", "failed keyword: type"),
        ({"seed": 7.0}, "seed", "expected an integer"),
        ({"stop": 5}, "stop", "failed keyword: anyOf"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "failed keyword: anyOf"),
        ({"n": 129}, "n", "failed keyword: maximum"),
        ({"n": 0}, "n", "failed keyword: minimum"),
        ({"n": "1"}, "n", "failed keyword: type"),
        ({"n": 1.0}, "n", "expected an integer"),
        ({"logprobs": 1}, "logprobs", "failed keyword: type"),
        ({"top_logprobs": 3}, "top_logprobs", "requires 'logprobs'"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "failed keyword: maximum"),
        ({"user": 7}, "user", "failed keyword: type"),
        ({"stream": "yes"}, "stream", "failed keyword: type"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when 'stream'"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage", "boolean"),
        ({"stream": True, "stream_options": {"bogus": 1}}, "stream_options.bogus", "additionalProperties"),
        ({"frequency_penalty": 2.5}, "frequency_penalty", "failed keyword: maximum"),
        ({"presence_penalty": 3}, "presence_penalty", "failed keyword: maximum"),
        ({"logit_bias": {"a": 2}}, "logit_bias", "failed keyword: pattern"),
        ({"min_tokens": 6}, "min_tokens", "<= 'max_tokens' (5)"),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "failed keyword: required"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "not in 'tools'"),
        ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools", "unique"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema",
         "needs"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
         "not both"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "maxProperties"),
        ({"structured_outputs": {"json": "{oops"}}, "structured_outputs.json", "not JSON"),
        ({"bogus": 1}, "bogus", "failed keyword: additionalProperties"),
    ],
)
def test_bad_chat_params(patch: dict[str, object], param: str, needle: str) -> None:
    body = {**CHAT, **patch}
    body = {k: v for k, v in body.items() if not (v is None and k in ("model", "messages"))}
    e = chat_err(body)
    assert e.param == param, (e.param, e.message)
    assert needle in e.message, e.message
    assert e.type == "invalid_request_error"


def test_a_schema_too_deep_to_pass_on_is_a_400() -> None:
    deep = '{"items": ' * 300 + "{}" + "}" * 300
    e = chat_err(raw=b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "structured_outputs": '
                 b'{"json": ' + deep.encode() + b"}}")
    assert "nested too deeply" in e.message


def test_good_chat_params() -> None:
    g = parse_chat(orjson.dumps({**CHAT, "temperature": 0, "top_p": 1, "stop": "\n", "seed": -3, "n": 1,
                                 "frequency_penalty": 0, "logit_bias": {}, "tools": [], "user": "u",
                                 "messages": [{"role": "system", "content": "s"},
                                              {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                           {"type": "text", "text": "b"}]},
                                              {"role": "assistant", "content": None}]}), **LIMITS)
    assert g.params.temperature == 0.0 and g.params.stop == ("\n",) and g.params.seed == -3
    assert g.messages == ({"role": "system", "content": "s"}, {"role": "user", "content": "ab"},
                          {"role": "assistant", "content": ""})
    assert g.user == "u" and not g.stream


@pytest.mark.parametrize(
    "patch, param, needle",
    [
        ({"prompt": None}, "prompt", "failed keyword: required"),
        ({"prompt": 5}, "prompt", "failed keyword: anyOf"),
        ({"prompt": [[1, 2], [3, 2.0]]}, "prompt", "integer token ids"),
        ({"prompt": ["a", "b"], "n": 65}, "n", "at most 128"),
        ({"prompt": [1, -2]}, "prompt", "failed keyword: anyOf"),
        ({"prompt": [1, 2.0]}, "prompt", "integer token ids"),
        ({"logprobs": 6}, "logprobs", "failed keyword: maximum"),
        ({"logprobs": True}, "logprobs", "failed keyword: type"),
        ({"max_tokens": 0}, "max_tokens", "unless 'echo' is true"),
        ({"best_of": 2, "n": 3}, "best_of", "greater than or equal"),
        ({"best_of": 2, "stream": True}, "best_of", "cannot be used with 'stream'"),
        ({"suffix": "x"}, "suffix", "not supported"),
        ({"messages": []}, "messages", "failed keyword: additionalProperties"),
    ],
)
def test_bad_completion_params(patch: dict[str, object], param: str, needle: str) -> None:
    body = {k: v for k, v in {"model": "tiny", "prompt": "hi", **patch}.items() if v is not None}
    with pytest.raises(APIError) as ei:
        parse_completion(orjson.dumps(body), **LIMITS)
    assert ei.value.status == 400 and ei.value.param == param and needle in ei.value.message


async def test_bad_input_then_next_request_served() -> None:
    """Through the app: status + OpenAI error body, and the next request still works."""
    conn = ScriptedWorkerConnection()
    app = make_app(conn)
    bad = [b"{nope", b'{"model":"tiny","messages":[{"role":"user","content":"\xff"}]}',
           orjson.dumps({**CHAT, "n": 0}), orjson.dumps({**CHAT, "temperature": "x"})]
    for raw in bad:
        s = RecordingSink()
        await call(app, req("/v1/chat/completions", raw=raw), s)
        assert s.status == 400
        err = s.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        s = RecordingSink()
        await call(app, req("/v1/chat/completions", CHAT), s)
        assert s.status == 200 and s.json()["choices"][0]["message"]["content"] == "abcde"
    assert len(conn.submits) == len(bad)


@pytest.mark.parametrize("with_registry", [False, True])
def test_builtin_schema_always_enforced(with_registry: bool) -> None:
    """Admission off (no registry): params.py runs the built-in schema itself; on: the registry ran it
    (with the operator's extra schemas) and params.py does not run it twice. Either way the 400 names
    the JSON path and the keyword. A gRPC call (its own path) is checked as the OpenAI body it is."""
    from gateway.admission.schema import SchemaRegistry
    from gateway.api.config import ApiSettings
    from gateway.api.openai import OpenAIApi
    from gateway.http.types import Request

    api = OpenAIApi(ApiSettings(), SchemaRegistry().validate if with_registry else None)
    for path, parser in (("/v1/chat/completions", parse_chat), ("/quicserve.v1.Inference/Generate", parse_chat)):
        body = orjson.dumps({**CHAT, "temperature": 3, "messages": [{"role": "user", "content": "hi"}]})
        with pytest.raises(APIError) as ei:
            api.parse(parser, Request("POST", path, "", [], body, "http/1.1", "http"))
        assert (ei.value.status, ei.value.param, ei.value.code) == (400, "temperature", "invalid_value")
        assert "failed keyword: maximum" in ei.value.message
    with pytest.raises(APIError) as ei:
        api.parse(parse_completion, Request("POST", "/x", "", [], b'{"model": "tiny", "prompt": [1, -1]}',
                                            "http/1.1", "http"))
    assert ei.value.param == "prompt" and "failed keyword: anyOf" in ei.value.message
    g = api.parse(parse_chat, Request("POST", "/v1/chat/completions", "", [], orjson.dumps(CHAT), "http/1.1", "http"))
    assert g.model == CHAT["model"]


def test_echo_reaches_the_submit_and_allows_max_tokens_zero() -> None:
    """#31: echo (the prompt first, scored when logprobs is set) travels as Submit.echo, never buffered."""
    g = parse_completion(orjson.dumps({"model": "tiny", "prompt": "hi", "echo": True, "max_tokens": 0,
                                       "logprobs": 2}), **LIMITS)
    sub = g.make_submit(7)
    assert sub.echo and not sub.buffered and sub.params.max_tokens == 0 and sub.params.top_logprobs == 2
    plain = parse_completion(orjson.dumps({"model": "tiny", "prompt": "hi", "echo": True}), **LIMITS).make_submit(8)
    assert plain.echo and not plain.buffered
    assert not parse_completion(orjson.dumps({"model": "tiny", "prompt": "hi"}), **LIMITS).make_submit(9).echo
