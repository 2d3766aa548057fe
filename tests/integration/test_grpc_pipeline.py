"""gRPC through the one pipeline: the grpcio client (C core) -> grpclib server -> PipelineBackend
-> admission, routing, the generation call -> the ScriptedWorkerConnection double, whose submits
and cancels show what reached the "worker"."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from gateway.app import App
from gateway.grpc.native_server import start_native
from gateway.grpc.pipeline_backend import PipelineBackend
from gateway.grpc.quicserve.v1 import quicserve_pb2 as pb
from gateway.routing.pool import ModelPool
from tests.gateway.doubles import ScriptedWorkerConnection
from transport.messages import ErrorCode

pytestmark = pytest.mark.timeout(60)
METHOD = "/quicserve.v1.Inference/"


async def _target(conn: ScriptedWorkerConnection) -> AsyncIterator[tuple[str, App]]:
    pool = ModelPool()
    pool.add(conn)
    app = App(pool)
    native = await start_native(PipelineBackend(pool, app.generations, app.openai), "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{native.port}", app
    finally:
        await native.close()


def _stream(target: str, req: pb.GenerateRequest, **kw: object) -> list[pb.GenerateResponse]:
    with grpc.insecure_channel(target) as ch:
        call = ch.unary_stream(METHOD + "Generate", request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=pb.GenerateResponse.FromString)
        return list(call(req, **kw))


async def test_generate_streams_the_workers_tokens() -> None:
    conn = ScriptedWorkerConnection()
    async for target, app in _target(conn):
        out = await asyncio.to_thread(_stream, target, pb.GenerateRequest(
            model="tiny", prompt="hi", sampling=pb.Sampling(max_tokens=5, seed=3)))
        assert "".join(r.text for r in out) == "abcde"
        last = out[-1]
        assert last.usage.completion_tokens == 5 and last.usage.prompt_tokens == 7
        sub = conn.submits[0]
        assert sub.prompt == "hi" and sub.params.max_tokens == 5 and sub.params.seed == 3
        assert app.metrics.in_flight == 0


async def test_pipeline_errors_become_grpc_status() -> None:
    conn = ScriptedWorkerConnection(fail_before_first=ErrorCode.CONTEXT_LENGTH)
    async for target, _ in _target(conn):
        for req, code in ((pb.GenerateRequest(model="nope", prompt="x"), grpc.StatusCode.NOT_FOUND),
                          (pb.GenerateRequest(model="tiny", prompt="x"), grpc.StatusCode.INVALID_ARGUMENT)):
            with pytest.raises(grpc.RpcError) as ei:
                await asyncio.to_thread(_stream, target, req)
            assert ei.value.code() is code  # type: ignore[attr-defined]


async def test_cancel_and_deadline_free_the_workers_request() -> None:
    conn = ScriptedWorkerConnection(hang_after=2)
    async for target, app in _target(conn):
        with pytest.raises(grpc.RpcError) as ei:
            await asyncio.to_thread(_stream, target, pb.GenerateRequest(model="tiny", prompt="x"), timeout=0.5)
        assert ei.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
        for _ in range(100):
            if conn.cancels:
                break
            await asyncio.sleep(0.02)
        assert conn.cancels == [1] and conn.in_flight == 0 and app.metrics.in_flight == 0
