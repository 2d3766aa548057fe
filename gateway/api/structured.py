"""Structured output and tools: the request fields that turn into a worker-side constraint.

- ``response_format`` (chat, OpenAI's): ``text``; ``json_object`` (any JSON object); ``json_schema``
  (``{"name", "schema", "strict"}``: the answer is valid for ``schema``; ``strict`` changes nothing
  here, every schema is enforced exactly or refused);
- ``structured_outputs`` (chat and completions; vLLM's extension field, the one documented here):
  exactly one of ``{"json": <schema or its text>}``, ``{"regex": "..."}``, ``{"choice": [...]}``,
  ``{"grammar": "<Lark grammar, llguidance's dialect>"}``;
- ``tools`` / ``tool_choice`` (chat; :mod:`gateway.api.tools`): ``required`` or a named function
  constrains the output to calls.

The gateway only shapes these into ``SamplingParams.guide_kind`` / ``guide`` (one constraint per
request: two that would fight are a 400); compiling, bounding and caching them is the worker's
(``inference/grammar.py``), and what it cannot compile comes back as a 400 naming the problem.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import orjson

from transport.messages import SamplingParams

from ..errors import APIError
from .tools import ToolSetup, parse_tools

__all__ = ["Constraint", "chat_constraint", "completion_constraint", "with_constraint"]

Constraint = tuple[str, str, ToolSetup | None]  # guide_kind, guide, tools
_ANY_OBJECT = '{"type": "object"}'


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, "invalid_request_error", param, "invalid_value")


def _schema_text(schema: Any) -> str:
    # Sorted keys: the same schema written in another key order is the worker's same cache entry.
    try:
        return orjson.dumps(schema, option=orjson.OPT_SORT_KEYS).decode()
    except TypeError:  # orjson writes at most 254 levels
        raise _bad("The JSON Schema is too complex to enforce: nested too deeply.", "response_format") from None


def _structured_outputs(so: dict[str, Any] | None) -> tuple[str, str]:
    if not so:
        return "", ""
    (key, value), = so.items()  # the schema: exactly one
    if key == "json":
        if type(value) is str:
            try:
                value = orjson.loads(value)
            except orjson.JSONDecodeError:
                raise _bad("structured_outputs.json is a string that is not JSON.", "structured_outputs.json") from None
        return "json", _schema_text(value)
    if key == "choice":
        return "choice", orjson.dumps(value).decode()
    return ("regex" if key == "regex" else "lark"), value


def _response_format(rf: dict[str, Any] | None) -> tuple[str, str]:
    kind = rf["type"] if rf else "text"
    if kind == "text":
        return "", ""
    if kind == "json_object":
        return "json", _ANY_OBJECT
    js = rf.get("json_schema") if rf else None  # json_schema
    if not js or "schema" not in js:
        raise _bad("response_format json_schema needs 'json_schema': {\"name\": ..., \"schema\": {...}}.",
                   "response_format.json_schema")
    return "json", _schema_text(js["schema"])


def chat_constraint(d: dict[str, Any]) -> Constraint:
    """A chat body's constraint (its schema already checked)."""
    kind, guide = _response_format(d.get("response_format"))
    so_kind, so_guide = _structured_outputs(d.get("structured_outputs"))
    if so_kind:
        if kind:
            raise _bad("Give 'response_format' or 'structured_outputs', not both.", "structured_outputs")
        kind, guide = so_kind, so_guide
    tools = parse_tools(d)
    if tools is not None and tools.guide:
        if kind:
            raise _bad("tool_choice 'required' or a named function already constrains the output; drop "
                       "'response_format' / 'structured_outputs' or use tool_choice 'auto'.", "tool_choice")
        kind, guide = "lark", tools.guide
    return kind, guide, tools


def completion_constraint(d: dict[str, Any]) -> Constraint:
    kind, guide = _structured_outputs(d.get("structured_outputs"))
    return kind, guide, None


def with_constraint(params: SamplingParams, c: Constraint) -> SamplingParams:
    kind, guide, tools = c
    if not kind and tools is None:
        return params
    return replace(params, guide_kind=kind, guide=guide, tools=tools.tools_json if tools is not None else "")
