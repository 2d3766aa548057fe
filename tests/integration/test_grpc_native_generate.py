"""Native Generate on the pipeline directly (gateway/grpc/native_generate.py): no handler task, no task
woken per token, and the same wire behaviour as the service path (status, compression, metadata)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest

import gateway.grpc.native_generate as native_generate
import gateway.http.common as http_common
from gateway.app import App
from gateway.errors import APIError
from gateway.grpc.native_server import NativeServer, start_native
from gateway.grpc.pipeline_backend import GRPC_ROUTE, PipelineBackend
from gateway.grpc.quicserve.v1 import quicserve_pb2 as pb
from gateway.grpc.service import InferenceService
from gateway.http.types import Request
from gateway.routing.pool import ModelPool
from tests.gateway.doubles import ScriptedWorkerConnection
from tests.gateway.grpc.h2_client import RawH2
from tests.gateway.grpc.web_client import frame

pytestmark = pytest.mark.timeout(60)

GENERATE = "/quicserve.v1.Inference/Generate"
GRPC = [(b"content-type", b"application/grpc"), (b"te", b"trailers")]


class KeyCheck:
    """An admission stage that wants ``x-api-key: k1`` (what reaches admission as a header)."""

    def __init__(self) -> None:
        self.seen: list[bytes | None] = []
        self.deadlines: list[float | None] = []
        self.released = 0

    def admit(self, req: Request, g: object, now: float, deadline: float | None) -> object:
        key = req.header(b"x-api-key")
        self.seen.append(key)
        self.deadlines.append(deadline)
        if key != b"k1":
            raise APIError(401, "bad key", "authentication_error", None, "invalid_api_key")
        return key

    def headers(self, grant: object) -> tuple[tuple[bytes, bytes], ...]:
        return ()

    def release(self, grant: object, completion_tokens: int, now: float) -> None:
        self.released += 1


@asynccontextmanager
async def native(worker: ScriptedWorkerConnection, admission: KeyCheck | None = None
                 ) -> AsyncIterator[tuple[NativeServer, App]]:
    pool = ModelPool()
    pool.add(worker)
    app = App(pool, admission=admission)
    server = await start_native(PipelineBackend(pool, app.generations, app.openai), "127.0.0.1", 0,
                                write_timeout=5.0)
    try:
        yield server, app
    finally:
        await server.close(timeout=1)


def _request(max_tokens: int) -> bytes:
    return frame(pb.GenerateRequest(model="tiny", prompt="hi", sampling=pb.Sampling(max_tokens=max_tokens))
                 .SerializeToString())


def _messages(body: bytes) -> list[pb.GenerateResponse]:
    out, pos = [], 0
    while len(body) - pos >= 5:
        n = int.from_bytes(body[pos + 1:pos + 5], "big")
        out.append(pb.GenerateResponse.FromString(body[pos + 5:pos + 5 + n]))
        pos += 5 + n
    return out


async def test_generate_runs_no_handler_and_no_task_per_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """One short task reads the request message; it has ended before the first token, and no
    other task runs for the call (the service's Generate handler is never entered)."""
    spawned: list[str] = []

    def counting(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        spawned.append(coro.__qualname__)
        return loop.create_task(coro)

    async def no_handler(self: InferenceService, stream: object) -> None:
        raise AssertionError("the service's Generate handler ran")

    monkeypatch.setattr(native_generate, "spawn", counting)
    monkeypatch.setattr(http_common, "spawn", counting)
    monkeypatch.setattr(InferenceService, "Generate", no_handler)
    worker = ScriptedWorkerConnection(tokens_per_batch=1)
    async with native(worker) as (server, app):
        loop = asyncio.get_running_loop()
        created: list[str] = []
        factory = loop.get_task_factory()

        def count(loop: asyncio.AbstractEventLoop, coro: Any, **kw: Any) -> asyncio.Future[Any]:
            created.append(coro.__qualname__)
            return asyncio.Task(coro, loop=loop, **kw)

        async with RawH2(server.port) as c:
            sid = c.request(GENERATE, GRPC)
            c.data(sid, _request(40), end=True)
            await c.until(lambda: len(_messages(c.body(sid))) >= 1)
            loop.set_task_factory(count)  # from the first message on: tasks the call creates
            try:
                await c.until(lambda: c.ended(sid))
            finally:
                loop.set_task_factory(factory)
        msgs = _messages(c.body(sid))
        assert "".join(m.text for m in msgs) == ("abcdefghij" * 4)
        assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH and msgs[-1].usage.completion_tokens == 40
        assert c.headers(sid)[-1][b"grpc-status"] == b"0"
        assert spawned == ["_Generate._read"]  # not the service route's task
        assert created == []
        assert app.metrics.in_flight == 0 and server.in_flight == 0
        assert any(GRPC_ROUTE in line and "200" in line for line in app.metrics.render().decode().splitlines())


async def test_admission_sees_the_metadata_and_refuses_with_a_trailers_only_status() -> None:
    check = KeyCheck()
    async with native(ScriptedWorkerConnection(), check) as (server, _):
        async with RawH2(server.port) as c:
            bad = c.request(GENERATE, [*GRPC, (b"x-api-key", b"nope")])
            c.data(bad, _request(3), end=True)
            good = c.request(GENERATE, [*GRPC, (b"x-api-key", b"k1"), (b"grpc-timeout", b"5S")])
            c.data(good, _request(3), end=True)
            await c.until(lambda: c.ended(bad) and c.ended(good))
        [only] = c.headers(bad)  # trailers-only: one HEADERS frame with the status
        assert only[b":status"] == b"200" and only[b"grpc-status"] == b"16" and only[b"grpc-message"] == b"bad key"
        assert c.headers(good)[-1][b"grpc-status"] == b"0"
        assert "".join(m.text for m in _messages(c.body(good))) == "abc"
        assert check.seen == [b"nope", b"k1"] and check.released == 1
        # the call's own deadline reaches admission (shedding refuses a predicted wait beyond it)
        bad_deadline, good_deadline = check.deadlines
        assert bad_deadline is None and good_deadline is not None and 4.0 < good_deadline <= 5.0


@pytest.mark.parametrize(("headers", "body", "code"), [
    ([(b"grpc-encoding", b"br")], _request(3), b"12"),  # an encoding we do not offer
    ([(b"grpc-timeout", b"1x")], _request(3), b"13"),  # malformed grpc-timeout
    ([], b"\x00\x7f\xff\xff\xff", b"8"),  # a message past the limit
    ([], frame(b"\xff\xff"), b"13"),  # not a GenerateRequest
    ([], b"", b"13"),  # no message
    ([], frame(pb.GenerateRequest(model="tiny").SerializeToString()), b"3"),  # neither prompt nor conversation
])
async def test_refusals_before_the_generation(headers: list[tuple[bytes, bytes]], body: bytes, code: bytes) -> None:
    worker = ScriptedWorkerConnection()
    async with native(worker) as (server, app):
        async with RawH2(server.port) as c:
            sid = c.request(GENERATE, [*GRPC, *headers], end=not body)
            if body:
                c.data(sid, body, end=True)
            await c.until(lambda: c.ended(sid))
        assert c.headers(sid)[0][b":status"] == b"200"
        assert c.headers(sid)[-1][b"grpc-status"] == code, c.headers(sid)
        assert worker.submits == [] and server.in_flight == 0 and app.metrics.in_flight == 0


def _grpcio_stream(target: str, compression: grpc.Compression) -> list[pb.GenerateResponse]:
    with grpc.insecure_channel(target, compression=compression) as ch:
        call = ch.unary_stream(GENERATE, request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=pb.GenerateResponse.FromString)
        return list(call(pb.GenerateRequest(model="tiny", prompt="hi " * 200, sampling=pb.Sampling(max_tokens=12))))


@pytest.mark.parametrize("compression", [grpc.Compression.NoCompression, grpc.Compression.Gzip])
async def test_grpcio_streams_with_and_without_gzip(compression: grpc.Compression) -> None:
    async with native(ScriptedWorkerConnection()) as (server, app):
        out = await asyncio.to_thread(_grpcio_stream, f"127.0.0.1:{server.port}", compression)
        assert "".join(m.text for m in out) == "abcdefghijab"
        assert out[-1].usage.completion_tokens == 12
        assert app.metrics.in_flight == 0
