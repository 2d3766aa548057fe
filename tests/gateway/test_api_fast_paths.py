"""The generation call's read modes over a real transport connection (EchoWorker double, loopback).

Non-streamed requests use ``ClientStream.collect`` (one wake-up per request);
plain streams use ``ClientStream.listen`` (no wake-up per engine step); logprob
requests pull per step. These check that the bytes are the same as the
general path's and that backpressure, disconnects and worker errors still work.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
import pytest

from gateway.app import App
from gateway.http.types import Request
from gateway.routing.pool import ModelPool
from tests.transport.doubles import EchoWorker
from transport.client import connect
from transport.server import serve

from .doubles import RecordingSink, sse_events


class NowaitSink(RecordingSink):
    """RecordingSink that refuses ``send_nowait`` (a slow client) every ``refuse_every``-th call."""

    def __init__(self, refuse_every: int = 0, block_after_chunks: int | None = None) -> None:
        super().__init__(block_after_chunks)
        self.refuse_every = refuse_every
        self.nowait_calls = 0
        self.refused = 0

    def send_nowait(self, data: bytes) -> bool:
        self.nowait_calls += 1
        if self.refuse_every and self.nowait_calls % self.refuse_every == 0:
            self.refused += 1
            return False
        return super().send_nowait(data)


async def run(app: App, r: Request, sink: RecordingSink) -> None:
    ended = asyncio.get_running_loop().create_future()
    app.handle(r, sink, lambda: ended.set_result(None))
    await asyncio.wait_for(ended, 30)


@pytest.fixture
async def echo() -> AsyncIterator[tuple[App, EchoWorker]]:
    worker = EchoWorker(step_delay=0.001)
    srv = await serve("tcp://127.0.0.1:0", worker)
    conn = await connect(srv.address, initial_credit=8)  # small window: credit must flow in every mode
    pool = ModelPool()
    pool.add(conn)
    yield App(pool), worker
    await conn.close()
    await srv.close()


def chat(max_tokens: int, stream: bool, **extra: object) -> Request:
    body = orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": max_tokens, "stream": stream, **extra})
    return Request("POST", "/v1/chat/completions", "", [], body, "http/1.1", "http")


def expected_text(n: int) -> str:
    return "".join(f"t{i}" for i in range(n))


async def test_unary_collects_over_the_real_transport(echo: tuple[App, EchoWorker]) -> None:
    app, _ = echo
    sink = RecordingSink()
    await run(app, chat(40, False), sink)
    body = sink.json()
    assert sink.status == 200
    assert body["choices"][0]["message"]["content"] == expected_text(40)  # type: ignore[index]
    assert body["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
    assert body["usage"]["completion_tokens"] == 40  # type: ignore[index]
    # delivered whole (Submit.buffered): tokens counted; TTFT when the transport saw the first token, no TPOT
    s = app.metrics.of("/v1/chat/completions", "tiny")
    assert s.output_tokens == 40 and sum(s.ttft.counts) == 1 and not any(s.tpot.counts)


@pytest.mark.parametrize("refuse_every", [0, 3])
async def test_stream_push_mode_same_bytes_and_backpressure(echo: tuple[App, EchoWorker], refuse_every: int) -> None:
    app, _ = echo
    sink = NowaitSink(refuse_every)
    await run(app, chat(30, True, stream_options={"include_usage": True}), sink)
    assert sink.status == 200 and sink.ended
    assert sink.nowait_calls > 0  # the push path ran
    if refuse_every:
        assert sink.refused > 0
    events = sse_events(sink.body)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # type: ignore[index]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-2]  # type: ignore[index]
                   if e["choices"])  # type: ignore[index]
    assert text == expected_text(30)
    assert events[-3]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
    assert events[-2]["usage"]["completion_tokens"] == 30  # type: ignore[index]
    # every chunk is one whole SSE event
    assert all(c.startswith(b"data: ") and c.endswith(b"\n\n") for c in sink.chunks)


async def test_a_slow_client_gets_the_same_text(echo: tuple[App, EchoWorker]) -> None:
    app, _ = echo
    pushed, pulled = NowaitSink(), NowaitSink(refuse_every=4)
    await run(app, chat(12, True), pushed)
    await run(app, chat(12, True), pulled)

    def texts(s: RecordingSink) -> str:
        return "".join(e["choices"][0]["delta"].get("content", "")  # type: ignore[index]
                       for e in sse_events(s.body) if e != "[DONE]")

    assert texts(pushed) == texts(pulled) == expected_text(12)
    assert pulled.refused and not pushed.refused


async def test_client_gone_while_not_reading_cancels_the_worker_request(echo: tuple[App, EchoWorker]) -> None:
    app, worker = echo
    sink = NowaitSink(block_after_chunks=5)
    done: list[int] = []
    call = app.handle(chat(4000, True), sink, lambda: done.append(1))
    await asyncio.wait_for(sink.blocked.wait(), 10)  # the call is waiting on a client that stopped reading
    call.cancel()
    for _ in range(400):
        if worker.cancelled:
            break
        await asyncio.sleep(0.005)
    assert len(worker.cancelled) == 1 and not worker.active and done == [1]


async def test_worker_error_in_fast_paths(echo: tuple[App, EchoWorker]) -> None:
    """The pool thinks the worker serves "ghost"; the worker answers UNKNOWN_MODEL -> 404, both modes."""
    app, _ = echo
    app.pool.add(app.pool.connections()[0], ["ghost"])
    for stream in (False, True):
        body = orjson.dumps({"model": "ghost", "messages": [{"role": "user", "content": "x"}], "stream": stream})
        sink = NowaitSink()
        await run(app, Request("POST", "/v1/chat/completions", "", [], body, "http/1.1", "http"), sink)
        assert sink.status == 404 and not sink.streamed
        assert sink.json()["error"]["code"] == "model_not_found"  # type: ignore[index]
