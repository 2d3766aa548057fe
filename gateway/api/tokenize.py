"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes), answered by a worker of the model (#31).

``/tokenize``: ``{model, prompt}`` or ``{model, messages}`` (a chat, rendered by the worker's
template as a chat completion's prompt is) -> ``{tokens, count, max_model_len}``;
``/detokenize``: ``{model, tokens}`` -> ``{prompt}``. The gateway may not hold the tokenizer, so a
worker answers (:mod:`gateway.api.prompt_tasks`).
"""

from __future__ import annotations

from typing import Any

import orjson

from transport.messages import Task

from ..errors import APIError
from ..http.types import Request
from .params import parse_chat, parse_json_body
from .prompt_tasks import PromptTasks

__all__ = ["TOKENIZE_ROUTE", "DETOKENIZE_ROUTE", "Tokenize"]

TOKENIZE_ROUTE = "/tokenize"
DETOKENIZE_ROUTE = "/detokenize"


def _bad(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def _model(d: dict[str, Any]) -> str:
    model = d.get("model")
    if type(model) is not str or not model:
        raise _bad("'model' is required (a string).", "model", "invalid_type")
    return model


class Tokenize:
    """Both routes, over the shared :class:`PromptTasks`."""

    def __init__(self, tasks: PromptTasks) -> None:
        self.tasks = tasks

    async def tokenize(self, req: Request) -> tuple[int, bytes]:
        d = parse_json_body(req.body)
        model = _model(d)
        t = self.tasks
        if ("prompt" in d) == ("messages" in d):
            raise _bad("Give one of 'prompt' (a string) or 'messages' (a chat).", "prompt")
        if "prompt" in d:
            prompt = d["prompt"]
            if type(prompt) is not str:
                raise _bad("'prompt' must be a string.", "prompt", "invalid_type")
            g = t.request(model, task=Task.TOKENIZE, prompt=prompt)
        else:  # the chat checked and normalised as a chat completion's is
            chat = parse_chat({"model": model, "messages": d["messages"]}, default_max_tokens=1, max_tokens_limit=1)
            g = t.request(model, task=Task.TOKENIZE, messages=chat.messages)
        a = await t.ask(g)
        return 200, orjson.dumps({"tokens": a.token_ids, "count": len(a.token_ids), "max_model_len": a.max_model_len})

    async def detokenize(self, req: Request) -> tuple[int, bytes]:
        d = parse_json_body(req.body)
        model = _model(d)
        tokens = d.get("tokens")
        if type(tokens) is not list or not all(type(x) is int and 0 <= x < 1 << 32 for x in tokens):
            raise _bad("'tokens' must be an array of token ids.", "tokens", "invalid_type")
        a = await self.tasks.ask(self.tasks.request(model, task=Task.DETOKENIZE, prompt_token_ids=tuple(tokens)))
        return 200, orjson.dumps({"prompt": a.text})
