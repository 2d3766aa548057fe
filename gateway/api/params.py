"""Parse and validate OpenAI request bodies into what a worker Submit needs.

Sans-I/O: bytes in, :class:`GenerationRequest` out, or an :class:`APIError`
(400 with ``param`` naming the offending field) -- never a half-checked
request.

Two layers. Every body is first checked against its route's built-in JSON
Schema (``gateway/admission/schemas/``, compiled with jsonschema-rs): types,
ranges, required and unknown fields, message shapes; its 400 names the JSON
path and the failed keyword. That check is not optional: :func:`parse_chat`
and :func:`parse_completion` run it themselves unless the caller says it
already did (``schema_checked=True``: :class:`~gateway.api.openai.OpenAIApi`
with the admission stage's registry, which holds the built-in schemas plus
the operator's extra ones). Turning admission off drops the operator's
schemas, never the built-in ones. What is left here is what a schema cannot
say: a JSON integer's representation (JSON Schema's ``integer`` admits
``1.0`` and ``1e30``; the worker's wire needs an int), rules across fields,
this server's limits and unsupported features, defaults from config, and the
conversion into :class:`~transport.messages.SamplingParams`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import orjson

from transport.messages import Pooling, SamplingParams, Submit, Task

from ..admission.schema import builtin_validator
from ..errors import APIError
from ..routing.rollout import Rollout
from .sampling_extras import EXTRA_KEYS, check_min_tokens, sampling_extras
from .structured import chat_constraint, completion_constraint, with_constraint
from .tools import ToolSetup

__all__ = ["GenerationRequest", "Fan", "parse_json_body", "parse_chat", "parse_completion", "ROLES"]

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

Prompts = tuple[tuple[str | None, tuple[int, ...] | None], ...]  # a batch's prompts: (text, token ids) each


@dataclass(frozen=True, slots=True)
class Fan:
    """Several sequences in one request (``n`` > 1, ``best_of``, a batch of prompts: gateway.api.fanout)."""

    n: int  # choices per prompt
    best_of: int  # > n: this many sequences per prompt, the n most likely returned (completions); else 0
    batch: Prompts | None  # a batch's prompts; None: the request's one


@dataclass(slots=True)
class GenerationRequest:
    """A validated chat or completion request."""

    chat: bool
    model: str
    params: SamplingParams
    stream: bool
    include_usage: bool
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    user: str | None = None
    deadline_ms: int = 0
    service_tier: str | None = None  # OpenAI's; admission reads it as a priority hint
    trace: dict[str, str] | None = None  # W3C trace context for the worker's spans (tracing on)
    # An answer about the prompt (gateway.api.prompt_tasks: embeddings, tokenize), or echo (#31)
    task: Task = Task.GENERATE
    pooling: Pooling = Pooling.MEAN
    echo: bool = False  # completions: the prompt comes first, with its logprobs when asked
    prompt_tokens: int = -1  # the prompt-size estimate, once worked out (prompt_estimate); -1: not yet
    route: str = ""  # the routing rule (leaf) that chose the model; "" = none did
    rollout: Rollout | None = None  # the gray release that placed it (it reports its end there)
    tools: ToolSetup | None = None  # chat tools: the writers read tool calls out of the text (gateway.api.tools)
    # Several sequences in one request (gateway.api.fanout); then params.max_tokens is their total
    fan: Fan | None = None


    def prompt_estimate(self) -> int:
        """Prompt tokens, estimated without a tokenizer (about 4 bytes of text a token); worked out
        once per request (admission and routing both ask)."""
        n = self.prompt_tokens
        if n >= 0:
            return n
        if self.messages is not None:
            n = 0
            for m in self.messages:  # parse_chat made every content a str
                n += len(m["content"]) // 4 + 4
        elif self.prompt_token_ids is not None:
            n = len(self.prompt_token_ids)
        else:
            n = 0 if self.prompt is None else len(self.prompt) // 4 + 1
        self.prompt_tokens = n
        return n

    def make_submit(self, request_id: int) -> Submit:
        # A whole (non-streaming, no logprobs) response is delivered by the worker in one piece.
        if self.task or self.echo:  # (transport.wire: Tasks) an answer is buffered, an echo never
            return Submit(request_id, self.model, self.params, self.prompt, self.prompt_token_ids, self.messages,
                          self.deadline_ms, 0, self.trace, True, bool(self.task), task=self.task,
                          pooling=self.pooling, echo=self.echo)
        return Submit(request_id, self.model, self.params, self.prompt, self.prompt_token_ids,
                      self.messages, self.deadline_ms, 0, self.trace, True, not self.stream and not self.logprobs)


def _bad(message: str, param: str | None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def parse_json_body(body: bytes) -> dict[str, Any]:
    """JSON object or a 400 that says what is wrong (invalid UTF-8, bad JSON, not an object)."""
    if not body:
        raise _bad("The request body is empty; expected a JSON object.", None, "invalid_json")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as u:
            raise _bad(f"The request body is not valid UTF-8 (byte offset {u.start}).", None,
                       "invalid_utf8") from None
        raise _bad(f"The request body is not valid JSON: {e}", None, "invalid_json") from None
    if type(data) is not dict:
        raise _bad(f"The request body must be a JSON object, not {_json_type(data)}.", None, "invalid_json")
    return data


def _type_error(param: str, expected: str, value: Any) -> APIError:
    return _bad(f"Invalid type for '{param}': expected {expected}, but got {_json_type(value)}.", param,
                "invalid_type")


def _ints(d: dict[str, Any], keys: tuple[str, ...]) -> None:
    """The integer fields, as ints: the schema's ``integer`` also admits 1.0 and 1e30 (JSON numbers)."""
    for key in keys:
        v = d.get(key)
        if v is not None and type(v) is not int:
            raise _type_error(key, "an integer", v)


