"""gRPC-Web over the gateway's HTTP/1.1 and HTTP/2 listeners (``start_listener`` on 127.0.0.1
port 0, the app's ``streams_body`` given to it as serve gives it) through :class:`GrpcWebRoute`, with httpx and with a gRPC-Web client from npm run
by Node (tests/grpc_web). The backend is the echo double (tests/gateway/grpc/backend_double.py).
The route is mounted on the app's entrance as ``serve`` mounts it; the backend is the echo double.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from gateway.app import App
from gateway.errors import APIError
from gateway.grpc.compression import Codecs
from gateway.grpc.grpc_web_route import GrpcWebRoute
from gateway.grpc.quicserve.v1 import quicserve_pb2 as pb
from gateway.grpc.service import InferenceService
from gateway.http.common import HttpLimits, task_entrance
from gateway.http.listeners import ListenerSpec, start_listener
from gateway.routing.pool import ModelPool
from tests.gateway.grpc.backend_double import EchoBackendDouble
from tests.gateway.grpc.h2_client import RawH2
from tests.gateway.grpc.web_client import CODECS, decode_text, frame, parse_body

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
NODE_DIR = REPO / "tests" / "grpc_web"
GENERATE = "/quicserve.v1.Inference/Generate"


@pytest.fixture
def backend() -> EchoBackendDouble:
    return EchoBackendDouble()


@pytest.fixture
async def base_url(backend: EchoBackendDouble) -> AsyncIterator[str]:
    handlers = InferenceService(backend).__mapping__()
    route = GrpcWebRoute(handlers, Codecs(), 1 << 16, allowed_origins={b"https://app.example"})
    app = App(ModelPool())
    app.mount(handlers, task_entrance(route), route.streams_body)  # as serve.py mounts it (gateway.grpc.mount)
    server = await start_listener(app.handle, ListenerSpec("tcp", "127.0.0.1", 0), streams_body=app.streams_body)
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        await server.close()


def unframe(body: bytes, encoding: str | None = None) -> tuple[list[bytes], dict[str, str]]:
    parsed = parse_body(body, encoding)
    return parsed.messages, parsed.trailers


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
@pytest.mark.parametrize("ctype", ["application/grpc-web", "application/grpc-web+proto",
                                   "application/grpc-web-text", "application/grpc-web-text+proto"])
@pytest.mark.parametrize("encoding", ["identity", "gzip", "zstd"])
async def test_generate_over_http(base_url: str, http2: bool, ctype: str, encoding: str) -> None:
    request = pb.GenerateRequest(model="tiny", prompt=" ".join(["token"] * 30)).SerializeToString()
    body = frame(CODECS[encoding].compress(request), 1) if encoding in CODECS else frame(request)
    text = "text" in ctype
    async with httpx.AsyncClient(http1=not http2, http2=http2) as client:
        r = await client.post(base_url + GENERATE, content=base64.b64encode(body) if text else body,
                              headers={"content-type": ctype, "x-grpc-web": "1", "grpc-encoding": encoding,
                                       "grpc-accept-encoding": encoding})
    assert r.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
    assert r.status_code == 200
    assert r.headers.get("grpc-encoding") == (encoding if encoding in CODECS else None)
    messages, trailers = unframe(decode_text(r.content) if text else r.content, encoding)
    replies = [pb.GenerateResponse.FromString(m) for m in messages]
    assert "".join(x.text for x in replies) == " ".join(["TOKEN"] * 30)
    assert replies[-1].finish_reason == pb.FINISH_REASON_STOP
    assert trailers == {"grpc-status": "0"}


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
async def test_chat_turns_in_one_body(base_url: str, backend: EchoBackendDouble, http2: bool) -> None:
    turns = [pb.ChatRequest(turn=pb.Turn(model="tiny", messages=[pb.Message(role="user", content="one two")])),
             pb.ChatRequest(turn=pb.Turn(messages=[pb.Message(role="user", content="three")]))]
    async with httpx.AsyncClient(http1=not http2, http2=http2) as client:
        r = await client.post(base_url + "/quicserve.v1.Inference/Chat",
                              content=b"".join(frame(t.SerializeToString()) for t in turns),
                              headers={"content-type": "application/grpc-web+proto"})
    messages, trailers = unframe(r.content)
    replies = [pb.ChatResponse.FromString(m) for m in messages]
    assert ["".join(x.text for x in replies if x.turn == n) for n in (1, 2)] == ["ONE TWO", "THREE"]
    assert trailers == {"grpc-status": "0"}
    assert [m.content for m in backend.calls[1].spec.messages or ()] == ["one two", "ONE TWO", "three"]


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
async def test_malformed_frames_get_clean_trailers_and_the_server_goes_on(
        base_url: str, backend: EchoBackendDouble, http2: bool) -> None:
    async with httpx.AsyncClient(http1=not http2, http2=http2) as client:
        for body, ctype, status in [(frame(b"x", 0x80), "application/grpc-web", "13"),
                                    (b"\x00\x00\x00", "application/grpc-web", "13"),
                                    (b"%%%%", "application/grpc-web-text", "3")]:
            r = await client.post(base_url + GENERATE, content=body, headers={"content-type": ctype})
            assert r.status_code == 200
            messages, trailers = unframe(decode_text(r.content) if "text" in ctype else r.content)
            assert messages == [] and trailers["grpc-status"] == status
        good = frame(pb.GenerateRequest(model="tiny", prompt="still here").SerializeToString())
        r = await client.post(base_url + GENERATE, content=good, headers={"content-type": "application/grpc-web"})
        assert unframe(r.content, None)[1] == {"grpc-status": "0"}
    assert len(backend.calls) == 1


async def test_cors_preflight_and_exposed_headers(base_url: str) -> None:
    async with httpx.AsyncClient() as client:
        pre = await client.options(base_url + GENERATE, headers={
            "origin": "https://app.example", "access-control-request-method": "POST",
            "access-control-request-headers": "content-type,x-grpc-web,grpc-timeout"})
        assert pre.status_code == 204
        assert pre.headers["access-control-allow-origin"] == "https://app.example"
        assert {"content-type", "x-grpc-web", "grpc-timeout"} <= set(pre.headers["access-control-allow-headers"].split(","))
        r = await client.post(base_url + GENERATE, content=frame(pb.GenerateRequest(model="tiny", prompt="a").SerializeToString()),
                              headers={"content-type": "application/grpc-web", "origin": "https://app.example"})
        assert {"grpc-status", "grpc-message"} <= set(r.headers["access-control-expose-headers"].split(","))
        other = await client.options(base_url + GENERATE, headers={
            "origin": "https://evil.example", "access-control-request-method": "POST"})
        assert "access-control-allow-origin" not in other.headers


def _node(base_url: str, desc: Path, method: str, request: dict[str, object]) -> list[dict[str, object]]:
    done = subprocess.run(["node", "client.mjs", base_url, str(desc), method, json.dumps(request)],
                          cwd=NODE_DIR, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node (make test installs tests/grpc_web)")
async def test_npm_grpc_web_client_streams_generate(base_url: str, backend: EchoBackendDouble,
                                                    tmp_path: Path) -> None:
    assert (NODE_DIR / "node_modules" / "@connectrpc" / "connect-web").is_dir(), "run npm ci in tests/grpc_web"
    # The client compiles the .proto as any client would (protoc fills in JSON names).
    desc = tmp_path / "quicserve.desc"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", str(REPO), f"--descriptor_set_out={desc}",
                    str(REPO / "gateway/grpc/quicserve/v1/quicserve.proto")], check=True, timeout=60)
    out = await asyncio.to_thread(_node, base_url, desc, "Generate", {"model": "tiny", "prompt": "from the browser side"})
    assert out[-1] == {"status": "ok"}
    assert "".join(str(m.get("text", "")) for m in out[:-1]) == "FROM THE BROWSER SIDE"
    assert len(out) - 1 == 4  # one message per word: streamed, not buffered
    assert out[-2]["finishReason"] == "FINISH_REASON_STOP"
    backend.reject = APIError(404, "no such model")
    out = await asyncio.to_thread(_node, base_url, desc, "Generate", {"model": "nope", "prompt": "x"})
    assert out == [{"status": "error", "code": "NotFound", "message": "no such model"}]


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
async def test_client_going_away_cancels_the_generation(base_url: str, backend: EchoBackendDouble,
                                                        http2: bool) -> None:
    backend.hang_after = 1
    body = frame(pb.GenerateRequest(model="tiny", prompt="a b c").SerializeToString())
    async with httpx.AsyncClient(http1=not http2, http2=http2) as client:
        async with client.stream("POST", base_url + GENERATE, content=body,
                                 headers={"content-type": "application/grpc-web"}) as r:
            first = await anext(r.aiter_raw())
            assert pb.GenerateResponse.FromString(first[5:]).text == "A"
        # Leaving the block closes the response early (h1: the connection; h2: RST_STREAM).
    await asyncio.wait_for(backend.calls[0].cancelled.wait(), 10)
    assert not backend.calls[0].ended


def _turn(text: str, model: str = "") -> bytes:
    t = pb.Turn(model=model, messages=[pb.Message(role="user", content=text)])
    return frame(pb.ChatRequest(turn=t).SerializeToString())


def _replies(body: bytes) -> list[pb.ChatResponse]:
    """The whole message frames received so far (the trailer frame, if there, left out)."""
    out, pos = [], 0
    while len(body) - pos >= 5 and len(body) - pos >= 5 + int.from_bytes(body[pos + 1:pos + 5], "big"):
        n = int.from_bytes(body[pos + 1:pos + 5], "big")
        if not body[pos] & 0x80:
            out.append(pb.ChatResponse.FromString(body[pos + 5:pos + 5 + n]))
        pos += 5 + n
    return out


CHAT_HEADERS = [(b"content-type", b"application/grpc-web+proto"), (b"x-grpc-web", b"1")]


async def test_chat_over_h2_is_full_duplex(base_url: str, backend: EchoBackendDouble) -> None:
    """Turn 2 leaves only once turn 1's whole reply has arrived, on one open request stream."""
    async with RawH2(int(base_url.rsplit(":", 1)[1])) as c:
        sid = c.request("/quicserve.v1.Inference/Chat", CHAT_HEADERS)
        c.data(sid, _turn("one two", model="tiny"))
        await c.until(lambda: any(r.finish_reason for r in _replies(c.body(sid))))
        assert not c.ended(sid) and len(backend.calls) == 1
        c.data(sid, _turn("three"), end=True)
        await c.until(lambda: c.ended(sid))
        parsed = parse_body(c.body(sid), None)
    replies = [pb.ChatResponse.FromString(m) for m in parsed.messages]
    assert ["".join(x.text for x in replies if x.turn == n) for n in (1, 2)] == ["ONE TWO", "THREE"]
    assert parsed.trailers == {"grpc-status": "0"}
    assert c.headers(sid)[0][b":status"] == b"200"


