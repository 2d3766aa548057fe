"""Length-prefixed message framing: hand-made bytes, any split, the size limit."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.grpc.framing import Frame, FrameDecoder, FrameTooLarge, encode_frame

frames_st = st.lists(st.tuples(st.sampled_from([0, 1, 0x80, 0x81]), st.binary(max_size=300)), max_size=8)


def test_frame_layout_is_flags_then_big_endian_length() -> None:
    assert encode_frame(0, b"hi") == b"\x00\x00\x00\x00\x02hi"
    assert encode_frame(0x81, b"x" * 258) == b"\x81\x00\x00\x01\x02" + b"x" * 258


def test_decoder_whole_and_byte_at_a_time() -> None:
    body = b"\x00\x00\x00\x00\x03abc" + b"\x01\x00\x00\x00\x00" + b"\x00\x00\x00\x00\x01z"
    expected = [Frame(0, b"abc"), Frame(1, b""), Frame(0, b"z")]
    assert FrameDecoder(100).feed(body) == expected
    dec = FrameDecoder(100)
    got = [f for i in range(len(body)) for f in dec.feed(body[i:i + 1])]
    assert got == expected and dec.pending == 0


def test_partial_frame_is_pending() -> None:
    dec = FrameDecoder(100)
    assert dec.feed(b"\x00\x00\x00\x00\x05ab") == []
    assert dec.pending == 7


def test_length_above_limit_raises_before_the_payload_arrives() -> None:
    assert FrameDecoder(4).feed(b"\x00\x00\x00\x00\x04abcd") == [Frame(0, b"abcd")]
    with pytest.raises(FrameTooLarge) as info:
        FrameDecoder(4).feed(b"\x00\x00\x00\x00\x05")
    assert (info.value.length, info.value.limit) == (5, 4)


@given(frames_st, st.data())
def test_any_split_gives_the_same_frames(frames: list[tuple[int, bytes]], data: st.DataObject) -> None:
    body = b"".join(encode_frame(f, p) for f, p in frames)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(body)), max_size=10)))
    dec = FrameDecoder(1000)
    got = []
    for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True):
        got += dec.feed(body[a:b])
    assert got == [Frame(f, p) for f, p in frames]
    assert dec.pending == 0
