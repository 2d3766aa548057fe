"""Named test doubles for gateway handler tests (no sockets, no transport).

* :class:`ScriptedWorkerConnection` -- a ``transport.api.WorkerConnection``
  double whose "worker" answers every Submit with ``max_tokens`` one-byte
  tokens cycling through ``alphabet`` (in batches of ``tokens_per_batch``),
  then ``Finish(LENGTH)``; it can hang after N tokens, fail before the first
  token, or fail after N tokens. It records Submits and Cancels.
* :class:`RecordingSink` -- a ``ResponseSink`` that records what was written and
  enforces respond-xor-start/send/end.
"""

from __future__ import annotations

import asyncio
from array import array
from dataclasses import dataclass, field

import orjson

from transport.errors import ConnectionClosed
from transport.messages import (
    Error,
    ErrorCode,
    Finish,
    FinishReason,
    Hello,
    Stats,
    Submit,
    TokenEntry,
)

__all__ = ["ScriptedWorkerConnection", "ScriptedStream", "RecordingSink", "sse_events"]


class ScriptedStream:
    def __init__(self, conn: ScriptedWorkerConnection, request_id: int) -> None:
        self.request_id = request_id
        self._conn = conn
        self._q: asyncio.Queue[list[object]] = asyncio.Queue()
        self._ended = False  # final event returned
        self._final_queued = False
        self.cancelled = False

    def put(self, batch: list[object]) -> None:
        if self._final_queued:
            return
        if batch and type(batch[-1]) in (Finish, Error):
            self._final_queued = True
            self._conn._open.discard(self.request_id)
        self._q.put_nowait(batch)

    async def next_events(self) -> list[object]:
        if self._ended:
            raise StopAsyncIteration
        batch = await self._q.get()
        if batch and type(batch[-1]) in (Finish, Error):
            self._ended = True
        return batch

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self._conn.cancels.append(self.request_id)
        self.put([Error(self.request_id, ErrorCode.CANCELLED, "cancelled")])

    @property
    def done(self) -> bool:
        return self._ended


@dataclass
class ScriptedWorkerConnection:
    models: tuple[str, ...] = ("tiny",)
    alphabet: bytes = b"abcdefghij"
    tokens_per_batch: int = 1
    hang_after: int | None = None  # stop producing after this many tokens (stream stays open)
    fail_before_first: ErrorCode | None = None
    fail_after: int | None = None  # Error(INTERNAL) after this many tokens
    logprobs_value: float = -0.5
    prompt_tokens: int = 7
    submit_raises: Exception | None = None  # what submit() raises instead of opening a stream
    latest_stats: Stats | None = None
    closed: bool = False
    submits: list[Submit] = field(default_factory=list)
    cancels: list[int] = field(default_factory=list)
    streams: dict[int, ScriptedStream] = field(default_factory=dict)
    _next: int = 0
    _open: set[int] = field(default_factory=set)
    _closed_ev: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.peer_hello = Hello(role="worker", identity="scripted", models=self.models)

    def next_request_id(self) -> int:
        self._next += 1
        return self._next

    @property
    def in_flight(self) -> int:
        return len(self._open)

    def submit(self, submit: Submit) -> ScriptedStream:
        if self.closed:
            raise ConnectionClosed("scripted connection is closed")
        if self.submit_raises is not None:
            self.submits.append(submit)
            raise self.submit_raises
        self.submits.append(submit)
        rid = submit.request_id
        s = self.streams[rid] = ScriptedStream(self, rid)
        self._open.add(rid)
        if self.fail_before_first is not None:
            s.put([Error(rid, self.fail_before_first, f"scripted {self.fail_before_first.name}")])
            return s
        n = submit.params.max_tokens
        top_n = submit.params.top_logprobs
        produced = 0
        while produced < n:
            if self.hang_after is not None and produced >= self.hang_after:
                return s
            if self.fail_after is not None and produced >= self.fail_after:
                s.put([Error(rid, ErrorCode.INTERNAL, "scripted failure")])
                return s
            k = min(self.tokens_per_batch, n - produced)
            ids = [self.alphabet[(produced + i) % len(self.alphabet)] for i in range(k)]
            lp = tops = toplp = None
            if submit.params.logprobs:
                lp = memoryview(array("f", [self.logprobs_value] * k))
                if top_n:
                    tops = memoryview(array("I", [ids[i // top_n] for i in range(k * top_n)]))
                    toplp = memoryview(array("f", [self.logprobs_value] * (k * top_n)))
            entry = TokenEntry(rid, memoryview(array("I", ids)), bytes(ids), lp, tops, toplp)
            produced += k
            batch: list[object] = [entry]
            if produced == n:
                batch.append(Finish(rid, FinishReason.LENGTH, self.prompt_tokens, n))
            s.put(batch)
        return s

    async def drain(self, timeout: float) -> None:
        await self.close()

    async def close(self) -> None:
        """Closing ends every open stream with CONNECTION_LOST, as the real transport does."""
        self.closed = True
        for rid in list(self._open):
            self.streams[rid].put([Error(rid, ErrorCode.CONNECTION_LOST, "connection closed")])
        self._closed_ev.set()

    async def wait_closed(self) -> None:
        await self._closed_ev.wait()


class RecordingSink:
    """ResponseSink double: ``status``, ``headers``, ``body`` (all chunks joined), ``chunks``."""

    def __init__(self, block_after_chunks: int | None = None) -> None:
        self.status: int | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.streamed = False
        self.ended = False
        self.block_after_chunks = block_after_chunks
        self.blocked = asyncio.Event()

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        assert self.status is None, "response already started"
        self.status, self.headers, self.chunks, self.ended = status, headers, [body], True

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        assert self.status is None, "response already started"
        self.status, self.headers, self.streamed = status, headers, True

    async def send(self, data: bytes) -> None:
        assert self.streamed and not self.ended
        self.chunks.append(data)
        if self.block_after_chunks is not None and len(self.chunks) >= self.block_after_chunks:
            self.blocked.set()
            await asyncio.Event().wait()  # a client that stopped reading

    async def end(self) -> None:
        assert self.streamed and not self.ended
        self.ended = True

    # what an adapter's sink adds for gateway.http.common.run_request
    def fail(self, err: object) -> None:
        if self.status is None:
            self.status, self.chunks, self.ended = getattr(err, "status", 500), [b"{}"], True

    def finish(self) -> None:
        if self.status is None:
            self.fail(None)
        self.ended = True

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def json(self) -> object:
        return orjson.loads(self.body)

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k == name), None)


def sse_events(body: bytes) -> list[object]:
    """Parse an SSE body into JSON objects (and the string "[DONE]")."""
    out: list[object] = []
    assert body.endswith(b"\n\n"), body[-50:]
    for block in body.split(b"\n\n")[:-1]:
        assert block.startswith(b"data: "), block
        data = block[6:]
        out.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return out
