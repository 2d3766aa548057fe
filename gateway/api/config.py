"""``[api]``: the OpenAI routes' defaults and bounds, and every request's timeouts."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ApiSettings"]


@dataclass(frozen=True, slots=True)
class ApiSettings:
    default_max_tokens: int = 256  # when the request gives none
    max_tokens_limit: int = 4096  # larger requests get a 400
    request_timeout: float = 600.0  # whole request, seconds
    retries: int = 1  # resubmits on another worker if one dies before the first token (after it: resumes there)
    write_timeout: float = 60.0  # a streaming client that reads nothing this long is cut off

    def _validate(self, p: list[str]) -> None:
        if self.default_max_tokens < 1:
            p.append("api.default_max_tokens: must be >= 1")
        if self.max_tokens_limit < self.default_max_tokens:
            p.append("api.max_tokens_limit: must be >= api.default_max_tokens")
        if self.request_timeout <= 0:
            p.append("api.request_timeout: must be > 0")
        if self.retries < 0:
            p.append("api.retries: must be >= 0")
        if self.write_timeout <= 0:
            p.append("api.write_timeout: must be > 0")
