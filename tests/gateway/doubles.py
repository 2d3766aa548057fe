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

from transport.client_stream import ClientStream
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


class ScriptedStream(ClientStream):
    """The transport's own :class:`ClientStream` (every consumption mode), fed by the script."""

    def __init__(self, conn: ScriptedWorkerConnection, request_id: int) -> None:
        super().__init__(conn, request_id, extras=True)  # type: ignore[arg-type]
        self._final_queued = False
        self.cancelled = False

    def collect(self):  # type: ignore[no-untyped-def]
        self._extras = False  # the script's logprobs requests are never collected
        return super().collect()

    def listen(self, on_text):  # type: ignore[no-untyped-def]
        self._extras = False
        return super().listen(on_text)

    def put(self, batch: list[object]) -> None:
        if self._final_queued:
            return
        for ev in batch:
            if type(ev) is TokenEntry:
                self.deliver(ev)
            else:
                self._final_queued = True
                self._conn._open.discard(self.request_id)  # type: ignore[attr-defined]
                self._end(ev)  # type: ignore[arg-type]
                return


@dataclass(eq=False)  # compared and hashed by identity, as connections are
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
    draining: bool = False
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

    # what ClientStream needs of its connection
    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    grant_batch = 1 << 30

    def consumed(self, rid: int, tokens: int) -> None:
        pass

    def received(self, rid: int, mark: int) -> None:
        """A scripted stream keeps no history: one lost mid-stream cannot resume (test_failover's can)."""
        return None

    def cancel_request(self, rid: int) -> None:
        s = self.streams[rid]
        if not s.cancelled:
            s.cancelled = True
            self.cancels.append(rid)
        s.put([Error(rid, ErrorCode.CANCELLED, "cancelled")])

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
        batches: list[list[object]] = []
        if self.fail_before_first is not None:
            batches.append([Error(rid, self.fail_before_first, f"scripted {self.fail_before_first.name}")])
        n = submit.params.max_tokens
        top_n = submit.params.top_logprobs
        produced = 0
        while produced < n and self.fail_before_first is None:
            if self.hang_after is not None and produced >= self.hang_after:
                break
            if self.fail_after is not None and produced >= self.fail_after:
                batches.append([Error(rid, ErrorCode.INTERNAL, "scripted failure")])
                break
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
            batches.append(batch)
        self._steps(s, batches)
        return s

    def _steps(self, s: ScriptedStream, batches: list[list[object]]) -> None:
        """One batch per loop iteration, as engine steps arrive (none once the stream ended)."""
        if batches and not s._final_queued:
            s.put(batches[0])
            asyncio.get_running_loop().call_soon(self._steps, s, batches[1:])

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


class ResponseView:
    """What a test reads of a response: ``chunks`` joined, as JSON, one header."""

    chunks: list[bytes]
    headers: list[tuple[bytes, bytes]]

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def json(self) -> object:
        return orjson.loads(self.body)

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k == name), None)


class RecordingSink(ResponseView):
    """ResponseSink double: ``status``, ``headers``, ``body`` (all chunks joined), ``chunks``.

    ``block_after_chunks``: after that many chunks the client "stops reading": ``send_nowait``
    returns False and ``send`` waits until :meth:`unblock`."""

    def __init__(self, block_after_chunks: int | None = None) -> None:
        self.status: int | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.streamed = False
        self.ended = False
        self.aborted = False
        self.block_after_chunks = block_after_chunks
        self.blocked = asyncio.Event()
        self._open = asyncio.Event()

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        assert self.status is None, "response already started"
        self.status, self.headers, self.chunks, self.ended = status, headers, [body], True

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        assert self.status is None, "response already started"
        self.status, self.headers, self.streamed = status, headers, True

    def _full(self) -> bool:
        return self.block_after_chunks is not None and len(self.chunks) >= self.block_after_chunks \
            and not self._open.is_set()

    def send_nowait(self, data: bytes) -> bool:
        assert self.streamed and not self.ended
        if self._full():
            self.blocked.set()
            return False
        self.chunks.append(data)
        return True

    async def send(self, data: bytes) -> None:
        assert self.streamed and not self.ended
        if self._full():
            self.blocked.set()
            await self._open.wait()  # a client that stopped reading
        self.chunks.append(data)

    def unblock(self) -> None:
        self._open.set()

    def end(self) -> None:
        assert self.streamed and not self.ended
        self.ended = True

    def abort(self) -> None:
        self.aborted = True



def sse_events(body: bytes) -> list[object]:
    """Parse an SSE body into JSON objects (and the string "[DONE]")."""
    out: list[object] = []
    assert body.endswith(b"\n\n"), body[-50:]
    for block in body.split(b"\n\n")[:-1]:
        assert block.startswith(b"data: "), block
        data = block[6:]
        out.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return out