_CHAT_INTS = ("n", "max_completion_tokens", "top_k", "seed", "top_logprobs")
_COMPLETION_INTS = ("n", "top_k", "seed", "logprobs", "best_of")


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(v), type(v).__name__)


_RARE = frozenset({"n", "max_completion_tokens", "top_k", "seed", "stop", "user", "stream_options",
                   "frequency_penalty", "presence_penalty", "logit_bias", "ignore_eos", "logprobs", "top_logprobs",
                   "best_of"}) | EXTRA_KEYS


def _common(d: dict[str, Any], max_tokens_limit: int, default_max: int,
            chat: bool) -> tuple[str, SamplingParams, bool, bool, str | None, bool, int]:
    """What a schema cannot say, of a body the route's schema accepted (types, ranges, known keys):
    this server's limits and unsupported features, rules across fields, defaults, conversion."""
    model: str = d["model"]
    max_tokens: int | None = d.get("max_tokens")
    if max_tokens is not None and type(max_tokens) is not int:
        raise _type_error("max_tokens", "an integer", max_tokens)
    param = "max_tokens"
    temperature = d.get("temperature")
    temperature = 1.0 if temperature is None else float(temperature)
    top_p = d.get("top_p")
    top_p = 1.0 if top_p is None else float(top_p)
    if top_p == 0.0:
        raise _bad("Invalid value for 'top_p': 0; it must be > 0 and <= 1.", "top_p", "invalid_value")
    stream = d.get("stream") is True
    top_k = 0
    seed = user = None
    stop: tuple[str, ...] = ()
    include_usage = ignore_eos = logprobs = False
    top_n = 0
    extras: dict[str, Any] = {}
    if not _RARE.isdisjoint(d):  # the rest only when the request uses any of it
        _ints(d, _CHAT_INTS if chat else _COMPLETION_INTS)
        if chat:
            mt = d.get("max_completion_tokens")
            if mt is not None and max_tokens is not None and mt != max_tokens:
                raise _bad("Give 'max_tokens' or 'max_completion_tokens', not both with different values.",
                           "max_tokens", "invalid_value")
            if mt is not None:
                max_tokens, param = mt, "max_completion_tokens"
        top_k = d.get("top_k") or 0
        seed = d.get("seed")
        v = d.get("stop")
        if v is not None:
            stop = ((v,) if v else ()) if type(v) is str else tuple(x for x in v if x)
        user = d.get("user")
        so = d.get("stream_options")
        if so is not None:
            if not stream:
                raise _bad("'stream_options' is only allowed when 'stream' is true.", "stream_options",
                           "invalid_value")
            include_usage = so.get("include_usage") is True
        extras = sampling_extras(d)  # penalties, logit_bias, min_tokens (gateway.api.sampling_extras)
        ignore_eos = d.get("ignore_eos") is True
        if chat:
            logprobs = d.get("logprobs") is True
            top = d.get("top_logprobs") or 0
            if top > 0 and not logprobs:
                raise _bad("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs", "invalid_value")
            top_n = top
        else:
            lpn = d.get("logprobs")
            logprobs = lpn is not None
            top_n = lpn or 0
    if max_tokens is None:
        max_tokens = default_max
    elif max_tokens > max_tokens_limit:
        raise _bad(f"Invalid value for '{param}': {max_tokens}; this server allows at most {max_tokens_limit}.",
                   param, "invalid_value")
    params = _sampling(max_tokens, temperature, top_p, top_k, seed, stop, ignore_eos, logprobs, top_n)
    if extras:
        check_min_tokens(extras, max_tokens, param)
        params = replace(params, **extras)
    return model, params, stream, include_usage, user, logprobs, top_n


