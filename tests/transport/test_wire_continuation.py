"""SUBMIT field 10, the continuation of a request resumed on a second replica (mid-stream
failover, #30): its exact bytes, round trips in any split, an older peer's SUBMIT (no field 10)
and a nil one read as "no continuation", and a bad one failing its request alone."""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from transport.messages import Continuation, SamplingParams, Submit
from transport.wire import FrameDecoder, FrameEncoder, FrameType, SubmitRejected

from .test_wire import GOOD_PARAMS, GOOD_SUBMIT, frame, mp

OLD = ["m", GOOD_PARAMS, "p", None, None, 0, 0, None, True]  # a gateway from before `buffered`
TODAY = [*OLD, False]  # ... and from before the continuation


def decode(data: bytes) -> Submit | SubmitRejected:
    (out,) = FrameDecoder().feed(data)
    assert isinstance(out, Submit | SubmitRejected)
    return out


def test_the_field_is_the_eleventh_element_and_its_bytes_are_exact() -> None:
    sub = Submit(7, "m", SamplingParams(), prompt="p", continuation=Continuation((1, 300, 2**32 - 1), 5))
    data = FrameEncoder().encode(sub)
    body = data[12:]
    assert data[:12] == struct.pack("<BBHII", 1, FrameType.SUBMIT, 0, 7, len(body))
    assert body[0] == 0x9B  # a fixarray of 11
    # field 10: a fixarray of 2, bin8 of 12 bytes (u32 LE ids), then the positive fixint 5
    tail = b"\x92\xc4\x0c" + b"\x01\x00\x00\x00" + b"\x2c\x01\x00\x00" + b"\xff\xff\xff\xff" + b"\x05"
    assert body.endswith(tail)
    assert body == mp([*TODAY, [struct.pack("<3I", 1, 300, 2**32 - 1), 5]])
    assert decode(data) == sub


def test_without_a_continuation_the_bytes_are_what_they_were() -> None:
    data = FrameEncoder().encode(Submit(1, "m", SamplingParams(), prompt="p"))
    assert data[12:] == mp(TODAY)
    assert data[12] == 0x9A


@pytest.mark.parametrize("fields", [OLD, TODAY, [*TODAY, None]], ids=["no buffered", "no field 10", "nil"])
def test_an_older_gateways_submit_is_a_new_request(fields: list[object]) -> None:
    out = decode(frame(FrameType.SUBMIT, mp(fields), rid=1))
    assert isinstance(out, Submit) and out.continuation is None


def test_an_older_worker_ignores_it() -> None:
    """What the spec promises an older peer: extra trailing elements are ignored -- which is why a
    gateway sends a continuation only to a worker that lists the capability."""
    body = mp([*TODAY, [struct.pack("<I", 9), 1], [0, 0, False], "a later field"])  # field 11: the task
    out = decode(frame(FrameType.SUBMIT, body, rid=1))
    assert isinstance(out, Submit) and out.continuation == Continuation((9,), 1)


@pytest.mark.parametrize("bad", [
    [b"\x01\x00\x00"],  # no text_bytes
    [b"\x01\x00\x00", 0],  # ids not a whole number of u32
    [[1, 2], 0],  # ids not bin
    [b"", -1],  # negative text_bytes
    [b"", 1.5],  # text_bytes not an integer
    {"ids": b""},  # not a list
])
def test_a_bad_continuation_fails_its_request_alone(bad: object) -> None:
    dec = FrameDecoder()
    out = dec.feed(frame(FrameType.SUBMIT, mp([*GOOD_SUBMIT, False, bad]), rid=3)
                   + frame(FrameType.SUBMIT, mp(TODAY), rid=4))
    assert isinstance(out[0], SubmitRejected) and "continuation" in out[0].reason
    assert isinstance(out[1], Submit)  # the connection carries on


def test_the_encoder_refuses_what_the_decoder_would() -> None:
    with pytest.raises(ValueError):
        FrameEncoder().encode(Submit(1, "m", prompt="p", continuation=Continuation((1,), -1)))
    with pytest.raises((ValueError, OverflowError)):
        FrameEncoder().encode(Submit(2, "m", prompt="p", continuation=Continuation((2**32,), 0)))


@given(ids=st.lists(st.integers(0, 2**32 - 1), max_size=300), text_bytes=st.integers(0, 2**63 - 1),
       buffered=st.booleans(), cuts=st.lists(st.integers(0, 4000), max_size=4))
def test_round_trip_in_any_split(ids: list[int], text_bytes: int, buffered: bool, cuts: list[int]) -> None:
    subs = [Submit(i + 1, "m", SamplingParams(max_tokens=64), prompt_token_ids=(1, 2), buffered=buffered,
                   continuation=Continuation(tuple(ids), text_bytes) if i % 2 else None) for i in range(3)]
    assert round_trip_split(subs, cuts) == subs


def round_trip_split(subs: list[Submit], cuts: list[int]) -> list[object]:
    """``subs`` encoded by one encoder, decoded by one decoder fed in pieces cut at ``cuts``."""
    enc = FrameEncoder()
    data = b"".join(enc.encode(s) for s in subs)
    dec = FrameDecoder()
    out: list[object] = []
    prev = 0
    for cut in sorted(c % (len(data) + 1) for c in cuts) + [len(data)]:
        out += dec.feed(data[prev:cut])
        prev = cut
    dec.close()
    return out


def test_msgpack_reads_what_the_spec_says() -> None:
    """The field as any msgpack reader sees it (a gateway in another language can build it)."""
    data = FrameEncoder().encode(Submit(1, "m", prompt="p", continuation=Continuation((65, 66), 2)))
    fields = msgpack.unpackb(data[12:])
    assert len(fields) == 11 and fields[10] == [struct.pack("<2I", 65, 66), 2]
