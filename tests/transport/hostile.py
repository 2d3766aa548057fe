"""Hostile peers' bytes: frames of every type with random lengths, flags, request ids and bodies
(structured msgpack, packed token arrays, mutated valid frames, lying lengths, oversize headers),
and plain random bytes.

One generator, two sources of choices: :class:`HypothesisDraw` (a Hypothesis test's ``data``,
so failures shrink) and :class:`RandomDraw` (a seeded :class:`random.Random`, for the long fuzz
runs of ``tests/transport/fuzz_transport.py``).
"""

from __future__ import annotations

import asyncio
import random
import struct
from collections.abc import Callable
from typing import Any, Protocol

import msgpack
from hypothesis import strategies as st

from transport.messages import (
    Cancel,
    Credit,
    Error,
    ErrorCode,
    Finish,
    FinishReason,
    Goodbye,
    Hello,
    Ping,
    Pong,
    SamplingParams,
    Stats,
    Submit,
)
from transport.wire import DEFAULT_MAX_FRAME, HEADER, FrameEncoder, FrameType
from transport.wire_tokens import StreamOptions

__all__ = ["Draw", "HypothesisDraw", "RandomDraw", "hostile_stream", "gateway_hello", "worker_hello",
           "send_to_worker", "hostile_worker"]

TYPES = [int(t) for t in FrameType]
_NO_OPTIONS = StreamOptions(False, 0)


class Draw(Protocol):
    def integer(self, lo: int, hi: int) -> int: ...

    def binary(self, max_size: int) -> bytes: ...


class RandomDraw:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def binary(self, max_size: int) -> bytes:
        return self.rng.randbytes(self.rng.randint(0, max_size))


class HypothesisDraw:
    def __init__(self, data: st.DataObject) -> None:
        self.data = data

    def integer(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))

    def binary(self, max_size: int) -> bytes:
        return self.data.draw(st.binary(max_size=max_size))


def gateway_hello() -> bytes:
    return FrameEncoder().encode(Hello(role="gateway", identity="hostile"))


def worker_hello() -> bytes:
    return FrameEncoder().encode(Hello(role="worker", identity="hostile", models=("tiny",)))


def _obj(d: Draw, depth: int = 0) -> Any:
    """A random msgpack value: what a control frame's body decodes to."""
    k = d.integer(0, 9 if depth < 2 else 6)
    if k == 0:
        return None
    if k == 1:
        return bool(d.integer(0, 1))
    if k == 2:
        return d.integer(-(1 << 63), (1 << 64) - 1)
    if k == 3:
        return d.integer(-3, 300)
    if k == 4:
        return float(d.integer(-5, 5)) / 3
    if k == 5:
        return d.binary(40).decode("latin-1")
    if k == 6:
        return d.binary(40)
    if k == 7 or k == 8:
        return [_obj(d, depth + 1) for _ in range(d.integer(0, 14))]
    return {str(d.integer(0, 9)): _obj(d, depth + 1) for _ in range(d.integer(0, 3))}


def _valid(d: Draw, enc: FrameEncoder) -> bytes:
    """A well-formed frame (which side may send it is not considered)."""
    rid = d.integer(1, 8)
    k = d.integer(0, 10)
    msg: Any
    if k == 0:
        msg = Submit(rid, "tiny", SamplingParams(max_tokens=d.integer(0, 40)), prompt="x")
        enc.streams.close(rid)  # reuse: the encoder would otherwise refuse an open rid
    elif k == 1:
        msg = Cancel(rid)
    elif k == 2:
        msg = Credit(rid, d.integer(1, 1 << 20))
    elif k == 3:
        msg = Ping(d.integer(0, (1 << 64) - 1))
    elif k == 4:
        msg = Pong(d.integer(0, (1 << 64) - 1))
    elif k == 5:
        msg = Stats(d.integer(0, 9), d.integer(0, 9), 1, 2, 0.5, (1, 2, 3), 9.0)
    elif k == 6:
        msg = Goodbye("bye")
    elif k == 7:
        enc.streams.open(rid, _NO_OPTIONS)  # the encoder ends only open streams
        msg = Finish(rid, FinishReason.STOP, 1, 1)
    elif k == 8:
        enc.streams.open(rid, _NO_OPTIONS)
        msg = Error(rid, ErrorCode.INTERNAL, "x")
    elif k == 9:
        msg = Hello(role="gateway" if d.integer(0, 1) else "worker")
    else:
        return _tokens(d, rid)
    return enc.encode(msg)


def _tokens(d: Draw, rid: int) -> bytes:
    """A TOKENS frame with plausible but random flags and arrays."""
    n = d.integer(0, 4)
    flags = d.integer(0, (1 << 11) - 1)
    body = struct.pack("<I", n) + b"".join(struct.pack("<I", d.integer(0, 9)) for _ in range(3 * n))
    body += d.binary(24)
    return HEADER.pack(1, FrameType.TOKENS, flags, 0, len(body)) + body


def _frame(d: Draw, enc: FrameEncoder, max_frame: int) -> bytes:
    k = d.integer(0, 9)
    if k <= 2:
        return _valid(d, enc)
    if k == 3:  # a valid frame with bytes flipped, cut or added
        f = bytearray(_valid(d, enc))
        for _ in range(d.integer(1, 3)):
            f[d.integer(0, len(f) - 1)] = d.integer(0, 255)
        if d.integer(0, 3) == 0:
            del f[d.integer(0, len(f)) :]
        return bytes(f) + d.binary(4)
    if k == 4 or k == 5:  # a frame type with a structured body of random fields
        body = msgpack.packb(_obj(d), use_bin_type=True) if d.integer(0, 3) else d.binary(64)
        ftype = TYPES[d.integer(0, len(TYPES) - 1)] if d.integer(0, 7) else d.integer(0, 255)
        flags = 0 if d.integer(0, 3) else d.integer(0, 0xFFFF)
        rid = (0, 1, d.integer(0, 0xFFFF_FFFF))[d.integer(0, 2)]
        length = len(body) if d.integer(0, 3) else d.integer(0, len(body) + 64)
        return HEADER.pack(1 if d.integer(0, 7) else d.integer(0, 255), ftype, flags, rid, length) + body
    if k == 6:
        return _tokens(d, 1)
    if k == 7:  # a length past the limit, or right at it (whose body never comes)
        length = (max_frame + d.integer(1, 1 << 20)) if d.integer(0, 1) else max_frame
        return HEADER.pack(1, TYPES[d.integer(0, len(TYPES) - 1)], 0, 0, min(length, 0xFFFF_FFFF))
    return d.binary(48)


def hostile_stream(d: Draw, frames: int, hello: bytes | None, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    """``frames`` hostile frames, after ``hello`` (a valid HELLO, so that later decoders are reached)."""
    enc = FrameEncoder()
    out = [hello] if hello else []
    out += [_frame(d, enc, max_frame) for _ in range(frames)]
    return b"".join(out)


async def send_to_worker(host: str, port: int, data: bytes, wait: float) -> bool:
    """Connect as a hostile gateway and send ``data``; True if the worker closed the connection within
    ``wait`` seconds (what it sent back, its ERROR, is read and dropped)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(data)
        async with asyncio.timeout(wait):
            while await reader.read(1 << 16):
                pass
        return True
    except (TimeoutError, ConnectionError):
        return False
    finally:
        writer.close()


async def hostile_worker(next_data: Callable[[], bytes]) -> tuple[asyncio.Server, str]:
    """A listening hostile worker: each connection gets ``next_data()`` (a HELLO and a burst, say),
    then the end. Returns the server and its URL."""

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(next_data())
        writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    return server, f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}"
