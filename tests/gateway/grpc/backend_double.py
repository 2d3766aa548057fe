"""A :class:`~gateway.grpc.backend.Backend` double for gRPC service tests.

:class:`EchoBackendDouble` answers a generation with the last message (or the
prompt) upper-cased, one word per delta, each delta scheduled on the event
loop as a worker's token batch would be. Usage counts words: prompt tokens are
the words of the prompt or of every message (so a test can see the history a
chat turn sent), completion tokens the words sent. ``max_tokens`` cuts the
reply (finish LENGTH). Knobs: ``hang_after`` (send that many words, then
nothing until cancelled), ``fail`` (an APIError after ``hang_after`` words, or
at once), ``reject`` (on_end with an APIError before generate returns). Every
call is recorded with its spec and whether it was cancelled.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from gateway.errors import APIError
from gateway.grpc.backend import Finished, GenerateSpec, OnDelta, OnEnd
from transport.messages import FinishReason

__all__ = ["EchoBackendDouble", "CallRecord"]


@dataclass
class CallRecord:
    spec: GenerateSpec
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    ended: bool = False
    task: asyncio.Task[None] | None = None

    def cancel(self) -> None:
        self.cancelled.set()
        if self.task is not None:
            self.task.cancel()


class EchoBackendDouble:
    def __init__(self, models: tuple[str, ...] = ("tiny",)) -> None:
        self._models = models
        self.calls: list[CallRecord] = []
        self.hang_after: int | None = None
        self.fail: APIError | None = None
        self.reject: APIError | None = None
        self.unauthorized: APIError | None = None  # what authorize raises (ListModels)
        self.started = asyncio.Event()

    def models(self) -> list[str]:
        return list(self._models)

    def authorize(self, metadata: tuple[tuple[str, str], ...]) -> None:
        if self.unauthorized is not None:
            raise self.unauthorized

    def generate(self, spec: GenerateSpec, on_delta: OnDelta, on_end: OnEnd) -> CallRecord:
        record = CallRecord(spec)
        self.calls.append(record)
        self.started.set()
        if self.reject is not None:
            on_end(self.reject)
            return record
        record.task = asyncio.get_running_loop().create_task(self._play(record, on_delta, on_end))
        return record

    async def _play(self, record: CallRecord, on_delta: OnDelta, on_end: OnEnd) -> None:
        spec = record.spec
        source = spec.prompt if spec.prompt is not None else (spec.messages or ())[-1].content
        prompt_words = len(spec.prompt.split()) if spec.prompt is not None else sum(
            len(m.content.split()) for m in spec.messages or ())
        words = source.upper().split()
        limit = len(words) if spec.max_tokens is None else min(spec.max_tokens, len(words))
        for i, word in enumerate(words[:limit]):
            if self.hang_after is not None and i == self.hang_after:
                if self.fail is not None:
                    on_end(self.fail)
                    return
                await asyncio.Event().wait()  # until cancelled
            await asyncio.sleep(0)  # one loop iteration per "token batch"
            on_delta(word if i == 0 else " " + word)
        if self.fail is not None:
            on_end(self.fail)
            return
        reason = FinishReason.LENGTH if limit < len(words) else FinishReason.STOP
        record.ended = True
        on_end(Finished(reason, prompt_words, limit, cached_tokens=0))
