"""SUBMIT params' optional group (10..17: penalties, logit_bias, min_tokens, structured output,
tools): carried only when set, round-tripped exactly, all or none."""

from __future__ import annotations

import msgpack
import pytest

from transport.messages import SamplingParams, Submit
from transport.wire import FrameDecoder, FrameEncoder, SubmitRejected
from transport.wire_control import submit_fields

EXTENDED = SamplingParams(
    max_tokens=8, presence_penalty=0.5, frequency_penalty=-1.25, repetition_penalty=1.1,
    logit_bias=((5, -100.0), (70000, 2.5)), min_tokens=3, guide_kind="json",
    guide='{"type": "object"}', tools='[{"type": "function", "function": {"name": "f"}}]',
)


def roundtrip(params: SamplingParams) -> SamplingParams:
    (out,) = FrameDecoder().feed(FrameEncoder().encode(Submit(1, "m", params, prompt="p")))
    assert isinstance(out, Submit)
    return out.params


@pytest.mark.parametrize("changes", [
    {}, {"presence_penalty": 0.5}, {"frequency_penalty": 2.0}, {"repetition_penalty": 0.9},
    {"logit_bias": ((1, 1.0),)}, {"min_tokens": 4}, {"guide_kind": "regex", "guide": "a+"}, {"tools": "[]"},
])
def test_each_setting_round_trips(changes: dict[str, object]) -> None:
    p = SamplingParams(**changes)  # type: ignore[arg-type]
    assert roundtrip(p) == p
    assert roundtrip(EXTENDED) == EXTENDED


def test_a_request_without_them_sends_the_ten_fields_it_always_did() -> None:
    assert not SamplingParams(temperature=0.5, logprobs=True).extended
    assert len(submit_fields(Submit(1, "m", SamplingParams(), prompt="p"))[1]) == 10  # type: ignore[arg-type]
    assert len(submit_fields(Submit(1, "m", EXTENDED, prompt="p"))[1]) == 18  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [
    [0.0],  # a partial group
    [0.0, 0.0, 1.0, [[1]], 0, "", "", ""],  # a bias without its value
    [0.0, 0.0, 1.0, [[-1, 1.0]], 0, "", "", ""],  # a negative token id
    [0.0, 0.0, 1.0, [], -1, "", "", ""],  # negative min_tokens
    [0.0, 0.0, 1.0, [], 0, 5, "", ""],  # a guide kind that is not a string
])
def test_a_bad_group_fails_its_request_alone(bad: list[object]) -> None:
    from transport.wire import FrameType

    from .test_wire import GOOD_PARAMS, frame

    body = msgpack.packb(["m", [*GOOD_PARAMS, *bad], "p", None, None, 0, 0, None, True], use_bin_type=True)
    (out,) = FrameDecoder().feed(frame(FrameType.SUBMIT, body, rid=3))
    assert isinstance(out, SubmitRejected) and "SUBMIT params" in out.reason
