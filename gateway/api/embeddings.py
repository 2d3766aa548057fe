"""``POST /v1/embeddings`` (OpenAI's shape), answered by a worker of the model (#31).

``input``: a string, a list of strings, a list of token ids, or a list of them (at most
:data:`MAX_INPUTS`, none empty); each is one question to a worker (in parallel, routed as any
request), whose answer is the unit-length mean (or last-token) pool of the model's final hidden
states as base64 float32 (transport.wire: "Tasks"). ``encoding_format`` ``"float"`` (default: the
floats decoded here) or ``"base64"`` (passed through as the worker sent it: OpenAI's encoding).
``dimensions`` is refused unless it is the model's own size. Extension: ``pooling``, ``"mean"``
(default) or ``"last"``. ``usage.prompt_tokens`` sums the inputs' tokens.
"""

from __future__ import annotations

import asyncio
import base64
import sys
from array import array
from typing import Any

import orjson

from transport.messages import Pooling, Task

from ..errors import APIError
from ..http.types import Request
from .params import parse_json_body
from .prompt_tasks import PromptAnswer, PromptTasks

__all__ = ["EMBEDDINGS_ROUTE", "Embeddings", "MAX_INPUTS", "PARALLEL"]

EMBEDDINGS_ROUTE = "/v1/embeddings"
MAX_INPUTS = 2048  # OpenAI's bound on one request's inputs
PARALLEL = 64  # a request's inputs in flight at once (the rest wait): one request cannot flood the workers
_POOLING = {"mean": Pooling.MEAN, "last": Pooling.LAST}
_FORMATS = ("float", "base64")
_KNOWN = frozenset({"model", "input", "encoding_format", "dimensions", "user", "pooling"})


def _bad(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def parse_inputs(v: Any) -> list[str | tuple[int, ...]]:
    """``input`` as prompts: texts or token-id tuples (a 400 naming what is wrong)."""
    if type(v) is str:
        items: list[Any] = [v]
    elif type(v) is list and v and all(type(t) is int for t in v):
        items = [v]
    elif type(v) is list and v:
        items = v
    else:
        raise _bad("'input' must be a non-empty string, array of strings, array of token ids, or array of "
                   "arrays of token ids.", "input", "invalid_type")
    if len(items) > MAX_INPUTS:
        raise _bad(f"'input' has {len(items)} items; at most {MAX_INPUTS} are allowed.", "input")
    out: list[str | tuple[int, ...]] = []
    for x in items:
        if type(x) is str and x:
            out.append(x)
        elif type(x) is list and x and all(type(t) is int and 0 <= t < 1 << 32 for t in x):
            out.append(tuple(x))
        else:
            raise _bad("Each 'input' item must be a non-empty string or a non-empty array of token ids.", "input")
    return out


def _floats(b64: str) -> list[float]:
    a = array("f", base64.b64decode(b64))
    if sys.byteorder == "big":
        a.byteswap()
    return a.tolist()


class Embeddings:
    """The route, over the shared :class:`PromptTasks`."""

    def __init__(self, tasks: PromptTasks) -> None:
        self.tasks = tasks

    async def __call__(self, req: Request) -> tuple[int, bytes]:
        d = parse_json_body(req.body)
        model = d.get("model")
        if type(model) is not str or not model:
            raise _bad("'model' is required (a string).", "model", "invalid_type")
        unknown = sorted(set(d) - _KNOWN)
        if unknown:
            raise _bad(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], "unknown_parameter")
        inputs = parse_inputs(d.get("input"))
        fmt = d.get("encoding_format") or "float"
        if fmt not in _FORMATS:
            raise _bad(f"'encoding_format' must be 'float' or 'base64', not {fmt!r}.", "encoding_format")
        pooling = _POOLING.get(d.get("pooling") or "mean")
        if pooling is None:
            raise _bad("'pooling' must be 'mean' or 'last'.", "pooling")
        dims = d.get("dimensions")
        if dims is not None and (type(dims) is not int or dims < 1):
            raise _bad("'dimensions' must be a positive integer.", "dimensions", "invalid_type")
        t = self.tasks
        gate = asyncio.Semaphore(PARALLEL)

        async def one(x: str | tuple[int, ...]) -> PromptAnswer:
            async with gate:
                return await t.ask(t.request(model, task=Task.EMBED, pooling=pooling,
                                             prompt=x if type(x) is str else None,
                                             prompt_token_ids=x if type(x) is tuple else None))

        answers = await asyncio.gather(*(one(x) for x in inputs))
        size = len(base64.b64decode(answers[0].text)) // 4
        if dims is not None and dims != size:
            raise _bad(f"'dimensions' = {dims} is not supported: the embeddings of `{model}` have {size} dimensions "
                       "(this server does not shorten them).", "dimensions", "unsupported_parameter")
        data = [{"object": "embedding", "index": i, "embedding": a.text if fmt == "base64" else _floats(a.text)}
                for i, a in enumerate(answers)]
        used = sum(a.finish.prompt_tokens for a in answers)
        return 200, orjson.dumps({"object": "list", "data": data, "model": model,
                                  "usage": {"prompt_tokens": used, "total_tokens": used}})
