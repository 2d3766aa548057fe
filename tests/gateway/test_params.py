"""Request validation: every bad input is a 400 naming the parameter, then the app still serves."""

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
        ({"model": None}, "model", "provide a model"),
        ({"model": 3}, "model", "expected a string, but got an integer"),
        ({"messages": None}, "messages", "Missing required"),
        ({"messages": "hi"}, "messages", "expected an array"),
        ({"messages": []}, "messages", "at least one"),
        ({"messages": [1]}, "messages[0]", "expected an object"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "robot"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "expected a string"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content", "text parts"),
        ({"max_tokens": "5"}, "max_tokens", "expected an integer, but got a string"),
        ({"max_tokens": 1.5}, "max_tokens", "expected an integer"),
        ({"max_tokens": True}, "max_tokens", "expected an integer, but got a boolean"),
        ({"max_tokens": 0}, "max_tokens", ">= 1"),
        ({"max_tokens": 101}, "max_tokens", "at most 100"),
        ({"max_tokens": None, "max_completion_tokens": 500}, "max_completion_tokens", "at most 100"),
        ({"max_completion_tokens": 3}, "max_tokens", "not both"),
        ({"temperature": "hot"}, "temperature", "expected a number"),
        ({"temperature": 2.5}, "temperature", "between 0 and 2"),
        ({"top_p": 1.5}, "top_p", "between 0 and 1"),
        ({"top_p": 0}, "top_p", "> 0"),
        ({"seed": 1.5}, "seed", "expected an integer"),
        ({"stop": 5}, "stop", "a string or an array of strings"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"n": 2}, "n", "not supported"),
        ({"n": 0}, "n", "between 1"),
        ({"n": "1"}, "n", "expected an integer"),
        ({"logprobs": 1}, "logprobs", "expected a boolean"),
        ({"top_logprobs": 3}, "top_logprobs", "requires 'logprobs'"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "between 0 and 20"),
        ({"user": 7}, "user", "expected a string"),
        ({"stream": "yes"}, "stream", "expected a boolean"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when 'stream'"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage", "boolean"),
        ({"stream": True, "stream_options": {"bogus": 1}}, "stream_options", "bogus"),
        ({"frequency_penalty": 0.5}, "frequency_penalty", "not supported"),
        ({"presence_penalty": 3}, "presence_penalty", "between -2 and 2"),
        ({"logit_bias": {"1": 2}}, "logit_bias", "not supported"),
        ({"tools": [{"type": "function"}]}, "tools", "not supported"),
        ({"response_format": {"type": "json_object"}}, "response_format", "text"),
        ({"bogus": 1}, "bogus", "Unrecognized request argument supplied: bogus"),
    ],
)
def test_bad_chat_params(patch: dict[str, object], param: str, needle: str) -> None:
    body = {**CHAT, **patch}
    body = {k: v for k, v in body.items() if not (v is None and k in ("model", "messages"))}
    e = chat_err(body)
    assert e.param == param, (e.param, e.message)
    assert needle in e.message, e.message
    assert e.type == "invalid_request_error"


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
        ({"prompt": None}, "prompt", "Missing required"),
        ({"prompt": 5}, "prompt", "a string or an array of token ids"),
        ({"prompt": ["a", "b"]}, "prompt", "Batched prompts"),
        ({"prompt": [1, -2]}, "prompt", "token ids"),
        ({"logprobs": 6}, "logprobs", "between 0 and 5"),
        ({"logprobs": True}, "logprobs", "expected an integer"),
        ({"echo": True}, "echo", "not supported"),
        ({"best_of": 2}, "best_of", "not supported"),
        ({"suffix": "x"}, "suffix", "not supported"),
        ({"messages": []}, "messages", "Unrecognized"),
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
           orjson.dumps({**CHAT, "n": 3}), orjson.dumps({**CHAT, "temperature": "x"})]
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
