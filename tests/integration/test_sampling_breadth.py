"""Penalties, logit_bias, min_tokens and seed through the real thing: `quicserve serve --engine jax` (the
tiny random-weight model, byte tokens: 'A' is 65, eos 257) and the official openai SDK, sync and async,
streamed and not. Each parameter shows its effect; a seeded request's text does not depend on the
batch around it. gRPC (grpcio, sync and asyncio) gets the same settings in ``Sampling``."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import grpc
import openai
import pytest

from gateway.grpc.quicserve.v1 import quicserve_pb2 as pb
from tests.integration.conftest import GRPC_AUTH, KEY
from tests.integration.test_gateway_e2e import Gateway

pytest.importorskip("jax")

MODES = ["sync", "sync-stream", "async", "async-stream"]
PROMPT = "The cat sat on the"


@pytest.fixture(scope="module")
def gw(jax_gateway: Gateway) -> Gateway:
    """The session's one JAX gateway (conftest.py): API keys on, every client sends KEY."""
    return jax_gateway


def _kwargs(kw: dict[str, Any], stream: bool) -> dict[str, Any]:
    out = {"model": "tiny", **kw}
    if stream:
        out |= {"stream": True, "stream_options": {"include_usage": True}}
    return out


def complete(gw: Gateway, mode: str, **kw: Any) -> tuple[str, str, int]:
    """One completion in ``mode``: (text, finish_reason, completion_tokens)."""
    stream = mode.endswith("stream")
    if mode.startswith("async"):
        return asyncio.run(_complete_async(gw, stream, kw))
    with openai.OpenAI(base_url=gw.http + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        if not stream:
            r = c.completions.create(**_kwargs(kw, False))
            assert r.usage is not None
            return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
        text, reason, used = "", "", -1
        for chunk in c.completions.create(**_kwargs(kw, True)):
            for ch in chunk.choices:
                text += ch.text
                reason = ch.finish_reason or reason
            if chunk.usage is not None:
                used = chunk.usage.completion_tokens
        return text, reason, used


async def _complete_async(gw: Gateway, stream: bool, kw: dict[str, Any]) -> tuple[str, str, int]:
    c = openai.AsyncOpenAI(base_url=gw.http + "/v1", api_key=KEY, max_retries=0, timeout=120)
    try:
        if not stream:
            r = await c.completions.create(**_kwargs(kw, False))
            assert r.usage is not None
            return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
        text, reason, used = "", "", -1
        async for chunk in await c.completions.create(**_kwargs(kw, True)):
            for ch in chunk.choices:
                text += ch.text
                reason = ch.finish_reason or reason
            if chunk.usage is not None:
                used = chunk.usage.completion_tokens
        return text, reason, used
    finally:
        await c.close()


@pytest.mark.parametrize("mode", MODES)
def test_logit_bias_plus_100_forces_a_token(gw: Gateway, mode: str) -> None:
    text, reason, used = complete(gw, mode, prompt=PROMPT, max_tokens=12, temperature=1.0, logit_bias={"65": 100})
    assert (text, reason, used) == ("A" * 12, "length", 12)


@pytest.mark.parametrize("mode", MODES)
def test_logit_bias_minus_100_bans_what_greedy_picked(gw: Gateway, mode: str) -> None:
    plain, *_ = complete(gw, mode, prompt=PROMPT, max_tokens=16, temperature=0)
    ban = {str(b): -100 for b in set(plain.encode("latin-1", "replace")) if b < 256}
    text, *_ = complete(gw, mode, prompt=PROMPT, max_tokens=16, temperature=0, logit_bias=ban)
    assert not set(text) & set(plain)


@pytest.mark.parametrize("mode", MODES)
def test_min_tokens_holds_the_end_back(gw: Gateway, mode: str) -> None:
    """eos at +100 ends the answer at once; min_tokens=5 makes it come after exactly five tokens."""
    ends = {"257": 100}
    assert complete(gw, mode, prompt=PROMPT, max_tokens=20, logit_bias=ends)[1:] == ("stop", 1)
    text, reason, used = complete(gw, mode, prompt=PROMPT, max_tokens=20, logit_bias=ends,
                                  extra_body={"min_tokens": 5})
    assert (reason, used) == ("stop", 6)  # five tokens, then eos (counted, not streamed)


def _distinct(gw: Gateway, mode: str, **kw: Any) -> int:
    text, reason, used = complete(gw, mode, prompt=PROMPT, max_tokens=48, temperature=0, **kw)
    assert used == 48
    return len(set(text))


@pytest.mark.parametrize("mode", MODES)
def test_penalties_reduce_repeats_against_greedy(gw: Gateway, mode: str) -> None:
    plain = _distinct(gw, mode)
    assert _distinct(gw, mode, frequency_penalty=2.0) > plain
    assert _distinct(gw, mode, presence_penalty=2.0) > plain
    assert _distinct(gw, mode, extra_body={"repetition_penalty": 5.0}) > plain


async def _chat_async(gw: Gateway, stream: bool, kw: dict[str, Any]) -> str:
    async with openai.AsyncOpenAI(base_url=gw.http + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        if stream:
            return "".join([ch.choices[0].delta.content or "" async for ch in await c.chat.completions.create(
                **kw, stream=True) if ch.choices])
        return (await c.chat.completions.create(**kw)).choices[0].message.content or ""


@pytest.mark.parametrize("mode", MODES)
def test_chat_takes_them_too(gw: Gateway, mode: str) -> None:
    kw: dict[str, Any] = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                              logit_bias={"66": 100}, presence_penalty=0.5, frequency_penalty=0.5,
                              extra_body={"repetition_penalty": 1.1, "min_tokens": 2})
    stream = mode.endswith("stream")
    if mode.startswith("async"):
        text = asyncio.run(_chat_async(gw, stream, kw))
    else:
        with openai.OpenAI(base_url=gw.http + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
            if stream:
                text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(**kw, stream=True)
                               if ch.choices)
            else:
                text = c.chat.completions.create(**kw).choices[0].message.content or ""
    assert text == "B" * 8


@pytest.mark.parametrize("mode", MODES)
def test_seed_decides_streamed_or_whole(gw: Gateway, mode: str) -> None:
    """A seeded sampled answer is the same asked any of the four ways (the sync whole one is the
    reference), and another seed gives another."""
    kw: dict[str, Any] = dict(prompt="Once upon a time", max_tokens=24, temperature=1.0, seed=77)
    ref = complete(gw, "sync", **kw)
    assert complete(gw, mode, **kw) == ref
    assert complete(gw, mode, **{**kw, "seed": 78})[0] != ref[0]


@pytest.mark.parametrize("mode", MODES)
def test_a_bias_outside_the_vocabulary_is_a_400(gw: Gateway, mode: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        complete(gw, mode, prompt=PROMPT, max_tokens=4, logit_bias={"300": 5})
    assert "vocabulary" in str(info.value)


def test_structured_output_keeps_the_last_word(gw: Gateway) -> None:
    """A bias composes with a grammar's mask: it picks among what the schema allows, and +100 on a token
    the schema forbids cannot break the JSON."""
    schema = {"type": "object", "properties": {"v": {"enum": ["AAA", "BBB", "CCC"]}}, "required": ["v"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema, "strict": True}}
    with openai.OpenAI(base_url=gw.http + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        def ask(bias: dict[str, int]) -> str:
            r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "pick"}],
                                          max_tokens=40, temperature=0, response_format=fmt,  # type: ignore[arg-type]
                                          logit_bias=bias)
            return r.choices[0].message.content or ""

        assert json.loads(ask({"67": 100})) == {"v": "CCC"}
        assert json.loads(ask({"66": 100})) == {"v": "BBB"}
        assert json.loads(ask({"90": 100}))["v"] in ("AAA", "BBB", "CCC")  # 'Z' is never allowed


