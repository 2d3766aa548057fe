"""Parse and validate OpenAI request bodies into what a worker Submit needs.

Sans-I/O: bytes in, :class:`GenerationRequest` out, or an :class:`APIError`
(400 with ``param`` naming the offending field) -- never a half-checked
request. Plain ``type(x) is`` checks keep it fast; no schema library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from transport.messages import SamplingParams, Submit
from transport.wire_control import INT64_MAX  # the worker's decoder: top_k and seed are signed 64-bit

from ..errors import APIError

__all__ = ["GenerationRequest", "parse_json_body", "parse_chat", "parse_completion", "ROLES"]

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

_CHAT_KEYS = frozenset({
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop",
    "n", "logprobs", "top_logprobs", "user", "stream", "stream_options", "frequency_penalty",
    "presence_penalty", "logit_bias", "response_format", "tools", "tool_choice", "parallel_tool_calls",
    "metadata", "store", "service_tier", "top_k", "ignore_eos",
})
_COMPLETION_KEYS = frozenset({
    "model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "logprobs", "user",
    "stream", "stream_options", "echo", "best_of", "suffix", "frequency_penalty", "presence_penalty",
    "logit_bias", "top_k", "ignore_eos",
})


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

    def make_submit(self, request_id: int) -> Submit:
        # A whole (non-streaming, no logprobs) response is delivered by the worker in one piece.
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


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(v), type(v).__name__)


def _type_error(param: str, expected: str, value: Any) -> APIError:
    return _bad(f"Invalid type for '{param}': expected {expected}, but got {_json_type(value)}.", param,
                "invalid_type")


def _int(d: dict[str, Any], key: str, lo: int, hi: int | None) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if type(v) is not int:
        raise _type_error(key, "an integer", v)
    if v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise _bad(f"Invalid value for '{key}': {v}; it must be {rng}.", key, "invalid_value")
    return v


def _num(d: dict[str, Any], key: str, lo: float, hi: float, default: float) -> float:
    v = d.get(key)
    if v is None:
        return default
    t = type(v)
    if t is not float and t is not int:
        raise _type_error(key, "a number", v)
    if not (lo <= v <= hi):
        raise _bad(f"Invalid value for '{key}': {v}; it must be between {lo:g} and {hi:g}.", key,
                   "invalid_value")
    return float(v)


def _bool(d: dict[str, Any], key: str) -> bool:
    v = d.get(key)
    if v is None:
        return False
    if type(v) is not bool:
        raise _type_error(key, "a boolean", v)
    return v


def _stop(d: dict[str, Any]) -> tuple[str, ...]:
    v = d.get("stop")
    if v is None:
        return ()
    if type(v) is str:
        return (v,) if v else ()
    if type(v) is not list or not all(type(s) is str for s in v):
        raise _type_error("stop", "a string or an array of strings", v)
    if len(v) > 4:
        raise _bad("Invalid value for 'stop': at most 4 stop sequences are allowed.", "stop", "invalid_value")
    return tuple(s for s in v if s)


def _unsupported_zero(d: dict[str, Any], key: str) -> None:
    v = d.get(key)
    if v is None:
        return
    if type(v) is not int and type(v) is not float:
        raise _type_error(key, "a number", v)
    if not (-2 <= v <= 2):
        raise _bad(f"Invalid value for '{key}': {v}; it must be between -2 and 2.", key, "invalid_value")
    if v != 0:
        raise _bad(f"'{key}' is not supported by this server; omit it or set it to 0.", key, "unsupported_parameter")


_RARE = frozenset({"n", "max_completion_tokens", "top_k", "seed", "stop", "user", "stream_options",
                   "frequency_penalty", "presence_penalty", "logit_bias", "ignore_eos", "logprobs", "top_logprobs"})


def _common(d: dict[str, Any], allowed: frozenset[str], max_tokens_limit: int, default_max: int,
            max_logprobs: int, chat: bool) -> tuple[str, SamplingParams, bool, bool, str | None, bool, int]:
    if not allowed.issuperset(d):
        extra = sorted(k for k in d if k not in allowed)
        raise _bad(f"Unrecognized request argument supplied: {', '.join(extra)}", extra[0], "unknown_parameter")
    model = d.get("model")
    if model is None:
        raise _bad("You must provide a model parameter.", "model", "missing_required_parameter")
    if type(model) is not str:
        raise _type_error("model", "a string", model)
    max_tokens = _int(d, "max_tokens", 1, None)
    param = "max_tokens"
    temperature = _num(d, "temperature", 0.0, 2.0, 1.0)
    top_p = _num(d, "top_p", 0.0, 1.0, 1.0)
    if top_p == 0.0:
        raise _bad("Invalid value for 'top_p': 0; it must be > 0 and <= 1.", "top_p", "invalid_value")
    stream = _bool(d, "stream")
    top_k = 0
    seed = user = None
    stop: tuple[str, ...] = ()
    include_usage = ignore_eos = logprobs = False
    top_n = 0
    if not _RARE.isdisjoint(d):  # the rest only when the request uses any of it
        n = _int(d, "n", 1, 128)
        if n is not None and n > 1:
            raise _bad(f"'n' = {n} is not supported: this server returns exactly one choice per request "
                       "(n = 1).", "n", "unsupported_parameter")
        if chat:
            mt = _int(d, "max_completion_tokens", 1, None)
            if mt is not None and max_tokens is not None and mt != max_tokens:
                raise _bad("Give 'max_tokens' or 'max_completion_tokens', not both with different values.",
                           "max_tokens", "invalid_value")
            if mt is not None:
                max_tokens, param = mt, "max_completion_tokens"
        top_k = _int(d, "top_k", 0, INT64_MAX) or 0
        seed = d.get("seed")
        if seed is not None and type(seed) is not int:
            raise _type_error("seed", "an integer", seed)
        if seed is not None and not (-INT64_MAX - 1 <= seed <= INT64_MAX):
            raise _bad("Invalid value for 'seed': it must fit in a signed 64-bit integer.", "seed", "invalid_value")
        stop = _stop(d)
        user = d.get("user")
        if user is not None and type(user) is not str:
            raise _type_error("user", "a string", user)
        so = d.get("stream_options")
        if so is not None:
            if type(so) is not dict:
                raise _type_error("stream_options", "an object", so)
            if not stream:
                raise _bad("'stream_options' is only allowed when 'stream' is true.", "stream_options",
                           "invalid_value")
            unknown = [k for k in so if k not in ("include_usage", "include_obfuscation")]
            if unknown:
                raise _bad(f"Unrecognized stream option: {unknown[0]}", "stream_options", "unknown_parameter")
            iu = so.get("include_usage")
            if iu is not None and type(iu) is not bool:
                raise _type_error("stream_options.include_usage", "a boolean", iu)
            include_usage = bool(iu)
        for key in ("frequency_penalty", "presence_penalty"):
            _unsupported_zero(d, key)
        lb = d.get("logit_bias")
        if lb is not None:
            if type(lb) is not dict:
                raise _type_error("logit_bias", "an object", lb)
            if lb:
                raise _bad("'logit_bias' is not supported by this server.", "logit_bias", "unsupported_parameter")
        ignore_eos = _bool(d, "ignore_eos")
        if chat:
            logprobs = _bool(d, "logprobs")
            top = _int(d, "top_logprobs", 0, 20)
            if top is not None and top > 0 and not logprobs:
                raise _bad("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs", "invalid_value")
            top_n = top or 0
        else:
            lp = d.get("logprobs")
            if lp is not None and (type(lp) is not int):
                raise _type_error("logprobs", "an integer", lp)
            lpn = _int(d, "logprobs", 0, max_logprobs)
            logprobs = lpn is not None
            top_n = lpn or 0
    if max_tokens is None:
        max_tokens = default_max
    elif max_tokens > max_tokens_limit:
        raise _bad(f"Invalid value for '{param}': {max_tokens}; this server allows at most {max_tokens_limit}.",
                   param, "invalid_value")
    return model, _sampling(max_tokens, temperature, top_p, top_k, seed, stop, ignore_eos, logprobs, top_n), \
        stream, include_usage, user, logprobs, top_n


_TOKEN_ID_END = 1 << 32  # token ids travel as uint32 (transport.wire_control)

_CHAT_RARE = frozenset({"tools", "tool_choice", "response_format"})

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
    if type(content) is list:
        parts = []
        for j, part in enumerate(content):
            if type(part) is not dict or part.get("type") != "text" or type(part.get("text")) is not str:
                raise _bad(f"messages[{i}].content[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                           "are supported.", f"messages[{i}].content", "invalid_value")
            parts.append(part["text"])
        return "".join(parts)
    raise _type_error(f"messages[{i}].content", "a string or an array of text parts", content)


def _messages(d: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    msgs = d.get("messages")
    if msgs is None:
        raise _bad("Missing required parameter: 'messages'.", "messages", "missing_required_parameter")
    if type(msgs) is not list:
        raise _type_error("messages", "an array", msgs)
    if not msgs:
        raise _bad("'messages' must contain at least one message.", "messages", "invalid_value")
    out = []
    for i, m in enumerate(msgs):
        if type(m) is not dict:
            raise _type_error(f"messages[{i}]", "an object", m)
        role = m.get("role")
        if type(role) is not str or role not in ROLES:
            raise _bad(f"Invalid value for 'messages[{i}].role': {role!r}; expected one of "
                       f"{', '.join(sorted(ROLES))}.", f"messages[{i}].role", "invalid_value")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        out.append({"role": role, "content": _content_text(content, i)})
    return tuple(out)


def parse_chat(body: bytes | dict[str, Any], *, default_max_tokens: int, max_tokens_limit: int,
               deadline_ms: int = 0) -> GenerationRequest:
    """``POST /v1/chat/completions`` body (bytes, or the JSON object already parsed) -> GenerationRequest."""
    d = body if type(body) is dict else parse_json_body(body)  # type: ignore[arg-type]
    model, params, stream, include_usage, user, logprobs, top_n = _common(
        d, _CHAT_KEYS, max_tokens_limit, default_max_tokens, 20, chat=True)
    messages = _messages(d)
    if not _CHAT_RARE.isdisjoint(d):
        for key in ("tools", "tool_choice"):
            v = d.get(key)
            if v not in (None, [], "none"):
                raise _bad(f"'{key}' (tool calling) is not supported by this server.", key,
                           "unsupported_parameter")
        rf = d.get("response_format")
        if rf is not None and rf != {"type": "text"}:
            raise _bad("Only response_format {\"type\": \"text\"} is supported.", "response_format",
                       "unsupported_parameter")
    tier = d.get("service_tier")
    return GenerationRequest(True, model, params, stream, include_usage, None, None, messages, logprobs,
                             top_n, user, deadline_ms, tier if type(tier) is str else None)


def parse_completion(body: bytes | dict[str, Any], *, default_max_tokens: int, max_tokens_limit: int,
                     deadline_ms: int = 0) -> GenerationRequest:
    """``POST /v1/completions`` body (bytes, or the JSON object already parsed) -> GenerationRequest
    (one prompt: text or token ids)."""
    d = body if type(body) is dict else parse_json_body(body)  # type: ignore[arg-type]
    model, params, stream, include_usage, user, logprobs, top_n = _common(
        d, _COMPLETION_KEYS, max_tokens_limit, default_max_tokens, 5, chat=False)
    prompt = d.get("prompt")
    text: str | None = None
    ids: tuple[int, ...] | None = None
    if type(prompt) is list and len(prompt) == 1 and type(prompt[0]) in (str, list):
        prompt = prompt[0]  # a batch of one
    if type(prompt) is str:
        text = prompt
    elif type(prompt) is list and prompt and all(type(t) is int and 0 <= t < _TOKEN_ID_END for t in prompt):
        ids = tuple(prompt)
    elif prompt is None:
        raise _bad("Missing required parameter: 'prompt'.", "prompt", "missing_required_parameter")
    elif type(prompt) is list and len(prompt) > 1 and all(type(p) in (str, list) for p in prompt):
        raise _bad("Batched prompts are not supported: send one prompt per request.", "prompt",
                   "unsupported_parameter")
    elif type(prompt) is list and prompt and all(type(t) is int for t in prompt):
        raise _bad(f"Invalid value for 'prompt': token ids must be between 0 and {_TOKEN_ID_END - 1}.", "prompt",
                   "invalid_value")
    else:
        raise _type_error("prompt", "a string or an array of token ids", prompt)
    if _bool(d, "echo"):
        raise _bad("'echo' is not supported by this server.", "echo", "unsupported_parameter")
    best_of = _int(d, "best_of", 1, 20)
    if best_of is not None and best_of > 1:
        raise _bad("'best_of' > 1 is not supported by this server.", "best_of", "unsupported_parameter")
    if d.get("suffix") not in (None, ""):
        raise _bad("'suffix' is not supported by this server.", "suffix", "unsupported_parameter")
    return GenerationRequest(False, model, params, stream, include_usage, text, ids, None, logprobs, top_n,
                             user, deadline_ms)
