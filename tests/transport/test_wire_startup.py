"""HELLO field 15 (#35): a worker's start-up phases, byte for byte; an older peer's HELLO (no field 15)
reads as "not told", and an older decoder, which reads fields up to 14, ignores it."""

from __future__ import annotations

import struct

import msgpack
import pytest

from transport.errors import WireError
from transport.messages import Hello
from transport.wire import FrameDecoder, FrameEncoder, FrameType

from .test_wire import frame, mp

CAPACITY = [8, 64, 16, 1024, "tiny", ""]  # fields 7..12


def test_startup_phases_are_field_15_as_three_doubles() -> None:
    hello = Hello(role="worker", identity="w", models=("tiny",), max_batch=8, kv_blocks=64, block_size=16,
                  max_model_len=1024, model_id="tiny", kv_epoch=3, startup=(1.5, 20.25, 0.125))
    data = FrameEncoder().encode(hello)
    body = data[12:]
    assert data[:12] == struct.pack("<BBHII", 1, FrameType.HELLO, 0, 0, len(body))
    items = msgpack.unpackb(body)
    assert len(items) == 16 and items[14] == 3
    # the list's msgpack bytes: fixarray of 3, each a float 64 (0xcb) big-endian
    assert body.endswith(b"\x93" + b"".join(b"\xcb" + struct.pack(">d", x) for x in (1.5, 20.25, 0.125)))
    (out,) = FrameDecoder().feed(data)
    assert out == hello


def test_a_hello_without_phases_says_not_told() -> None:
    body = FrameEncoder().encode(Hello(role="worker", models=("m",)))[12:]
    assert body.endswith(b"\x00\x90")  # kv_epoch 0, then an empty list
    older = [1, "worker", "w", ["tiny"], [], 256, 1 << 24, *CAPACITY, b"", 7]  # up to field 14
    (old,) = FrameDecoder().feed(frame(FrameType.HELLO, mp(older)))
    assert old.startup == () and old.kv_epoch == 7


def test_an_older_decoder_reads_the_fields_it_knows() -> None:
    """What a decoder of fields 0..14 does with our HELLO: the same values, field 15 unread."""
    hello = Hello(role="worker", models=("m",), max_batch=4, kv_blocks=9, block_size=16, max_model_len=64,
                  model_id="m", kv_epoch=11, startup=(0.5, 0.0, 0.25))
    items = msgpack.unpackb(FrameEncoder().encode(hello)[12:])
    trimmed = FrameEncoder().encode(Hello(role="worker", models=("m",), max_batch=4, kv_blocks=9, block_size=16,
                                          max_model_len=64, model_id="m", kv_epoch=11))
    assert items[:15] == msgpack.unpackb(trimmed[12:])[:15]


@pytest.mark.parametrize("bad", [[1.0], [1.0, 2.0], [1.0, 2.0, -0.5], [1.0, "x", 2.0], [float("nan"), 0, 0],
                                 [float("inf"), 0, 0], "1,2,3", None])
def test_a_bad_field_15_is_a_protocol_error(bad: object) -> None:
    fields = [1, "worker", "w", ["tiny"], [], 256, 1 << 24, *CAPACITY, b"", 0, bad]
    with pytest.raises(WireError, match="field 15"):
        FrameDecoder().feed(frame(FrameType.HELLO, mp(fields)))
