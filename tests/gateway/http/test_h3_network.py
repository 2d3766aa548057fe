"""HTTP/3 over a bad network (tests/netrelay.py): loss, migration, a stalled reader, Retry."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from gateway.http.h3 import H3Protocol
from gateway.http.h3_sink import unsent as _unsent
from gateway.http.quic_settings import QuicSettings
from tests.gateway.doubles import ScriptedWorkerConnection, sse_events
from tests.gateway.http.h3_client import Gateway, chat_body, h3_connect, h3_gateway
from tests.netrelay import Link, UdpRelay

pytestmark = pytest.mark.timeout(60)

CHAT = "/v1/chat/completions"


@asynccontextmanager
async def relay_to(gw: Gateway, link: Link, seed: int = 1) -> AsyncIterator[UdpRelay]:
    relay = await UdpRelay.start(("127.0.0.1", gw.port), link, seed)
    try:
        yield relay
    finally:
        relay.close()


def text_of(body: bytes) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in sse_events(body)  # type: ignore[index]
                   if isinstance(e, dict) and e.get("choices"))


def the_connection(gw: Gateway) -> H3Protocol:
    (conn,) = gw.listener.state.connections
    assert isinstance(conn, H3Protocol)
    return conn


async def test_sse_completes_under_15_percent_loss(cert: tuple[str, str]) -> None:
    async with h3_gateway(cert) as gw, relay_to(gw, Link.rtt(0.04, loss=0.15, jitter=0.005)) as relay:
        async with h3_connect(relay.address[1]) as client:
            resps = [client.start("POST", CHAT, chat_body(40, stream=True)) for _ in range(4)]
            await asyncio.wait_for(asyncio.gather(*(r.done.wait() for r in resps)), 40)
        assert relay.dropped > 0  # the loss was real
        for r in resps:
            assert r.status == 200 and text_of(r.body) == "abcdefghij" * 4


async def test_migration_mid_stream_keeps_the_response(cert: tuple[str, str]) -> None:
    """The client's NAT mapping changes (new source port) and it moves to a new connection ID
    while a long SSE response is arriving: the server validates the new path and finishes there."""
    async with h3_gateway(cert) as gw, relay_to(gw, Link.rtt(0.02)) as relay:
        async with h3_connect(relay.address[1]) as client:
            resp = client.start("POST", CHAT, chat_body(3000, stream=True))
            await asyncio.wait_for(resp.got_data.wait(), 10)
            conn = the_connection(gw)
            before = conn._quic.get_peer_address()
            client.change_connection_id()
            relay.rebind()
            client.transmit()
            await asyncio.wait_for(resp.done.wait(), 30)
            after = conn._quic.get_peer_address()
            assert after != before
            assert conn._quic._network_paths[0].is_validated  # aioquic's path validation ran
        assert resp.status == 200 and not resp.reset
        assert text_of(resp.body) == ("abcdefghij" * 300)
        assert len(gw.worker.submits) == 1


async def test_a_stalled_reader_gets_backpressure_not_a_growing_buffer(cert: tuple[str, str]) -> None:
    bound = 8 << 10
    async with h3_gateway(cert, QuicSettings(max_stream_buffer=bound)) as gw, relay_to(gw, Link()) as relay:
        async with h3_connect(relay.address[1]) as client:
            resp = client.start("POST", CHAT, chat_body(2000, stream=True))
            await asyncio.wait_for(resp.got_data.wait(), 10)
            relay.down_link = Link(loss=1.0)  # nothing reaches the client: no acks come back
            conn = the_connection(gw)
            sid = resp.stream_id
            peak = 0
            for _ in range(50):
                await asyncio.sleep(0.01)
                peak = max(peak, _unsent(conn._quic, sid))
            assert conn._waiters  # the writer is waiting in send(), not piling up bytes
            assert bound < peak < bound + 4096  # one SSE event over the bound at most
            relay.down_link = Link()
            await asyncio.wait_for(resp.done.wait(), 30)
        assert text_of(resp.body) == "abcdefghij" * 200


async def test_address_validation_with_retry(cert: tuple[str, str]) -> None:
    async with h3_gateway(cert, QuicSettings(retry=True)) as gw, h3_connect(gw.port) as client:
        resp = await client.request("GET", "/v1/models")
        assert resp.status == 200
        assert client._quic._retry_count == 1  # the server made it prove its address first


async def test_a_reset_while_the_writer_waits_cancels_the_call(cert: tuple[str, str]) -> None:
    """The writer is blocked in send() (nothing reaches the client) when the client resets:
    send raises, the call ends and its worker request is cancelled."""
    # the worker stops after 1,500 of 2,000 tokens: its request is still open when the client resets
    # (a double that had produced them all would leave nothing to cancel)
    worker = ScriptedWorkerConnection(hang_after=1500)
    async with h3_gateway(cert, QuicSettings(max_stream_buffer=4096), worker) as gw, relay_to(gw, Link()) as relay:
        async with h3_connect(relay.address[1]) as client:
            resp = client.start("POST", CHAT, chat_body(2000, stream=True))
            await asyncio.wait_for(resp.got_data.wait(), 10)
            relay.down_link = Link(loss=1.0)
            conn = the_connection(gw)
            for _ in range(200):
                if conn._waiters:
                    break
                await asyncio.sleep(0.01)
            assert conn._waiters
            client.cancel(resp)
            for _ in range(300):
                if gw.worker.cancels and gw.listener.in_flight == 0:
                    break
                await asyncio.sleep(0.01)
        assert gw.worker.cancels == [gw.worker.submits[0].request_id]
        assert gw.listener.in_flight == 0 and not conn._waiters
