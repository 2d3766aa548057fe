"""What a request of several sequences adds up to (gateway.api.fanout): seeds, usage, the merged body.

Sans-I/O: finishes and parsed bodies in, numbers and bytes out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from transport.messages import Finish, FinishReason

__all__ = ["sub_seed", "usage", "merged_body"]

_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / phi: spreads j over the seed space


def sub_seed(seed: int, j: int) -> int:
    """The seed of sequence ``j`` of a prompt whose request has ``seed`` (int64, as the wire carries it);
    j = 0 keeps the request's own, so choice 0 is what ``n`` = 1 gives."""
    if j == 0:
        return seed
    v = (seed + j * _GOLDEN) % (1 << 64)
    return v - (1 << 64) if v >= 1 << 63 else v


def usage(fins: Sequence[Finish | None], per: int) -> Finish:
    """The request's usage from its sequences' finishes (``per`` consecutive ones a prompt): each
    prompt's tokens once, every sequence's completion tokens; a prompt's ``cached_tokens`` its least
    cached sequence's."""
    done = [f for f in fins if f is not None]
    prompt = cached = completion = 0
    for k in range(0, len(done), per):
        group = done[k : k + per]
        prompt += group[0].prompt_tokens
        cached += min(f.cached_tokens for f in group)
        completion += sum(f.completion_tokens for f in group)
    return Finish(0, FinishReason.STOP, prompt, completion, cached)


def merged_body(bodies: list[dict[str, Any]], rid: str, fins: Sequence[Finish | None], per: int, best_n: int,
                keep_logprobs: bool) -> bytes:
    """One whole response from each sequence's (parsed) body: their choices in order, re-indexed;
    ``best_n`` > 0 (best_of): of every prompt's ``per``, the ``best_n`` with the highest cumulative
    logprob, best first (their logprobs dropped unless ``keep_logprobs``)."""
    choices = [b["choices"][0] for b in bodies]
    if best_n:
        choices = _best(choices, per, best_n, keep_logprobs)
    for i, c in enumerate(choices):
        c["index"] = i
    u = usage(fins, per)
    out = bodies[0]
    out["id"] = rid
    out["choices"] = choices
    out["usage"] = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                    "total_tokens": u.prompt_tokens + u.completion_tokens,
                    "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}
    return orjson.dumps(out)


def _best(choices: list[dict[str, Any]], per: int, n: int, keep_logprobs: bool) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for k in range(0, len(choices), per):
        group = choices[k : k + per]
        group.sort(key=lambda c: -sum(lp for lp in c["logprobs"]["token_logprobs"] if lp is not None))
        for c in group[:n]:
            if not keep_logprobs:
                c["logprobs"] = None
            out.append(c)
    return out