async def test_client_reset_mid_chat_cancels_the_generation(base_url: str, backend: EchoBackendDouble) -> None:
    backend.hang_after = 1
    async with RawH2(int(base_url.rsplit(":", 1)[1])) as c:
        sid = c.request("/quicserve.v1.Inference/Chat", CHAT_HEADERS)
        c.data(sid, _turn("a b c", model="tiny"))
        await c.until(lambda: len(_replies(c.body(sid))) == 1)
        c.reset(sid)
        await asyncio.wait_for(backend.calls[0].cancelled.wait(), 10)
        # the connection goes on serving
        sid2 = c.request(GENERATE, CHAT_HEADERS)
        backend.hang_after = None
        c.data(sid2, frame(pb.GenerateRequest(model="tiny", prompt="still here").SerializeToString()), end=True)
        await c.until(lambda: c.ended(sid2))
        assert parse_body(c.body(sid2), None).trailers == {"grpc-status": "0"}
    assert not backend.calls[0].ended


async def test_a_streamed_body_past_the_limit_is_resource_exhausted(backend: EchoBackendDouble) -> None:
    handlers = InferenceService(backend).__mapping__()
    route = GrpcWebRoute(handlers, Codecs(), 1 << 16)
    app = App(ModelPool())
    app.mount(handlers, task_entrance(route), route.streams_body)
    server = await start_listener(app.handle, ListenerSpec("tcp", "127.0.0.1", 0), streams_body=app.streams_body,
                                  limits=HttpLimits(max_body_bytes=2000))
    try:
        async with RawH2(server.port) as c:
            sid = c.request("/quicserve.v1.Inference/Chat", CHAT_HEADERS)
            c.data(sid, _turn("x" * 1500, model="tiny"))
            await c.until(lambda: any(r.finish_reason for r in _replies(c.body(sid))))
            c.data(sid, _turn("y" * 1500))  # past 2000 bytes in all
            await c.until(lambda: c.ended(sid))
            parsed = parse_body(c.body(sid), None)
        assert parsed.trailers["grpc-status"] == "8" and "exceeds 2000 bytes" in parsed.trailers["grpc-message"]
        assert len(backend.calls) == 1
        assert server.in_flight == 0
    finally:
        await server.close()
