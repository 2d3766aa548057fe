"""gRPC against a real gateway process and a real (synthetic) worker: native gRPC with the grpcio
client, gRPC-Web over HTTP/1.1 and HTTP/2 on the gateway's HTTP port (bidi Chat full duplex over
HTTP/2); a cancelled call or a reset stream frees the worker's request, as the worker's own stats
(``quicserve_worker_running``) show."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest

from gateway.grpc.quicserve.v1 import quicserve_pb2 as pb
from tests.gateway.grpc.h2_client import RawH2
from tests.gateway.grpc.web_client import chat_replies, chat_turn, frame, parse_body

from .test_gateway_e2e import Gateway, start_gateway, stop_gateway

pytestmark = pytest.mark.timeout(120)
GENERATE = "/quicserve.v1.Inference/Generate"


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, str]]:
    g = start_gateway(tmp_path_factory.mktemp("grpc"), "--no-tls", "--worker-option=synthetic_step_ms=5")
    target = next(m.group(1) for line in g.lines if (m := re.search(r"listening on grpc://(\S+)", line)))
    yield g, target
    assert stop_gateway(g) == 0


def _generate(target: str, max_tokens: int) -> list[pb.GenerateResponse]:
    with grpc.insecure_channel(target) as ch:
        call = ch.unary_stream(GENERATE, request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=pb.GenerateResponse.FromString)
        return list(call(pb.GenerateRequest(model="tiny", prompt="hello",
                                            sampling=pb.Sampling(max_tokens=max_tokens)), timeout=30))


def test_native_generate_streams_from_the_worker(gw: tuple[Gateway, str]) -> None:
    _, target = gw
    out = _generate(target, 12)
    assert len(out) > 1 and out[-1].usage.completion_tokens == 12
    assert sum(1 for r in out if r.text) >= 2  # deltas, not one block


def test_native_generate_with_gzip_compression(gw: tuple[Gateway, str]) -> None:
    _, target = gw
    with grpc.insecure_channel(target, compression=grpc.Compression.Gzip) as ch:
        call = ch.unary_stream(GENERATE, request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=pb.GenerateResponse.FromString)
        out = list(call(pb.GenerateRequest(model="tiny", prompt="hello " * 50, sampling=pb.Sampling(max_tokens=6)),
                        timeout=30))
    assert out[-1].usage.completion_tokens == 6 and out[-1].usage.prompt_tokens > 50


def test_a_cancelled_call_frees_the_workers_request(gw: tuple[Gateway, str]) -> None:
    g, target = gw
    with grpc.insecure_channel(target) as ch:
        call = ch.unary_stream(GENERATE, request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=pb.GenerateResponse.FromString)
        stream = call(pb.GenerateRequest(model="tiny", prompt="x", sampling=pb.Sampling(max_tokens=4000)))
        next(stream)
        deadline = time.monotonic() + 10  # the worker's stats come with its heartbeat
        while time.monotonic() < deadline and not g.metric("quicserve_worker_running"):
            time.sleep(0.05)
        assert g.metric("quicserve_worker_running") == 1  # the worker's stats: it is generating
        stream.cancel()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and g.metric("quicserve_worker_running"):
        time.sleep(0.05)
    assert g.metric("quicserve_worker_running") == 0 and g.metric("quicserve_worker_in_flight") == 0


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
async def test_grpc_web_on_the_http_port(gw: tuple[Gateway, str], http2: bool) -> None:
    g, _ = gw
    msg = pb.GenerateRequest(model="tiny", prompt="hi", sampling=pb.Sampling(max_tokens=5)).SerializeToString()
    async with httpx.AsyncClient(base_url=g.http, http1=not http2, http2=http2, timeout=30) as c:
        r = await c.post(GENERATE, content=frame(msg), headers={"content-type": "application/grpc-web+proto",
                                                                "x-grpc-web": "1"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/grpc-web")
    parsed = parse_body(r.content, None)
    texts = [pb.GenerateResponse.FromString(m) for m in parsed.messages]
    assert parsed.trailers["grpc-status"].strip() == "0"
    assert texts[-1].usage.completion_tokens == 5
    await asyncio.sleep(0)


async def _until_metric(g: Gateway, name: str, value: float) -> float:
    deadline = time.monotonic() + 10  # the worker's stats come with its heartbeat
    while (got := await asyncio.to_thread(g.metric, name)) != value and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return got


async def test_grpc_web_chat_over_h2_is_full_duplex_and_a_reset_frees_the_worker(gw: tuple[Gateway, str]) -> None:
    """On the gateway's HTTP port: turn 1's reply arrives while the request stream is open (turn 2
    not sent yet); then turn 2 runs on the worker and a RST_STREAM ends it there."""
    g, _ = gw
    async with RawH2(int(g.http.rsplit(":", 1)[1])) as c:
        sid = c.request("/quicserve.v1.Inference/Chat", [(b"content-type", b"application/grpc-web+proto")])
        c.data(sid, chat_turn("hello", 5, model="tiny"))
        await c.until(lambda: any(r.finish_reason for r in chat_replies(c.body(sid))), 30)
        assert not c.ended(sid)
        first = chat_replies(c.body(sid))
        assert first[-1].turn == 1 and first[-1].usage.completion_tokens == 5
        c.data(sid, chat_turn("again", 4000))
        await c.until(lambda: any(r.turn == 2 for r in chat_replies(c.body(sid))), 30)
        assert await _until_metric(g, "quicserve_worker_running", 1) == 1  # turn 2 is generating
        c.reset(sid)
        assert await _until_metric(g, "quicserve_worker_running", 0) == 0
    assert g.metric("quicserve_worker_in_flight") == 0
