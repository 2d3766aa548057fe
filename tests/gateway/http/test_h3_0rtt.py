"""Resumption, 0-RTT and replay protection over HTTP/3, seen from aioquic's client."""

from __future__ import annotations

import asyncio

import pytest
from aioquic.tls import SessionTicket

from gateway.http.quic_settings import DEFAULT_EARLY_DATA_ROUTES, QuicSettings
from tests.gateway.http.h3_client import Gateway, H3Response, chat_body, h3_connect, h3_gateway
from tests.netrelay import Link, UdpRelay

pytestmark = pytest.mark.timeout(30)

CHAT = "/v1/chat/completions"
JSON = [(b"content-type", b"application/json")]
GENERATION_SAFE = QuicSettings()  # generation runs from 0-RTT by default (#33)
SAFE_ONLY = QuicSettings(early_data_routes=[r for r in DEFAULT_EARLY_DATA_ROUTES if not r.startswith("POST ")])


async def ticket_from(gw: Gateway) -> SessionTicket:
    """A full handshake that leaves the client with a session ticket."""
    tickets: list[SessionTicket] = []
    async with h3_connect(gw.port, tickets=tickets) as client:
        await client.request("GET", "/healthz")
        for _ in range(100):
            if tickets:
                break
            await asyncio.sleep(0.01)
    assert tickets, "the server sent no session ticket"
    return tickets[-1]


async def early(gw: Gateway, ticket: SessionTicket, method: str, path: str, body: bytes = b"") -> tuple[H3Response, bool | None]:
    """Send one request in 0-RTT on a resumed connection; (response, 0-RTT accepted per the client)."""
    async with h3_connect(gw.port, ticket=ticket, wait_connected=False) as client:
        resp = client.start(method, path, body, JSON if body else None)
        await asyncio.wait_for(resp.done.wait(), 10)
        return resp, client.early_data_accepted


async def test_resumed_connection_serves_a_safe_request_from_0rtt(cert: tuple[str, str]) -> None:
    async with h3_gateway(cert) as gw:
        ticket = await ticket_from(gw)
        assert ticket.max_early_data_size is not None  # the ticket allows 0-RTT
        resp, accepted = await early(gw, ticket, "GET", "/v1/models")
        assert accepted is True
        assert resp.status == 200 and resp.json()["data"][0]["id"] == "tiny"
        assert gw.seen[-1].early_data is True and gw.seen[-1].path == "/v1/models"
        assert gw.listener.tickets.resumed == 1


async def test_generation_in_0rtt_is_too_early_where_not_listed(cert: tuple[str, str]) -> None:
    async with h3_gateway(cert, SAFE_ONLY) as gw:
        resp, accepted = await early(gw, await ticket_from(gw), "POST", CHAT, chat_body(4))
        assert accepted is True
        assert resp.status == 425 and resp.json()["error"]["code"] == "too_early"
        assert gw.worker.submits == []
        # the client repeats it after the handshake (RFC 8470 5.2): now it runs, once
        async with h3_connect(gw.port) as client:
            again = await client.request("POST", CHAT, chat_body(4), JSON)
        assert again.status == 200 and len(gw.worker.submits) == 1
        assert gw.seen[-1].early_data is False


async def test_generation_in_0rtt_runs_by_default(cert: tuple[str, str]) -> None:
    async with h3_gateway(cert, GENERATION_SAFE) as gw:
        resp, accepted = await early(gw, await ticket_from(gw), "POST", CHAT, chat_body(4))
        assert accepted is True and resp.status == 200
        assert resp.json()["choices"][0]["message"]["content"] == "abcd"
        assert len(gw.worker.submits) == 1 and gw.seen[-1].early_data is True


@pytest.mark.parametrize("settings", [QuicSettings(replay_protection=False), QuicSettings(max_early_data=0)],
                         ids=["replay-protection-off", "no-early-data-budget"])
async def test_early_requests_refused(cert: tuple[str, str], settings: QuicSettings) -> None:
    async with h3_gateway(cert, settings) as gw:
        resp, accepted = await early(gw, await ticket_from(gw), "GET", "/v1/models")
        assert accepted is True and resp.status == 425
        assert gw.listener.state.early_refused == 1


async def test_a_ticket_carries_0rtt_once(cert: tuple[str, str]) -> None:
    async with h3_gateway(cert) as gw:
        ticket = await ticket_from(gw)
        first, accepted = await early(gw, ticket, "GET", "/healthz")
        assert accepted is True and first.status == 200
        second, accepted = await early(gw, ticket, "GET", "/healthz")
        assert accepted is False  # full handshake; the request still gets its answer
        assert second.status == 200 and gw.seen[-1].early_data is False
        assert gw.listener.tickets.refused == 1


@pytest.mark.parametrize("settings", [GENERATION_SAFE, QuicSettings(replay_protection=False)],
                         ids=["single-use-ticket", "protection-off-425"])
async def test_replayed_0rtt_flight_runs_once(cert: tuple[str, str], settings: QuicSettings) -> None:
    """An attacker captures the client's datagrams (Initial + 0-RTT) and sends them again from
    its own socket: while the connection lives, and after it is gone. The worker sees one request
    (with protection off, none: the early request was never allowed)."""
    loop = asyncio.get_running_loop()
    async with h3_gateway(cert, settings) as gw:
        ticket = await ticket_from(gw)
        relay = await UdpRelay.start(("127.0.0.1", gw.port), Link())
        relay.record = []
        try:
            async with h3_connect(relay.address[1], ticket=ticket, wait_connected=False) as client:
                resp = client.start("POST", CHAT, chat_body(4), JSON)
                await asyncio.wait_for(resp.done.wait(), 10)
                assert client.early_data_accepted is True
                flight = list(relay.record)
                executed = len(gw.worker.submits)
                assert executed == (1 if settings.replay_protection else 0)
                assert resp.status == (200 if executed else 425)
                attacker, _ = await loop.create_datagram_endpoint(asyncio.DatagramProtocol,
                                                                  local_addr=("127.0.0.1", 0))
                for d in flight:  # the connection is still open
                    attacker.sendto(d, ("127.0.0.1", gw.port))
                await asyncio.sleep(0.3)
        finally:
            relay.close()
        for _ in range(300):  # the server forgets the closed connection (after its drain period)
            if gw.listener.connections == 0:
                break
            await asyncio.sleep(0.01)
        assert gw.listener.connections == 0
        presented = gw.listener.tickets.resumed + gw.listener.tickets.refused
        for d in flight:  # a fresh connection from the replayed Initial
            attacker.sendto(d, ("127.0.0.1", gw.port))
        await asyncio.sleep(0.5)
        attacker.close()
        assert gw.listener.tickets.resumed + gw.listener.tickets.refused == presented + 1  # it was tried
        assert len(gw.worker.submits) == executed
        if settings.replay_protection:
            assert gw.listener.tickets.refused == 1  # the ticket had been used
