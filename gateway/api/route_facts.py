"""What a routing rule may read of a request (:class:`gateway.routing.rules.RequestFacts`), from the
parsed request and its headers; each fact is worked out only when a rule asks for it."""

from __future__ import annotations

from collections.abc import Callable

from ..http.types import Request
from .params import GenerationRequest

__all__ = ["RouteFacts", "Identify"]

Identify = Callable[[bytes | None], tuple[str | None, str | None]]
"""The ``Authorization`` header -> (API key id, its tier), (None, None) without a valid key."""


class RouteFacts:
    __slots__ = ("_req", "_g", "_identify", "_key", "_text")

    def __init__(self, req: Request, g: GenerationRequest, identify: Identify | None) -> None:
        self._req, self._g, self._identify = req, g, identify
        self._key: tuple[str | None, str | None] | None = None
        self._text: str | None = None

    def model(self) -> str:
        return self._g.model

    def prompt_tokens(self) -> int:
        return self._g.prompt_estimate()

    def max_tokens(self) -> int:
        return self._g.params.max_tokens

    def stream(self) -> bool:
        return self._g.stream

    def header(self, name: bytes) -> bytes | None:
        return self._req.header(name)

    def key(self) -> tuple[str | None, str | None]:
        if self._key is None:
            self._key = (None, None) if self._identify is None else self._identify(self._req.header(b"authorization"))
        return self._key

    def user_text(self) -> str:
        text = self._text
        if text is None:
            g, text = self._g, ""
            if g.messages is None:
                text = g.prompt or ""
            else:
                for m in reversed(g.messages):
                    if m["role"] == "user":
                        text = str(m["content"])
                        break
            self._text = text
        return text

    def user(self) -> str | None:
        return self._g.user
