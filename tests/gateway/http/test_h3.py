"""HTTP/3 adapter + QUIC listener: aioquic's own client against the real pipeline on 127.0.0.1."""

from __future__ import annotations

import asyncio

import pytest

from gateway.http.quic_settings import QuicSettings
from tests.gateway.doubles import ScriptedWorkerConnection, sse_events
from tests.gateway.http.h3_client import H3Response, chat_body, h3_connect, h3_gateway

pytestmark = pytest.mark.timeout(30)


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


async def test_protocol_limits_are_the_pipelines_errors(cert: tuple[str, str]) -> None:
    settings = QuicSettings(max_body_bytes=1000, max_header_bytes=500)
    async with h3_gateway(cert, settings) as gw, h3_connect(gw.port) as client:
        big = await client.request("POST", "/v1/chat/completions", b"x" * 2000)
        assert big.status == 413 and big.json()["error"]["code"] == "request_too_large"
        fat = await client.request("GET", "/healthz", headers=[(b"x-pad", b"y" * 600)])
        assert fat.status == 431 and fat.json()["error"]["type"] == "invalid_request_error"
        assert (await client.request("GET", "/healthz")).status == 200  # the connection lives on
    assert gw.seen == [gw.seen[-1]] and gw.worker.submits == []
    page = gw.app.metrics.render()
    for status in (b"413", b"431"):  # counted by the pipeline's protocol-error metric
        assert b'quicserve_protocol_errors_total{protocol="h3",status="%s"} 1.0' % status in page, page


async def test_a_request_body_that_stops_coming_gets_408(cert: tuple[str, str]) -> None:
    async with h3_gateway(cert, QuicSettings(body_timeout=0.2)) as gw, h3_connect(gw.port) as client:
        sid = client._quic.get_next_available_stream_id()
        client.h3.send_headers(sid, [(b":method", b"POST"), (b":scheme", b"https"), (b":authority", b"x"),
                                     (b":path", b"/v1/chat/completions")])
        client.h3.send_data(sid, b'{"model": ', end_stream=False)  # and nothing more
        resp = client.responses[sid] = H3Response(sid)
        client.transmit()
        await asyncio.wait_for(resp.done.wait(), 5)
        assert resp.status == 408 and resp.json()["error"]["code"] == "request_timeout"
        assert gw.seen == []


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


class _CountingTransport:
    """The listener's UDP transport, counting the datagrams it sends."""

    def __init__(self, real: asyncio.DatagramTransport) -> None:
        self.real = real
        self.datagrams = 0

    def sendto(self, data: bytes, addr: object = None) -> None:
        self.datagrams += 1
        self.real.sendto(data, addr)

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)


async def test_writes_of_one_step_share_datagrams(cert: tuple[str, str]) -> None:
    """16 streams each get one token per engine step: a transmit per write would send at least
    one datagram per SSE event; one transmit per loop iteration packs a step's 16 events (~150
    bytes each) into a few datagrams (congestion control spreads some over the acks that open
    its window), so far fewer datagrams than events leave."""
    async with h3_gateway(cert) as gw:
        counting = _CountingTransport(gw.listener._server._transport)  # type: ignore[arg-type]
        gw.listener._server._transport = counting  # type: ignore[assignment]
        async with h3_connect(gw.port) as client:
            await client.request("GET", "/healthz")
            before = counting.datagrams
            resps = [client.start("POST", "/v1/chat/completions", chat_body(30, stream=True)) for _ in range(16)]
            await asyncio.wait_for(asyncio.gather(*(r.done.wait() for r in resps)), 20)
            sent = counting.datagrams - before
        events = sum(len(sse_events(r.body)) for r in resps)
        assert events >= 16 * 30
        assert sent < events / 2, (sent, events)  # a transmit per write: at least one datagram each


async def test_idle_connections_are_closed(cert: tuple[str, str]) -> None:
    async with h3_gateway(cert, QuicSettings(idle_timeout=0.3)) as gw, h3_connect(gw.port) as client:
        assert (await client.request("GET", "/healthz")).status == 200
        assert gw.listener.connections == 1
        # both ends time out (the idle timeout in use is the smaller of the two advertised)
        await asyncio.wait_for(client.wait_closed(), 5)
        for _ in range(200):
            if gw.listener.connections == 0:
                break
            await asyncio.sleep(0.01)
        assert gw.listener.connections == 0


async def test_draining_finishes_requests_in_flight_and_takes_no_new_connection(cert: tuple[str, str]) -> None:
    async with h3_gateway(cert) as gw:
        async with h3_connect(gw.port) as client:
            resp = client.start("POST", "/v1/chat/completions", chat_body(400, stream=True))
            await asyncio.wait_for(resp.got_data.wait(), 10)
            gw.listener.stop_accepting()
            assert await gw.listener.wait_idle(10)
            await asyncio.wait_for(resp.done.wait(), 10)
            assert resp.status == 200 and sse_events(resp.body)[-1] == "[DONE]"
        with pytest.raises(ConnectionError):  # ignored: the client gives up after its idle timeout
            async with h3_connect(gw.port, idle_timeout=0.5):
                pass