_CHAT_RARE = frozenset({"tools", "tool_choice", "response_format", "structured_outputs"})

_PARAMS_CACHE: dict[tuple[Any, ...], SamplingParams] = {}
_PARAMS_CACHE_MAX = 4096


def _sampling(max_tokens: int, temperature: float, top_p: float, top_k: int, seed: int | None,
              stop: tuple[str, ...], ignore_eos: bool, logprobs: bool, top_n: int) -> SamplingParams:
    """One shared (immutable) SamplingParams per distinct setting: building a frozen dataclass of ten
    fields costs more than the tuple lookup, and most traffic repeats a few settings."""
    key = (max_tokens, temperature, top_p, top_k, seed, stop, ignore_eos, logprobs, top_n)
    sp = _PARAMS_CACHE.get(key)
    if sp is None:
        if len(_PARAMS_CACHE) >= _PARAMS_CACHE_MAX:
            _PARAMS_CACHE.clear()
        sp = _PARAMS_CACHE[key] = SamplingParams(max_tokens, temperature, top_p, top_k, seed, stop, (),
                                                 ignore_eos, logprobs, top_n)
    return sp


def _content_text(content: Any, i: int) -> str:
    if type(content) is str:
        return content
    if content is None:  # an assistant turn without content (the schema allows it only there)
        return ""
    parts = []
    for part in content:  # text, image or audio parts (the schema): only text is served here
        if part["type"] != "text":
            raise _bad(f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                       f"supported, not {part['type']!r}.", f"messages[{i}].content", "invalid_value")
        parts.append(part["text"])
    return "".join(parts)


_TOOL_KEYS = ("tool_calls", "tool_call_id", "name")


