"""The OpenAI API's routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

What is OpenAI-specific and nothing else: parsing a generation body into a
:class:`~gateway.api.params.GenerationRequest` (415 for a compressed body that
fails to parse), the prompt-size estimate routing sees, and the model list
bodies. The pipeline (:mod:`gateway.app`) runs the rest: admission, routing,
the generation call and the writers (:mod:`gateway.api.writers`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import orjson

from .. import clock
from ..errors import APIError
from ..http.types import Request
from .config import ApiSettings
from .params import GenerationRequest, parse_chat, parse_completion, parse_json_body

__all__ = ["OpenAIApi", "CHAT_ROUTE", "COMPLETIONS_ROUTE", "MODELS_ROUTE"]

CHAT_ROUTE = "/v1/chat/completions"
COMPLETIONS_ROUTE = "/v1/completions"
MODELS_ROUTE = "/v1/models"

Parser = Callable[..., GenerationRequest]
Validate = Callable[[str, str | None, Any], None]
"""A compiled JSON Schema check of a parsed body: (route, model, body), raising a 400 APIError
(``gateway.admission.schema.SchemaRegistry.validate``). It must include the route's built-in schema
(the registry's always does): params.py then skips its own run of it."""


class OpenAIApi:
    """Parsing and the model-list bodies, with the API settings."""

    GENERATION: dict[str, Parser] = {CHAT_ROUTE: parse_chat, COMPLETIONS_ROUTE: parse_completion}

    def __init__(self, api: ApiSettings, validate: Validate | None = None) -> None:
        self.api = api
        self.created = int(clock.wall())
        self._deadline_ms = int(api.request_timeout * 1000)
        self.validate = validate

    def parse(self, parse: Parser, req: Request) -> GenerationRequest:
        """Parse the JSON once, check it against the compiled schemas of its kind (built-in, plus the
        operator's for the route and the model when admission is on), then what a schema cannot say
        (``params``). The schemas are picked by the parser, not ``req.path``: a gRPC call is checked
        as the OpenAI body it is turned into."""
        try:
            d = parse_json_body(req.body)
            validate = self.validate
            if validate is not None:
                model = d.get("model")
                validate(CHAT_ROUTE if parse is parse_chat else COMPLETIONS_ROUTE,
                         model if type(model) is str else None, d)
            return parse(d, default_max_tokens=self.api.default_max_tokens,
                         max_tokens_limit=self.api.max_tokens_limit, deadline_ms=self._deadline_ms,
                         schema_checked=validate is not None)
        except APIError:
            # Only now, off the success path: a compressed body fails to parse, and "not valid JSON"
            # would send its sender looking in the wrong place.
            coding = req.header(b"content-encoding", b"identity") or b""
            if coding.strip().lower() not in (b"", b"identity"):
                raise APIError(415, f"Content-Encoding {coding.decode('latin-1')!r} is not supported; send the "
                               "request body uncompressed.", "invalid_request_error", None,
                               "unsupported_content_encoding") from None
            raise

    def model_obj(self, name: str, aliases: Mapping[str, str]) -> dict[str, Any]:
        """OpenAI's model object; an alias names the model it stands for as its ``root`` (vLLM's field)."""
        obj: dict[str, Any] = {"id": name, "object": "model", "created": self.created, "owned_by": "quicserve"}
        if name in aliases:
            obj["root"] = aliases[name]
        return obj

    def models_body(self, models: list[str], aliases: Mapping[str, str]) -> bytes:
        return orjson.dumps({"object": "list", "data": [self.model_obj(m, aliases) for m in models]})

    def model_body(self, name: str, models: list[str], aliases: Mapping[str, str]) -> bytes:
        if name not in models:
            raise APIError(404, f"The model `{name}` does not exist.", "invalid_request_error", "model",
                           "model_not_found")
        return orjson.dumps(self.model_obj(name, aliases))
