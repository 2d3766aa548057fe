"""gRPC-Web over HTTP/3: the same mounted route, through the QUIC listener and the one pipeline
(the real service bound to the pipeline, the ScriptedWorkerConnection double as the worker); with
the app's ``streams_body``, bidi Chat is full duplex."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from gateway.app import App
from gateway.grpc.mount import mount_grpc
from gateway.grpc.quicserve.v1 import quicserve_pb2 as pb
from gateway.http.quic_listener import QuicListener, start_quic_listener
from gateway.routing.pool import ModelPool
from gateway.settings import GrpcSettings
from tests.gateway.doubles import ScriptedWorkerConnection
from tests.gateway.grpc.web_client import CODECS, chat_replies, chat_turn, decode_text, frame, parse_body
from tests.gateway.http.h3_client import H3Client, H3Response, chat_body, h3_connect, make_cert

GENERATE = "/quicserve.v1.Inference/Generate"


@asynccontextmanager
async def _gateway(tmp_path: Path, conn: ScriptedWorkerConnection) -> AsyncIterator[QuicListener]:
    """The app with gRPC mounted as serve mounts it (CORS for one origin), behind the QUIC listener."""
    cert, key = make_cert(tmp_path)
    pool = ModelPool()
    pool.add(conn)
    app = App(pool)
    await mount_grpc(app, GrpcSettings(port=-1, allowed_origins=["https://app.example"]), "127.0.0.1")
    listener = await start_quic_listener(app.handle, "127.0.0.1", 0, cert, key, streams_body=app.streams_body)
    try:
        yield listener
    finally:
        await listener.close()


@pytest.mark.parametrize("ctype", ["application/grpc-web", "application/grpc-web+proto",
                                   "application/grpc-web-text", "application/grpc-web-text+proto"])
@pytest.mark.parametrize("encoding", ["identity", "gzip", "zstd"])
async def test_generate_over_grpc_web_on_h3(tmp_path: Path, ctype: str, encoding: str) -> None:
    conn = ScriptedWorkerConnection()
    async with _gateway(tmp_path, conn) as listener, h3_connect(listener.address[1]) as client:
        msg = pb.GenerateRequest(model="tiny", prompt="hi", sampling=pb.Sampling(max_tokens=5)).SerializeToString()
        body = frame(CODECS[encoding].compress(msg), 1) if encoding in CODECS else frame(msg)
        text = "text" in ctype
        r = await client.request("POST", GENERATE, base64.b64encode(body) if text else body,
                                 [(b"content-type", ctype.encode()), (b"x-grpc-web", b"1"),
                                  (b"grpc-encoding", encoding.encode()), (b"grpc-accept-encoding", encoding.encode())])
    assert r.status == 200
    assert r.header(b"grpc-encoding") == (encoding.encode() if encoding in CODECS else None)
    parsed = parse_body(decode_text(r.body) if text else r.body, encoding)
    texts = [pb.GenerateResponse.FromString(m) for m in parsed.messages]
    assert parsed.trailers == {"grpc-status": "0"}
    assert "".join(t.text for t in texts) == "abcde" and texts[-1].usage.completion_tokens == 5
    assert len(conn.submits) == 1


async def test_malformed_frames_over_h3_get_clean_trailers_and_the_server_goes_on(tmp_path: Path) -> None:
    conn = ScriptedWorkerConnection()
    async with _gateway(tmp_path, conn) as listener, h3_connect(listener.address[1]) as client:
        for body, ctype, status in [(frame(b"x", 0x80), b"application/grpc-web", "13"),
                                    (b"\x00\x00\x00", b"application/grpc-web", "13"),
                                    (b"%%%%", b"application/grpc-web-text", "3"),
                                    (frame(b"\xff\xff"), b"application/grpc-web", "13")]:  # bad protobuf: INTERNAL, as gRPC
            r = await client.request("POST", GENERATE, body, [(b"content-type", ctype)])
            assert r.status == 200
            parsed = parse_body(decode_text(r.body) if b"text" in ctype else r.body, None)
            assert parsed.messages == [] and parsed.trailers["grpc-status"] == status, (body, parsed.trailers)
        good = frame(pb.GenerateRequest(model="tiny", prompt="still here",
                                        sampling=pb.Sampling(max_tokens=2)).SerializeToString())
        r = await client.request("POST", GENERATE, good, [(b"content-type", b"application/grpc-web")])
        assert parse_body(r.body, None).trailers == {"grpc-status": "0"}
    assert len(conn.submits) == 1  # nothing malformed reached the worker


async def test_cors_over_h3(tmp_path: Path) -> None:
    async with _gateway(tmp_path, ScriptedWorkerConnection()) as listener, h3_connect(listener.address[1]) as client:
        pre = await client.request("OPTIONS", GENERATE, b"", [
            (b"origin", b"https://app.example"), (b"access-control-request-method", b"POST"),
            (b"access-control-request-headers", b"content-type,x-grpc-web,grpc-timeout")])
        assert pre.status == 204 and pre.header(b"access-control-allow-origin") == b"https://app.example"
        allowed = set((pre.header(b"access-control-allow-headers") or b"").split(b","))
        assert {b"content-type", b"x-grpc-web", b"grpc-timeout"} <= allowed
        msg = frame(pb.GenerateRequest(model="tiny", prompt="a", sampling=pb.Sampling(max_tokens=1)).SerializeToString())
        r = await client.request("POST", GENERATE, msg, [(b"content-type", b"application/grpc-web"),
                                                         (b"origin", b"https://app.example")])
        assert {b"grpc-status", b"grpc-message"} <= set((r.header(b"access-control-expose-headers") or b"").split(b","))
        other = await client.request("OPTIONS", GENERATE, b"", [(b"origin", b"https://evil.example"),
                                                                 (b"access-control-request-method", b"POST")])
        assert other.header(b"access-control-allow-origin") is None


async def _until(cond: Callable[[], bool], resp: H3Response) -> None:
    async with asyncio.timeout(10):
        while not cond():
            resp.got_data.clear()
            await resp.got_data.wait()


def _open_chat(client: H3Client) -> H3Response:
    """A Chat request stream whose body stays open (the helper's ``start`` ends it)."""
    sid = client._quic.get_next_available_stream_id()
    client.h3.send_headers(sid, [(b":method", b"POST"), (b":scheme", b"https"), (b":authority", b"127.0.0.1"),
                                 (b":path", b"/quicserve.v1.Inference/Chat"),
                                 (b"content-type", b"application/grpc-web+proto")], end_stream=False)
    resp = client.responses[sid] = H3Response(sid)
    return resp


async def test_chat_over_h3_is_full_duplex(tmp_path: Path) -> None:
    conn = ScriptedWorkerConnection()
    async with _gateway(tmp_path, conn) as listener, h3_connect(listener.address[1]) as client:
        resp = _open_chat(client)
        client.h3.send_data(resp.stream_id, chat_turn("hello", 3, model="tiny"), end_stream=False)
        client.transmit()
        await _until(lambda: any(r.finish_reason for r in chat_replies(resp.body)), resp)
        assert not resp.done.is_set() and len(conn.submits) == 1  # turn 2 not sent yet
        client.h3.send_data(resp.stream_id, chat_turn("again", 2), end_stream=True)
        client.transmit()
        await asyncio.wait_for(resp.done.wait(), 10)
    parsed = parse_body(resp.body, None)
    replies = [pb.ChatResponse.FromString(m) for m in parsed.messages]
    assert ["".join(r.text for r in replies if r.turn == n) for n in (1, 2)] == ["abc", "ab"]
    assert parsed.trailers["grpc-status"].strip() == "0" and len(conn.submits) == 2


async def test_a_reset_mid_chat_over_h3_cancels_the_workers_request(tmp_path: Path) -> None:
    conn = ScriptedWorkerConnection(hang_after=2)
    async with _gateway(tmp_path, conn) as listener, h3_connect(listener.address[1]) as client:
        resp = _open_chat(client)
        client.h3.send_data(resp.stream_id, chat_turn("hello", 50, model="tiny"), end_stream=False)
        client.transmit()
        await _until(lambda: len(chat_replies(resp.body)) >= 1, resp)
        client.cancel(resp)
        async with asyncio.timeout(10):
            while not conn.cancels:
                await asyncio.sleep(0.02)
        assert conn.cancels == [1] and conn.in_flight == 0
        async with asyncio.timeout(10):  # and the call's done() came
            while listener.state.in_flight:
                await asyncio.sleep(0.02)


async def test_other_requests_still_read_whole_with_streams_body_on(tmp_path: Path) -> None:
    conn = ScriptedWorkerConnection()
    async with _gateway(tmp_path, conn) as listener, h3_connect(listener.address[1]) as client:
        r = await client.request("POST", "/v1/chat/completions", chat_body(4), [(b"content-type", b"application/json")])
    assert r.status == 200 and r.json()["choices"][0]["message"]["content"] == "abcd"


async def test_a_request_refused_at_its_headers_stops_the_upload(tmp_path: Path) -> None:
    """With streamed bodies on, a malformed request is answered at its headers: the client is told
    to stop sending the body (STOP_SENDING) instead of uploading into an ignored stream."""
    async with _gateway(tmp_path, ScriptedWorkerConnection()) as listener, h3_connect(listener.address[1]) as client:
        sid = client._quic.get_next_available_stream_id()
        client.h3.send_headers(sid, [(b":method", b"POST"), (b":scheme", b"https"), (b":authority", b"127.0.0.1"),
                                     (b":path", b"no-slash"), (b"content-type", b"application/grpc-web")],
                               end_stream=False)
        resp = client.responses[sid] = H3Response(sid)
        client.transmit()
        await asyncio.wait_for(resp.done.wait(), 10)
        assert resp.status == 400
        async with asyncio.timeout(5):
            while not resp.stop_sending:
                await asyncio.sleep(0.01)
        ok = await client.request("POST", GENERATE, frame(pb.GenerateRequest(
            model="tiny", prompt="a", sampling=pb.Sampling(max_tokens=1)).SerializeToString()),
            [(b"content-type", b"application/grpc-web")])
        assert parse_body(ok.body, None).trailers == {"grpc-status": "0"}
