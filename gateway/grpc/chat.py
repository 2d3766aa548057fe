"""One ``Chat`` call: the client streams turns, the server streams each turn's reply.

How it works: a reader task takes client messages -- a ``Turn`` is queued
under its number (the n-th Turn is turn n), a ``CancelTurn`` cancels the
running turn or marks a queued one -- while :meth:`ChatSession.run` plays the
queued turns one after another. A turn sends the conversation so far plus its
own messages; its reply streams as ``ChatResponse(turn, text)`` deltas and
ends with ``finish_reason`` and ``usage``, or with a ``TurnError`` (cancelled,
invalid, backend error) after which the call goes on. Only a turn that
finishes joins the history, with the assistant's reply, so a failed or
cancelled turn can simply be sent again. The call ends OK once the client has
closed its side and every queued turn has been played; if the client's
stream fails (a malformed message), the running turn is cancelled and the
call ends with that error.

At most :data:`MAX_QUEUED` turns wait behind the running one: with that many
queued the reader stops taking messages, so the transport's flow control holds
the client back instead of the queue growing with whatever it sends (a
``CancelTurn`` behind them is read once a queued turn starts).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable

from ..errors import APIError
from .backend import CANCELLED, Backend, ChatMessage, Finished, GenerateSpec, Generation
from .convert import chat_messages, reason_of, usage_of, with_sampling
from .quicserve.v1 import quicserve_pb2 as pb
from .status import grpc_status

__all__ = ["ChatSession", "MAX_QUEUED"]

MAX_QUEUED = 8  # turns waiting behind the running one before the reader stops reading


class ChatSession:
    def __init__(self, backend: Backend, recv: Callable[[], Awaitable[pb.ChatRequest | None]],
                 send: Callable[[pb.ChatResponse], Awaitable[None]], deadline: float | None,
                 metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self._backend = backend
        self._recv = recv
        self._send = send
        self._deadline = deadline
        self._metadata = metadata
        self._history: tuple[ChatMessage, ...] = ()
        self._model = ""
        self._sampling = pb.Sampling()
        self._queue: deque[tuple[int, pb.Turn]] = deque()
        self._turns = 0  # turns received
        self._cancelled: set[int] = set()  # queued turns cancelled before they ran
        self._running: tuple[int, Generation] | None = None
        self._changed = asyncio.Event()
        self._room = asyncio.Event()  # a queued turn has started: the reader may take another

    async def run(self) -> None:
        reader = asyncio.create_task(self._read())
        try:
            while True:
                while not self._queue and not reader.done():
                    self._changed.clear()
                    await self._changed.wait()
                if reader.done() and (reader.cancelled() or reader.exception() is not None):
                    return reader.result()  # the client's stream failed: so does the call
                if not self._queue:
                    return  # the client closed its side and every turn has been played
                turn = self._queue.popleft()
                self._room.set()
                await self._play(*turn)
        finally:
            reader.cancel()
            if self._running is not None:
                self._running[1].cancel()

    async def _read(self) -> None:
        try:
            while True:
                while len(self._queue) >= MAX_QUEUED:
                    self._room.clear()
                    await self._room.wait()
                if (request := await self._recv()) is None:
                    break
                if request.WhichOneof("action") == "turn":
                    self._turns += 1
                    self._queue.append((self._turns, request.turn))
                elif request.WhichOneof("action") == "cancel":
                    self._cancel(request.cancel.turn)
                self._changed.set()
        except BaseException:
            if self._running is not None:  # the call is failing: stop the turn now, not at its end
                self._running[1].cancel()
            raise
        finally:
            self._changed.set()

    def _cancel(self, turn: int) -> None:
        if self._running is not None and turn in (0, self._running[0]):
            self._running[1].cancel()
        elif any(n == turn for n, _ in self._queue):
            self._cancelled.add(turn)

    async def _play(self, n: int, turn: pb.Turn) -> None:
        if n in self._cancelled:
            self._cancelled.discard(n)
            return await self._error(n, CANCELLED)
        if turn.model:
            self._model = turn.model
        if turn.HasField("sampling"):
            self._sampling = turn.sampling
        if not self._model:
            return await self._error(n, APIError(400, "The first turn must name a model.", param="model"))
        if not turn.messages:
            return await self._error(n, APIError(400, "A turn needs at least one message.", param="messages"))
        asked = chat_messages(turn.messages)
        spec = GenerateSpec(self._model, messages=self._history + asked, deadline=self._deadline,
                            metadata=self._metadata)
        gen = Generation(self._backend, with_sampling(spec, self._sampling))
        self._running = (n, gen)
        reply: list[str] = []
        try:
            while True:
                text, outcome = await gen.next()
                reply.append(text)
                if outcome is None:
                    await self._send(pb.ChatResponse(turn=n, text=text))
                elif isinstance(outcome, Finished):
                    self._history += (*asked, ChatMessage("assistant", "".join(reply)))
                    return await self._send(pb.ChatResponse(turn=n, text=text, finish_reason=reason_of(outcome),
                                                            usage=usage_of(outcome)))
                else:
                    if text:
                        await self._send(pb.ChatResponse(turn=n, text=text))
                    return await self._error(n, outcome)
        finally:
            self._running = None
            gen.cancel()

    async def _error(self, n: int, err: APIError) -> None:
        await self._send(pb.ChatResponse(turn=n, error=pb.TurnError(code=grpc_status(err).value,
                                                                      message=err.message)))
