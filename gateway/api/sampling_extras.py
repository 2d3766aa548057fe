"""The rarer sampling settings of a request body (#31), as SamplingParams keywords: OpenAI's
``presence_penalty``, ``frequency_penalty`` and ``logit_bias``, and vLLM's ``repetition_penalty`` and
``min_tokens`` (extensions). The route's built-in schema already checked types and ranges
(``gateway/admission/schemas/``); what is left is a JSON integer's representation, ``logit_bias``'s keys
as token ids, and ``min_tokens`` against ``max_tokens``. Whether a ``logit_bias`` id is in the model's
vocabulary only the worker knows: it refuses one that is not (INVALID_REQUEST, a 400 here).
"""

from __future__ import annotations

from typing import Any

from ..errors import APIError

__all__ = ["EXTRA_KEYS", "sampling_extras", "check_min_tokens"]

EXTRA_KEYS = frozenset({"presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens"})
_TOKEN_ID_LIMIT = 1 << 32  # the wire's token ids are uint32


def _bad(message: str, param: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def sampling_extras(d: dict[str, Any]) -> dict[str, Any]:
    """The settings of ``d`` that differ from their defaults, as SamplingParams keywords ({} for none)."""
    out: dict[str, Any] = {}
    for key in ("presence_penalty", "frequency_penalty"):
        v = d.get(key)
        if v:  # a number in [-2, 2] (the schema)
            out[key] = float(v)
    r = d.get("repetition_penalty")
    if r is not None and r != 1:  # a number in (0, 100] (the schema)
        out["repetition_penalty"] = float(r)
    bias = d.get("logit_bias")
    if bias:  # {"token id": -100..100} (the schema: keys are decimal integers)
        pairs = []
        for key, value in bias.items():
            tok = int(key)
            if tok >= _TOKEN_ID_LIMIT:
                raise _bad(f"Invalid 'logit_bias' key {key!r}: token ids are below 2**32.", "logit_bias")
            pairs.append((tok, float(value)))
        out["logit_bias"] = tuple(sorted(pairs))
    m = d.get("min_tokens")
    if m is not None:
        if type(m) is not int:
            raise _bad("Invalid type for 'min_tokens': expected an integer, but got a number.", "min_tokens",
                       "invalid_type")
        if m:
            out["min_tokens"] = m
    return out


def check_min_tokens(extras: dict[str, Any], max_tokens: int, param: str) -> None:
    """``min_tokens`` may not exceed the request's ``max_tokens`` (its default included)."""
    m = extras.get("min_tokens", 0)
    if m > max_tokens:
        raise _bad(f"Invalid value for 'min_tokens': {m}; it must be <= '{param}' ({max_tokens}).", "min_tokens")