def _messages(d: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    out = []
    for i, m in enumerate(d["messages"]):
        msg = {"role": m["role"], "content": _content_text(m.get("content"), i)}
        if len(m) > 2:  # a tool call, a tool's result or a name: the chat template renders them
            for key in _TOOL_KEYS:
                if key in m:
                    msg[key] = m[key]
        out.append(msg)
    return tuple(out)


_CHAT_SCHEMA = builtin_validator("/v1/chat/completions")
_COMPLETIONS_SCHEMA = builtin_validator("/v1/completions")


def parse_chat(body: bytes | dict[str, Any], *, default_max_tokens: int, max_tokens_limit: int,
               deadline_ms: int = 0, schema_checked: bool = False) -> GenerationRequest:
    """``POST /v1/chat/completions`` body (bytes, or the JSON object already parsed) -> GenerationRequest.

    ``schema_checked``: the caller already checked ``body`` against the built-in chat schema."""
    d = body if type(body) is dict else parse_json_body(body)  # type: ignore[arg-type]
    if not schema_checked:
        _CHAT_SCHEMA(d)
    model, params, stream, include_usage, user, logprobs, top_n = _common(
        d, max_tokens_limit, default_max_tokens, chat=True)
    messages = _messages(d)
    tools = None
    if not _CHAT_RARE.isdisjoint(d):
        constraint = chat_constraint(d)
        params, tools = with_constraint(params, constraint), constraint[2]
    tier = d.get("service_tier")
    g = GenerationRequest(True, model, params, stream, include_usage, None, None, messages, logprobs,
                          top_n, user, deadline_ms, tier if type(tier) is str else None)
    if tools is not None and tools.parse:
        g.tools = tools
    if "n" in d and (n := d["n"]) is not None and n > 1:
        _fan(g, n, 0, None)
    return g


MAX_SEQUENCES = 128  # sequences one request may ask for (prompts x max(n, best_of))


def _fan(g: GenerationRequest, n: int, best_of: int, batch: Prompts | None) -> None:
    """``g`` runs as several sequences (n > 1, best_of > n, a batch of prompts): gateway.api.fanout."""
    total = (len(batch) if batch is not None else 1) * max(n, best_of)
    if total > MAX_SEQUENCES:
        raise _bad(f"This request asks for {total} sequences (prompts x max(n, best_of)); this server allows at "
                   f"most {MAX_SEQUENCES} per request.", "n", "invalid_value")
    g.fan = Fan(n, best_of, batch)
    # Admission and routing see the whole request: every prompt once, every sequence's max_tokens (the
    # fan gives each sequence max_tokens / sequences; the end settles what they used, all of them).
    g.params = replace(g.params, max_tokens=g.params.max_tokens * total)
    if batch is not None:
        g.prompt_tokens = sum(len(ids) if ids is not None else len(text or "") // 4 + 1 for text, ids in batch)


def _batch_prompt(p: Any) -> tuple[str | None, tuple[int, ...] | None]:
    if type(p) is str:
        return p, None
    if all(type(t) is int for t in p):
        return None, tuple(p)
    raise _type_error("prompt", "arrays of integer token ids", p)


def parse_completion(body: bytes | dict[str, Any], *, default_max_tokens: int, max_tokens_limit: int,
                     deadline_ms: int = 0, schema_checked: bool = False) -> GenerationRequest:
    """``POST /v1/completions`` body (bytes, or the JSON object already parsed) -> GenerationRequest
    (one prompt: text or token ids). ``schema_checked`` as for :func:`parse_chat`."""
    d = body if type(body) is dict else parse_json_body(body)  # type: ignore[arg-type]
    if not schema_checked:
        _COMPLETIONS_SCHEMA(d)
    model, params, stream, include_usage, user, logprobs, top_n = _common(
        d, max_tokens_limit, default_max_tokens, chat=False)
    prompt = d["prompt"]  # a string, strings, token ids (uint32), or arrays of them (the schema)
    text: str | None = None
    ids: tuple[int, ...] | None = None
    batch = None
    if type(prompt) is list and len(prompt) == 1 and type(prompt[0]) in (str, list):
        prompt = prompt[0]  # a batch of one
    if type(prompt) is str:
        text = prompt
    elif type(prompt[0]) in (str, list):  # a batch: choice index = prompt index * n + j (OpenAI's)
        batch = tuple(_batch_prompt(p) for p in prompt)
        text, ids = batch[0]
    elif all(type(t) is int for t in prompt):
        ids = tuple(prompt)
    else:
        raise _type_error("prompt", "an array of integer token ids", prompt)
    echo = d.get("echo") is True
    if params.max_tokens == 0 and not echo:  # (the schema admits 0 for echo: the prompt's logprobs alone)
        raise _bad("Invalid value for 'max_tokens': 0; it must be >= 1 unless 'echo' is true.", "max_tokens",
                   "invalid_value")
    if d.get("suffix") not in (None, ""):
        raise _bad("'suffix' is not supported by this server.", "suffix", "unsupported_parameter")
    if d.get("structured_outputs"):
        params = with_constraint(params, completion_constraint(d))
    g = GenerationRequest(False, model, params, stream, include_usage, text, ids, None, logprobs, top_n,
                          user, deadline_ms)
    g.echo = echo
    if batch is not None or "n" in d or "best_of" in d:  # (two lookups: cheaper than a set's isdisjoint)
        _fan_completion(d, g, batch)
    return g


def _fan_completion(d: dict[str, Any], g: GenerationRequest, batch: Prompts | None) -> None:
    n = d.get("n") or 1
    best_of = d.get("best_of") or 0
    if best_of and best_of < n:
        raise _bad(f"'best_of' ({best_of}) must be greater than or equal to 'n' ({n}).", "best_of", "invalid_value")
    if best_of > n and g.stream:
        raise _bad("'best_of' cannot be used with 'stream': the best sequences are known only at the end.",
                   "best_of", "invalid_value")
    if n > 1 or best_of > n or batch is not None:
        _fan(g, n, best_of if best_of > n else 0, batch)
