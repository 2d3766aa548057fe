"""What the gRPC service needs from the gateway: start a generation, list models.

The service is written against :class:`Backend` rather than the request
pipeline itself, so native gRPC and gRPC-Web reach the one pipeline through a
single binding (:mod:`.pipeline_backend`) and the service can be tested
with a double. The interface is callbacks, not an async iterator, so a binding
can forward worker token batches without a task or a queue per request.

Contract for :meth:`Backend.generate`: callbacks run on the event loop's
thread; ``on_delta`` zero or more times with new text, then ``on_end``
exactly once with :class:`Finished` or an :class:`~gateway.errors.APIError`
(admission, validation, routing and worker errors alike). ``on_end`` may run
before ``generate`` returns, e.g. for a request rejected at admission.
After :meth:`Handle.cancel` the backend frees the worker's request; the service
has stopped listening by then, so callbacks after a cancel are ignored.

:class:`Generation` is the service's side: one generate call as an awaitable
sequence of coalesced text pieces.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from transport.messages import FinishReason

from ..errors import APIError

__all__ = [
    "ChatMessage",
    "GenerateSpec",
    "Finished",
    "Outcome",
    "OnDelta",
    "OnEnd",
    "Handle",
    "Backend",
    "Generation",
    "CANCELLED",
]


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class GenerateSpec:
    """One generation as the client asked for it; ``None`` means the server's default."""

    model: str
    prompt: str | None = None  # exactly one of prompt and messages is set
    messages: tuple[ChatMessage, ...] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    min_tokens: int | None = None
    deadline: float | None = None  # the request clock's time (gateway.clock.now) by which it must end (grpc-timeout)
    #: The caller's text metadata (lower-case names; ``grpc-*`` and pseudo-headers left out),
    #: for admission: ``authorization``, API keys, ``user-agent``.
    metadata: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Finished:
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


Outcome = Finished | APIError
OnDelta = Callable[[str], None]
OnEnd = Callable[[Outcome], None]


class Handle(Protocol):
    def cancel(self) -> None:
        """Stop generating and free the worker's request (idempotent; no-op once ended)."""


class Backend(Protocol):
    def models(self) -> Sequence[str]:
        """Model ids this gateway serves, for ListModels."""

    def authorize(self, metadata: tuple[tuple[str, str], ...]) -> None:
        """Raise a 401 :class:`APIError` where this gateway requires API keys and ``metadata`` (as
        :attr:`GenerateSpec.metadata`) carries no valid one: ListModels, like ``GET /v1/models``
        (generations are checked by admission)."""

    def generate(self, spec: GenerateSpec, on_delta: OnDelta, on_end: OnEnd) -> Handle:
        """Start ``spec``; report through the callbacks (see the module docstring)."""


#: How a generation the service cancelled ends (the client cancelled or went away).
CANCELLED = APIError(499, "The call was cancelled.", "cancelled", None, "cancelled")


class Generation:
    """One :meth:`Backend.generate` call, awaited as coalesced text pieces and then an outcome.

    Deltas that arrive while the service is busy sending are joined into one
    piece, so a slow client gets fewer, larger messages instead of a backlog.
    """

    def __init__(self, backend: Backend, spec: GenerateSpec) -> None:
        self._pending: list[str] = []
        self._outcome: Outcome | None = None
        self._wake = asyncio.Event()
        self._handle: Handle | None = None
        self._handle = backend.generate(spec, self._on_delta, self._on_end)

    @property
    def outcome(self) -> Outcome | None:
        return self._outcome

    def _on_delta(self, text: str) -> None:
        if self._outcome is None and text:
            self._pending.append(text)
            self._wake.set()

    def _on_end(self, outcome: Outcome) -> None:
        if self._outcome is None:
            # A generation that stopped as cancelled without us asking is the same error to the client.
            cancelled = isinstance(outcome, Finished) and outcome.reason is FinishReason.CANCELLED
            self._outcome = CANCELLED if cancelled else outcome
            self._wake.set()

    async def next(self) -> tuple[str, Outcome | None]:
        """New text since the last call, and the outcome once the generation has ended."""
        while not self._pending and self._outcome is None:
            self._wake.clear()
            await self._wake.wait()
        text = "".join(self._pending)
        self._pending.clear()
        return text, self._outcome

    def cancel(self) -> None:
        """End it now as CANCELLED and tell the backend, unless it has already ended."""
        if self._outcome is not None:
            return
        self._outcome = CANCELLED
        self._pending.clear()
        self._wake.set()
        if self._handle is not None:
            self._handle.cancel()
