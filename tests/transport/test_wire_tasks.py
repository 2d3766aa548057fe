"""SUBMIT field 11, the task (#31: embeddings, tokenize, detokenize, echo): its exact bytes, round trips
in any split, an older gateway's SUBMIT read as a generation, an older worker ignoring it, and a bad
one (or one breaking the task rules) failing its request alone."""

from __future__ import annotations

import struct
from dataclasses import replace

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from transport.messages import Continuation, Pooling, SamplingParams, Submit, Task
from transport.wire import FrameDecoder, FrameEncoder, FrameType, SubmitRejected

from .test_wire import GOOD_PARAMS, frame, mp
from .test_wire_continuation import round_trip_split

TODAY = ["m", GOOD_PARAMS, "p", None, None, 0, 0, None, True, False]  # a gateway from before field 10


def decode(data: bytes) -> Submit | SubmitRejected:
    (out,) = FrameDecoder().feed(data)
    assert isinstance(out, Submit | SubmitRejected)
    return out


def test_the_field_is_the_twelfth_element_and_its_bytes_are_exact() -> None:
    sub = Submit(7, "m", SamplingParams(), prompt="p", buffered=True, task=Task.EMBED, pooling=Pooling.LAST)
    data = FrameEncoder().encode(sub)
    body = data[12:]
    assert data[:12] == struct.pack("<BBHII", 1, FrameType.SUBMIT, 0, 7, len(body))
    assert body[0] == 0x9C  # a fixarray of 12
    assert body.endswith(b"\xc0" + b"\x93\x01\x01\xc2")  # field 10 nil, then [1, 1, false]
    assert body == mp([*TODAY[:9], True, None, [1, 1, False]])
    assert decode(data) == sub


def test_echo_after_a_continuation() -> None:
    sub = Submit(2, "m", SamplingParams(logprobs=True, top_logprobs=3), prompt="p", echo=True,
                 continuation=Continuation((5,), 1))
    data = FrameEncoder().encode(sub)
    assert data[12] == 0x9C and data.endswith(b"\x93\x00\x00\xc3")
    assert decode(data) == sub


def test_a_generation_without_echo_sends_no_field_11() -> None:
    data = FrameEncoder().encode(Submit(1, "m", SamplingParams(), prompt="p"))
    assert data[12:] == mp(TODAY)


@pytest.mark.parametrize("fields", [TODAY, [*TODAY, None]], ids=["no field 10", "nil field 10"])
def test_an_older_gateways_submit_is_a_generation(fields: list[object]) -> None:
    out = decode(frame(FrameType.SUBMIT, mp(fields), rid=1))
    assert isinstance(out, Submit) and (out.task, out.pooling, out.echo) == (Task.GENERATE, Pooling.MEAN, False)


def test_an_older_worker_ignores_it() -> None:
    """Extra trailing elements are ignored (why a gateway sends tasks only to a worker listing "tasks")."""
    body = mp([*TODAY[:9], True, None, [2, 0, False], "a later field"])
    out = decode(frame(FrameType.SUBMIT, body, rid=1))
    assert isinstance(out, Submit) and out.task == Task.TOKENIZE


@pytest.mark.parametrize("buffered, bad", [
    (True, [4, 0, False]),  # unknown task
    (True, [1, 2, False]),  # unknown pooling
    (True, [1, 0]),  # too short
    (True, [1, 0, 1]),  # echo not a bool
    (False, [1, 0, False]),  # a task that is not buffered
    (True, [0, 0, True]),  # echo on a buffered stream
    (False, [2, 0, True]),  # echo on a task
    (True, [3, 0, False]),  # detokenize without token ids
    (True, "embed"),  # not a list
])
def test_a_bad_task_fails_its_request_alone(buffered: bool, bad: object) -> None:
    dec = FrameDecoder()
    out = dec.feed(frame(FrameType.SUBMIT, mp([*TODAY[:9], buffered, None, bad]), rid=3)
                   + frame(FrameType.SUBMIT, mp(TODAY), rid=4))
    assert isinstance(out[0], SubmitRejected) and "SUBMIT" in out[0].reason
    assert isinstance(out[1], Submit)  # the connection carries on


@pytest.mark.parametrize("sub", [
    Submit(1, "m", prompt="p", task=Task.EMBED),  # not buffered
    Submit(1, "m", prompt="p", buffered=True, echo=True),
    Submit(1, "m", prompt="p", buffered=True, task=Task.DETOKENIZE),
])
def test_the_encoder_refuses_what_the_decoder_would(sub: Submit) -> None:
    with pytest.raises(ValueError):
        FrameEncoder().encode(sub)


_SUBMITS = st.one_of(
    st.builds(lambda p: Submit(1, "m", prompt=p, buffered=True, task=Task.EMBED, pooling=Pooling.MEAN), st.text()),
    st.builds(lambda ids: Submit(1, "m", prompt_token_ids=tuple(ids), buffered=True, task=Task.DETOKENIZE),
              st.lists(st.integers(0, 2**32 - 1), max_size=50)),
    st.builds(lambda p: Submit(1, "m", prompt=p, buffered=True, task=Task.TOKENIZE), st.text()),
    st.builds(lambda k: Submit(1, "m", SamplingParams(logprobs=True, top_logprobs=k), prompt="x", echo=True),
              st.integers(0, 20)),
)


@given(subs=st.lists(_SUBMITS, min_size=1, max_size=4), cuts=st.lists(st.integers(0, 4000), max_size=4))
def test_round_trip_in_any_split(subs: list[Submit], cuts: list[int]) -> None:
    subs = [replace(s, request_id=i + 1) for i, s in enumerate(subs)]
    assert round_trip_split(subs, cuts) == subs


def test_msgpack_reads_what_the_spec_says() -> None:
    data = FrameEncoder().encode(Submit(1, "m", prompt_token_ids=(65,), buffered=True, task=Task.DETOKENIZE))
    fields = msgpack.unpackb(data[12:])
    assert len(fields) == 12 and fields[10] is None and fields[11] == [3, 0, False]
