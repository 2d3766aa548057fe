"""The callback -> awaitable bridge (Generation) and proto -> GenerateSpec conversion."""

from __future__ import annotations

import asyncio

import pytest

from gateway.errors import APIError
from gateway.grpc.backend import CANCELLED, Finished, GenerateSpec, Generation, OnDelta, OnEnd
from gateway.grpc.convert import spec_from
from gateway.grpc.quicserve.v1 import quicserve_pb2 as pb
from transport.messages import FinishReason


class _Manual:
    """A backend double the test drives by hand: it keeps the callbacks and counts cancels."""

    def __init__(self, end_at_once: APIError | None = None) -> None:
        self.on_delta: OnDelta = lambda _t: None
        self.on_end: OnEnd = lambda _o: None
        self.cancels = 0
        self._end_at_once = end_at_once

    def models(self) -> list[str]:
        return []

    def generate(self, spec: GenerateSpec, on_delta: OnDelta, on_end: OnEnd) -> _Manual:
        self.on_delta, self.on_end = on_delta, on_end
        if self._end_at_once is not None:
            on_end(self._end_at_once)
        return self

    def cancel(self) -> None:
        self.cancels += 1


async def test_deltas_waiting_together_come_out_as_one_piece() -> None:
    b = _Manual()
    gen = Generation(b, GenerateSpec("m", prompt="p"))
    b.on_delta("a")
    b.on_delta("")
    b.on_delta("b")
    assert await gen.next() == ("ab", None)
    waiter = asyncio.ensure_future(gen.next())
    await asyncio.sleep(0)
    assert not waiter.done()  # nothing new: it waits
    b.on_delta("c")
    b.on_end(Finished(FinishReason.STOP, 1, 3))
    assert await waiter == ("c", Finished(FinishReason.STOP, 1, 3))


async def test_an_end_before_generate_returns_is_kept() -> None:
    err = APIError(429, "slow down")
    gen = Generation(_Manual(end_at_once=err), GenerateSpec("m", prompt="p"))
    assert await gen.next() == ("", err)


async def test_cancel_ends_it_once_and_later_callbacks_are_ignored() -> None:
    b = _Manual()
    gen = Generation(b, GenerateSpec("m", prompt="p"))
    b.on_delta("lost")
    gen.cancel()
    gen.cancel()
    b.on_delta("late")
    b.on_end(Finished(FinishReason.STOP, 1, 1))
    assert b.cancels == 1
    assert await gen.next() == ("", CANCELLED)


async def test_cancel_after_the_end_does_not_reach_the_backend() -> None:
    b = _Manual()
    gen = Generation(b, GenerateSpec("m", prompt="p"))
    b.on_end(Finished(FinishReason.LENGTH, 1, 1))
    gen.cancel()
    assert b.cancels == 0 and gen.outcome == Finished(FinishReason.LENGTH, 1, 1)


async def test_a_finish_as_cancelled_is_the_cancelled_error() -> None:
    b = _Manual()
    gen = Generation(b, GenerateSpec("m", prompt="p"))
    b.on_end(Finished(FinishReason.CANCELLED, 1, 0))
    assert await gen.next() == ("", CANCELLED)


def test_unset_sampling_fields_are_none_and_zero_values_are_kept() -> None:
    spec = spec_from(pb.GenerateRequest(model="m", prompt="p"), None)
    assert (spec.max_tokens, spec.temperature, spec.top_p, spec.seed, spec.stop) == (None, None, None, None, ())
    spec = spec_from(pb.GenerateRequest(model="m", prompt="p", sampling=pb.Sampling(
        max_tokens=0, temperature=0.0, top_p=0.25, seed=0)), 12.5, (("authorization", "Bearer k"),))
    assert (spec.max_tokens, spec.temperature, spec.top_p, spec.seed, spec.deadline) == (0, 0.0, 0.25, 0, 12.5)
    assert spec.metadata == (("authorization", "Bearer k"),)


def test_a_request_without_input_is_a_400() -> None:
    with pytest.raises(APIError) as info:
        spec_from(pb.GenerateRequest(model="m"), None)
    assert info.value.status == 400