async def _seeded_among_others(gw: Gateway, mine: dict[str, Any], crowd: int) -> list[str]:
    c = openai.AsyncOpenAI(base_url=gw.http + "/v1", api_key=KEY, max_retries=0, timeout=120)
    try:
        others = [c.completions.create(model="tiny", prompt=f"other prompt {i} " * (i + 1), max_tokens=20 + i,
                                       temperature=0.8, seed=i) for i in range(crowd)]
        results = await asyncio.gather(*others[: crowd // 2], c.completions.create(model="tiny", **mine),
                                       *others[crowd // 2:])
        return [r.choices[0].text for r in results]
    finally:
        await c.close()


def test_seed_gives_the_same_text_whatever_the_batch(gw: Gateway) -> None:
    """(A penalized request's batch independence is tests/inference/model/test_penalties_engine.py's: here
    it would compile the model's logits step for every batch bucket the crowd passes through.)"""
    mine = {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 1.0, "seed": 1234}
    alone = asyncio.run(_seeded_among_others(gw, mine, 0))[0]
    for _ in range(2):
        texts = asyncio.run(_seeded_among_others(gw, mine, 15))
        assert texts[15 // 2] == alone
    assert asyncio.run(_seeded_among_others(gw, {**mine, "seed": 4321}, 0))[0] != alone  # the seed decides


# --- gRPC: the same settings in quicserve.v1.Sampling ----------------------------------------------------

INFERENCE = "/quicserve.v1.Inference/"
_ser = pb.GenerateRequest.SerializeToString


def _target(gw: Gateway) -> str:
    return next(m.group(1) for line in gw.lines if (m := re.search(r"listening on grpc://(\S+)", line)))


def grpc_generate(gw: Gateway, mode: str, sampling: pb.Sampling, prompt: str = PROMPT) -> tuple[str, int, int]:
    """Generate (streamed) or Complete (whole), sync or asyncio: (text, finish reason, completion tokens)."""
    req = pb.GenerateRequest(model="tiny", prompt=prompt, sampling=sampling)
    stream = mode.endswith("stream")
    method = INFERENCE + ("Generate" if stream else "Complete")
    if mode.startswith("async"):
        async def go() -> list[pb.GenerateResponse]:
            async with grpc.aio.insecure_channel(_target(gw)) as ch:
                if stream:
                    call = ch.unary_stream(method, request_serializer=_ser,
                                           response_deserializer=pb.GenerateResponse.FromString)
                    return [r async for r in call(req, timeout=120, metadata=GRPC_AUTH)]
                one = ch.unary_unary(method, request_serializer=_ser, response_deserializer=pb.GenerateResponse.FromString)
                return [await one(req, timeout=120, metadata=GRPC_AUTH)]

        out = asyncio.run(go())
    else:
        with grpc.insecure_channel(_target(gw)) as ch:
            if stream:
                out = list(ch.unary_stream(method, request_serializer=_ser,
                                           response_deserializer=pb.GenerateResponse.FromString)(req, timeout=120,
                                                                                        metadata=GRPC_AUTH))
            else:
                out = [ch.unary_unary(method, request_serializer=_ser,
                                      response_deserializer=pb.GenerateResponse.FromString)(req, timeout=120,
                                                                                      metadata=GRPC_AUTH)]
    return "".join(r.text for r in out), out[-1].finish_reason, out[-1].usage.completion_tokens


@pytest.mark.parametrize("mode", MODES)
def test_grpc_logit_bias_and_min_tokens(gw: Gateway, mode: str) -> None:
    assert grpc_generate(gw, mode, pb.Sampling(max_tokens=10, temperature=1.0, logit_bias={65: 100})) == \
        ("A" * 10, pb.FINISH_REASON_LENGTH, 10)
    ends = pb.Sampling(max_tokens=20, logit_bias={257: 100}, min_tokens=5)
    assert grpc_generate(gw, mode, ends)[1:] == (pb.FINISH_REASON_STOP, 6)


@pytest.mark.parametrize("mode", MODES)
def test_grpc_penalties_reduce_repeats(gw: Gateway, mode: str) -> None:
    def distinct(**kw: Any) -> int:
        text, _, used = grpc_generate(gw, mode, pb.Sampling(max_tokens=48, temperature=0, **kw))
        assert used == 48
        return len(set(text))

    plain = distinct()
    assert distinct(frequency_penalty=2.0) > plain
    assert distinct(presence_penalty=2.0) > plain
    assert distinct(repetition_penalty=5.0) > plain


def test_grpc_seed_and_the_http_answer_agree(gw: Gateway) -> None:
    """One seeded request, penalised: gRPC and the OpenAI route sample the same text."""
    s = pb.Sampling(max_tokens=24, temperature=1.0, seed=99, frequency_penalty=0.5, logit_bias={101: 2.0})
    text, *_ = grpc_generate(gw, "sync", s)
    http, *_ = complete(gw, "sync", prompt=PROMPT, max_tokens=24, temperature=1.0, seed=99, frequency_penalty=0.5,
                        logit_bias={"101": 2})
    assert text == http


def test_grpc_chat_turns_take_sampling(gw: Gateway) -> None:
    turn = pb.ChatRequest(turn=pb.Turn(model="tiny", messages=[pb.Message(role="user", content="hi")],
                                       sampling=pb.Sampling(max_tokens=6, logit_bias={66: 100})))
    with grpc.insecure_channel(_target(gw)) as ch:
        chat = ch.stream_stream(INFERENCE + "Chat", request_serializer=pb.ChatRequest.SerializeToString,
                                response_deserializer=pb.ChatResponse.FromString)
        replies = list(chat(iter([turn]), timeout=120, metadata=GRPC_AUTH))
    assert "".join(r.text for r in replies) == "B" * 6 and replies[-1].usage.completion_tokens == 6


@pytest.mark.parametrize("sampling, needle", [
    (pb.Sampling(max_tokens=4, logit_bias={300: 1.0}), "vocabulary"),
    (pb.Sampling(max_tokens=4, presence_penalty=3.0), "presence_penalty"),
    (pb.Sampling(max_tokens=4, min_tokens=5), "min_tokens"),
    (pb.Sampling(max_tokens=4, repetition_penalty=0.0), "repetition_penalty"),
])
def test_grpc_bad_settings_are_invalid_argument(gw: Gateway, sampling: pb.Sampling, needle: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        grpc_generate(gw, "sync", sampling)
    err: Any = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in err.details()
