"""OpenAI's ``x-ratelimit-*`` response headers and the 429 a refused request gets.

Rendered once per admitted request, so cheap by construction: the
``limit`` pair of each rule is built once (:func:`limit_pair`, kept by the
rule's plan step), ``remaining`` is one ``b"%d"``, and ``reset`` texts are
cached by their resolution step (milliseconds below a minute, seconds above:
a steadily used window resets in the same few texts over and over).
"""

from __future__ import annotations

import math

from ..errors import APIError

__all__ = ["Headers", "LIMIT_REQUESTS", "LIMIT_TOKENS", "REMAINING_REQUESTS", "REMAINING_TOKENS",
           "RESET_REQUESTS", "RESET_TOKENS", "limit_pair", "reset_pair", "reset_text", "format_reset", "render", "refusal"]

Headers = tuple[tuple[bytes, bytes], ...]
Status = tuple[float, float, float]  # (limit, remaining, reset seconds) of the tightest rule of a unit

LIMIT_REQUESTS, REMAINING_REQUESTS, RESET_REQUESTS = (
    b"x-ratelimit-limit-requests", b"x-ratelimit-remaining-requests", b"x-ratelimit-reset-requests")
LIMIT_TOKENS, REMAINING_TOKENS, RESET_TOKENS = (
    b"x-ratelimit-limit-tokens", b"x-ratelimit-remaining-tokens", b"x-ratelimit-reset-tokens")


def format_reset(seconds: float) -> str:
    """OpenAI's duration form for ``x-ratelimit-reset-*``: ``20ms``, ``1.5s``, ``6m0s``, ``1h2m3s``."""
    if seconds < 1.0:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    if seconds < 60.0:
        return f"{math.ceil(seconds * 1000) / 1000:g}s"
    total = math.ceil(seconds)
    h, rem = divmod(total, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m}m{s}s" if h else f"{m}m{s}s"


def limit_pair(unit: str, limit: float) -> tuple[bytes, bytes]:
    """The ``x-ratelimit-limit-*`` header of a rule (built once per rule, not per request)."""
    return (LIMIT_TOKENS if unit == "tokens" else LIMIT_REQUESTS), b"%d" % limit


_RESETS: dict[int, tuple[bytes, bytes]] = {}  # by resolution step: +ms (requests) below a minute, -s above;
_ceil = math.ceil  # tokens: the same, offset by _TOKENS_STEP


def reset_pair(seconds: float, tokens: bool) -> tuple[bytes, bytes]:
    """The ``x-ratelimit-reset-*`` header, one tuple shared by every request that resets in the same
    step (ms below a minute, s above)."""
    step = _ceil(seconds * 1000) if seconds < 60.0 else -_ceil(seconds)
    if tokens:
        step += _TOKENS_STEP
    pair = _RESETS.get(step)
    if pair is None:
        if len(_RESETS) > 8192:
            _RESETS.clear()
        pair = _RESETS[step] = (RESET_TOKENS if tokens else RESET_REQUESTS), format_reset(seconds).encode()
    return pair


_TOKENS_STEP = 1 << 62  # beyond any step a window (finite seconds) can reach


def reset_text(seconds: float) -> bytes:
    return reset_pair(seconds, False)[1]


def render(requests: Status | None, tokens: Status | None) -> Headers:
    """The headers for the tightest rule of each unit (none for a unit no rule applied to)."""
    out: Headers = ()
    if requests is not None:
        out = ((LIMIT_REQUESTS, b"%d" % requests[0]), (REMAINING_REQUESTS, b"%d" % requests[1]),
               reset_pair(requests[2], False))
    if tokens is not None:
        out += ((LIMIT_TOKENS, b"%d" % tokens[0]), (REMAINING_TOKENS, b"%d" % tokens[1]),
                reset_pair(tokens[2], True))
    return out


def refusal(wait: float, unit: str, headers: Headers) -> APIError:
    """The 429 for a request a rate rule refused: ``wait`` seconds (``inf``: it can never fit)."""
    if math.isinf(wait):
        return APIError(429, f"Request too large: it needs more {unit} than the limit allows in a whole "
                        "window; lower max_tokens or the prompt.", unit, None, "rate_limit_exceeded", None,
                        headers)
    return APIError(429, f"Rate limit reached for {unit}; retry in {wait:.3g} s.", unit, None,
                    "rate_limit_exceeded", wait, headers)
