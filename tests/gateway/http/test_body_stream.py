"""BodyStream (gateway/http/body_stream.py) without a connection: what is fed comes out in
order whatever the pieces, flow-controlled bytes are acknowledged once each (read or dropped),
the limit and failures surface from read()."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.errors import APIError
from gateway.http.body_stream import PIECE, BodyStream
from gateway.http.common import ClientDisconnected


class Recorded(BodyStream):
    """Records what it acknowledges, as H2BodyStream hands it to h2."""

    __slots__ = ("acked",)

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.acked = 0

    def _ack(self, n: int) -> None:
        self.acked += n


async def _read_all(body: BodyStream) -> bytes:
    out = bytearray()
    while chunk := await body.read():
        out += chunk
    return bytes(out)


@given(pieces=st.lists(st.tuples(st.binary(max_size=40), st.integers(min_value=0, max_value=255)), max_size=20))
def test_pieces_come_out_in_order_each_acknowledged_once(pieces: list[tuple[bytes, int]]) -> None:
    async def run() -> None:
        body = Recorded(1 << 20)
        reader = asyncio.ensure_future(_read_all(body))  # reads while the pieces arrive
        for data, pad in pieces:
            assert body.feed(data, len(data) + pad)
            await asyncio.sleep(0)
        body.end()
        assert await reader == b"".join(d for d, _ in pieces)
        assert body.acked == sum(len(d) + p for d, p in pieces)
        assert await body.read() == b""  # and stays ended

    asyncio.run(run())


async def test_past_the_limit_the_read_fails_with_413_and_held_bytes_are_acknowledged() -> None:
    body = Recorded(10)
    assert body.feed(b"12345", 5)
    assert not body.feed(b"678901", 6)
    assert not body.open and body.acked == 11  # nothing will read them: handed back
    with pytest.raises(APIError) as e:
        await body.read()
    assert e.value.status == 413


async def test_a_failure_wakes_a_waiting_reader() -> None:
    body = Recorded(100)
    reader = asyncio.ensure_future(body.read())
    await asyncio.sleep(0)
    body.fail(ClientDisconnected("reset"))
    with pytest.raises(ClientDisconnected):
        await asyncio.wait_for(reader, 1)
    body.fail(RuntimeError("later"))  # the first error wins
    with pytest.raises(ClientDisconnected):
        await body.read()


async def test_small_pieces_are_held_joined() -> None:
    """A byte a piece, or padding only: held as a few pieces of up to PIECE bytes, not one each."""
    body = Recorded(1 << 20)
    for _ in range(3 * PIECE):
        assert body.feed(b"x", 2)
    assert body.feed(b"", 7)
    assert len(body._pieces) == 3
    body.end()
    got = [await body.read() for _ in range(3)]
    assert [len(g) for g in got] == [PIECE] * 3 and all(type(g) is bytes for g in got)
    assert await body.read() == b"" and body.acked == 6 * PIECE + 7
