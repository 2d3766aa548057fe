"""Penalties, logit_bias, repetition_penalty and min_tokens in request bodies (#31): accepted into
SamplingParams on both routes, refused with the same 400 shapes as the other parameters."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.api.params import parse_chat, parse_completion
from gateway.errors import APIError

LIMITS = {"default_max_tokens": 16, "max_tokens_limit": 100}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
COMPLETION = {"model": "m", "prompt": "x"}
ALL = {"presence_penalty": 1.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
       "logit_bias": {"65": 100, "3": -2.5}, "min_tokens": 4}


@pytest.mark.parametrize("parse, base", [(parse_chat, CHAT), (parse_completion, COMPLETION)])
def test_every_setting_reaches_the_sampling_params(parse: Any, base: dict[str, Any]) -> None:
    p = parse({**base, **ALL}, **LIMITS).params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (1.5, -0.5, 1.2)
    assert p.logit_bias == ((3, -2.5), (65, 100.0)) and p.min_tokens == 4 and p.extended


@pytest.mark.parametrize("parse, base", [(parse_chat, CHAT), (parse_completion, COMPLETION)])
def test_defaults_and_neutral_values_leave_the_shared_params(parse: Any, base: dict[str, Any]) -> None:
    plain = parse(base, **LIMITS).params
    neutral = parse({**base, "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1,
                     "logit_bias": {}, "min_tokens": 0}, **LIMITS).params
    assert neutral is plain and not plain.extended


@pytest.mark.parametrize(
    "patch, param, needle, code",
    [
        ({"presence_penalty": 2.5}, "presence_penalty", "failed keyword: maximum", "invalid_value"),
        ({"frequency_penalty": "high"}, "frequency_penalty", "failed keyword: type", "invalid_type"),
        ({"repetition_penalty": 0}, "repetition_penalty", "exclusiveMinimum", "invalid_value"),
        ({"repetition_penalty": 101}, "repetition_penalty", "failed keyword: maximum", "invalid_value"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "failed keyword: pattern", "invalid_value"),
        ({"logit_bias": {"01": 1}}, "logit_bias", "failed keyword: pattern", "invalid_value"),
        ({"logit_bias": {"5": 101}}, "logit_bias[5]", "failed keyword: maximum", "invalid_value"),
        ({"logit_bias": {"9999999999": 1}}, "logit_bias", "below 2**32", "invalid_value"),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "maxProperties", "invalid_value"),
        ({"min_tokens": -1}, "min_tokens", "failed keyword: minimum", "invalid_value"),
        ({"min_tokens": 2.0}, "min_tokens", "expected an integer", "invalid_type"),
        ({"min_tokens": 5, "max_tokens": 3}, "min_tokens", "<= 'max_tokens' (3)", "invalid_value"),
        ({"min_tokens": 17}, "min_tokens", "<= 'max_tokens' (16)", "invalid_value"),
    ],
)
@pytest.mark.parametrize("parse, base", [(parse_chat, CHAT), (parse_completion, COMPLETION)])
def test_bad_values_are_400s_naming_the_parameter(parse: Any, base: dict[str, Any], patch: dict[str, Any],
                                                   param: str, needle: str, code: str) -> None:
    with pytest.raises(APIError) as info:
        parse({**base, **patch}, **LIMITS)
    e = info.value
    assert (e.status, e.param, e.type, e.code) == (400, param, "invalid_request_error", code), e.message
    assert needle in e.message, e.message


def test_chat_min_tokens_checks_max_completion_tokens() -> None:
    with pytest.raises(APIError) as info:
        parse_chat({**CHAT, "max_completion_tokens": 2, "min_tokens": 3}, **LIMITS)
    assert "'max_completion_tokens' (2)" in info.value.message
