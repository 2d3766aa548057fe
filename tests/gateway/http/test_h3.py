"""HTTP/3 adapter + QUIC listener: aioquic's own client against the real pipeline on 127.0.0.1."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.http.quic_settings import QuicSettings
from tests.gateway.doubles import ScriptedWorkerConnection, sse_events
from tests.gateway.http.h3_client import chat_body, h3_connect, h3_gateway, make_cert

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return make_cert(Path(tmp_path_factory.mktemp("h3cert")))


async def test_full_handshake_whole_json_response(cert: tuple[str, str]) -> None:
    async with h3_gateway(cert) as gw, h3_connect(gw.port) as client:
        models = await client.request("GET", "/v1/models")
        assert models.status == 200
        assert models.json()["data"][0]["id"] == "tiny"
        resp = await client.request("POST", "/v1/chat/completions", chat_body(5),
                                    [(b"content-type", b"application/json")])
        assert resp.status == 200, resp.body
        assert resp.json()["choices"][0]["message"]["content"] == "abcde"
        assert resp.header(b"content-length") == str(len(resp.body)).encode()
        assert client.early_data_accepted is False and client.session_resumed is False
    assert len(gw.worker.submits) == 1


async def test_sse_stream(cert: tuple[str, str]) -> None:
    async with h3_gateway(cert) as gw, h3_connect(gw.port) as client:
        resp = await client.request("POST", "/v1/chat/completions", chat_body(12, stream=True),
                                    [(b"content-type", b"application/json")])
        assert resp.status == 200
        assert resp.header(b"content-type", ).startswith(b"text/event-stream")  # type: ignore[union-attr]
        events = sse_events(resp.body)
        assert events[-1] == "[DONE]"
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1]  # type: ignore[index]
                       if isinstance(e, dict) and e.get("choices"))
        assert text == "abcdefghijab"


async def test_errors_are_the_pipelines(cert: tuple[str, str]) -> None:
    async with h3_gateway(cert) as gw, h3_connect(gw.port) as client:
        missing = await client.request("GET", "/nope")
        assert missing.status == 404 and missing.json()["error"]["code"] == "unknown_url"
        head = await client.request("HEAD", "/healthz")
        assert head.status == 200 and head.body == b""


async def test_many_concurrent_streams_on_one_connection(cert: tuple[str, str]) -> None:
    """64 streamed completions at once on one connection; each gets its own whole answer."""
    async with h3_gateway(cert) as gw, h3_connect(gw.port) as client:
        resps = [client.start("POST", "/v1/chat/completions", chat_body(10, stream=True)) for _ in range(64)]
        await asyncio.wait_for(asyncio.gather(*(r.done.wait() for r in resps)), 20)
        for r in resps:
            assert r.status == 200
            assert sse_events(r.body)[-1] == "[DONE]"
    assert len(gw.worker.submits) == 64


async def test_stream_limit_is_advertised(cert: tuple[str, str]) -> None:
    """With max_streams=4 the client may open 4 request streams until one ends: a fifth waits."""
    worker = ScriptedWorkerConnection(hang_after=1)
    async with h3_gateway(cert, QuicSettings(max_streams=4), worker) as gw, h3_connect(gw.port) as client:
        resps = [client.start("POST", "/v1/chat/completions", chat_body(5, stream=True)) for _ in range(5)]
        await asyncio.wait_for(asyncio.gather(*(r.got_data.wait() for r in resps[:4])), 10)
        await asyncio.sleep(0.3)
        assert len(worker.submits) == 4 and not resps[4].chunks
        client.cancel(resps[0])  # a stream ends: the fifth may now be opened
        await asyncio.wait_for(resps[4].got_data.wait(), 10)
        assert len(worker.submits) == 5


async def test_client_reset_cancels_the_call(cert: tuple[str, str]) -> None:
    worker = ScriptedWorkerConnection(hang_after=3)
    async with h3_gateway(cert, worker=worker) as gw, h3_connect(gw.port) as client:
        resp = client.start("POST", "/v1/chat/completions", chat_body(50, stream=True))
        await asyncio.wait_for(resp.got_data.wait(), 10)
        assert gw.listener.in_flight == 1
        client.cancel(resp)
        for _ in range(200):
            if worker.cancels and gw.listener.in_flight == 0:
                break
            await asyncio.sleep(0.01)
        assert worker.cancels == [worker.submits[0].request_id]
        assert gw.listener.in_flight == 0
