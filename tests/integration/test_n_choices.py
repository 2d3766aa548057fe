"""n > 1, best_of and batched prompts through the real thing: `quicserve serve --engine jax` (the tiny
random-weight model in a worker process) and the official openai SDK, sync and async, streamed and not.

What a user would notice: every choice has its own index, text and finish_reason; a streamed answer
reassembled by index equals the whole one (seeded); choice j of a prompt with ``seed`` s is what that
prompt alone gives with sub_seed(s, j) (j = 0: s itself); usage counts each prompt once and every
sequence's completion tokens (best_of's discarded ones too); best_of returns the n most likely.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from gateway.api.fan_merge import sub_seed
from tests.integration.conftest import KEY
from tests.integration.test_gateway_e2e import Gateway

pytest.importorskip("jax")

PROMPT = "The quick brown fox jumps over the lazy dog and"
MAX = 8


@pytest.fixture(scope="module")
def gw(jax_gateway: Gateway) -> Gateway:
    """The session's one JAX gateway (conftest.py): API keys on, every client sends KEY."""
    return jax_gateway


@pytest.fixture(scope="module")
def client(gw: Gateway) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=gw.http + "/v1", api_key=KEY, max_retries=0, timeout=120)
    yield c
    c.close()


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _alone(client: openai.OpenAI, prompt: Any, seed: int, j: int) -> str:
    r = client.completions.create(model=_model(client), prompt=prompt, max_tokens=MAX, seed=sub_seed(seed, j))
    return r.choices[0].text


def test_n_whole_completion_has_every_choice_and_counts_every_sequence(client: openai.OpenAI) -> None:
    model = _model(client)
    one = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX, seed=7)
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX, n=4, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    assert r.choices[0].text == one.choices[0].text  # j = 0 runs with the request's own seed
    assert r.choices[2].text == _alone(client, PROMPT, 7, 2)
    assert len({c.text for c in r.choices}) > 1  # distinct seeds, distinct samples
    assert r.usage is not None and one.usage is not None
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt once
    per = [client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX, seed=sub_seed(7, j)).usage
           for j in range(4)]
    assert r.usage.completion_tokens == sum(u.completion_tokens for u in per if u is not None)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_n_chat_streamed_reassembles_to_the_whole_answer(gw: Gateway, client: openai.OpenAI) -> None:
    model = _model(client)
    msgs: Any = [{"role": "user", "content": "Say something."}]
    whole = client.chat.completions.create(model=model, messages=msgs, max_tokens=MAX, n=3, seed=11)

    async def streamed() -> tuple[dict[int, str], dict[int, str], Any, int]:
        ac = openai.AsyncOpenAI(base_url=gw.http + "/v1", api_key=KEY, max_retries=0, timeout=120)
        texts: dict[int, str] = {}
        reasons: dict[int, str] = {}
        usage = None
        ids = set()
        try:
            stream = await ac.chat.completions.create(model=model, messages=msgs, max_tokens=MAX, n=3, seed=11,
                                                      stream=True, stream_options={"include_usage": True})
            async for chunk in stream:
                ids.add(chunk.id)
                if chunk.usage is not None:
                    usage = chunk.usage
                for c in chunk.choices:
                    texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
                    if c.finish_reason is not None:
                        reasons[c.index] = c.finish_reason
        finally:
            await ac.close()
        return texts, reasons, usage, len(ids)

    texts, reasons, usage, n_ids = asyncio.run(streamed())
    assert n_ids == 1  # one response
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert usage is not None and whole.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)


def test_best_of_returns_the_n_most_likely_and_bills_all(client: openai.OpenAI) -> None:
    model = _model(client)
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX, n=2, best_of=4, seed=3)
    assert [c.index for c in r.choices] == [0, 1] and all(c.logprobs is None for c in r.choices)
    every = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX, n=4, seed=3, logprobs=0)
    scored = sorted(every.choices, key=lambda c: -sum(c.logprobs.token_logprobs))  # type: ignore[union-attr,arg-type]
    assert [c.text for c in r.choices] == [c.text for c in scored[:2]]
    assert r.usage is not None and every.usage is not None
    assert r.usage.completion_tokens == every.usage.completion_tokens  # all four billed
    with_lp = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX, n=1, best_of=4, seed=3,
                                        logprobs=1)
    assert with_lp.choices[0].text == scored[0].text and with_lp.choices[0].logprobs is not None


def test_batched_prompts_index_prompt_times_n_plus_j(gw: Gateway, client: openai.OpenAI) -> None:
    model = _model(client)
    prompts = ["Once upon a time", "In a galaxy far away there", "Hello"]
    r = client.completions.create(model=model, prompt=prompts, max_tokens=MAX, n=2, seed=5)
    assert [c.index for c in r.choices] == list(range(6))
    for i, p in enumerate(prompts):
        for j in range(2):
            assert r.choices[i * 2 + j].text == _alone(client, p, 5, j), (i, j)
    singles = [client.completions.create(model=model, prompt=p, max_tokens=1, seed=5).usage for p in prompts]
    assert r.usage is not None
    assert r.usage.prompt_tokens == sum(u.prompt_tokens for u in singles if u is not None)

    ids: Any = [[72, 101, 108, 108, 111], [87, 111, 114, 108, 100, 33]]
    t = client.completions.create(model=model, prompt=ids, max_tokens=MAX, seed=5)
    assert [c.index for c in t.choices] == [0, 1]
    assert t.choices[1].text == _alone(client, ids[1], 5, 0)

    async def streamed() -> dict[int, str]:
        ac = openai.AsyncOpenAI(base_url=gw.http + "/v1", api_key=KEY, max_retries=0, timeout=120)
        texts: dict[int, str] = {}
        try:
            async for chunk in await ac.completions.create(model=model, prompt=prompts, max_tokens=MAX, n=2,
                                                           seed=5, stream=True):
                for c in chunk.choices:
                    texts[c.index] = texts.get(c.index, "") + c.text
        finally:
            await ac.close()
        return texts

    assert asyncio.run(streamed()) == {c.index: c.text for c in r.choices}


def test_sync_stream_of_n_and_refusals(client: openai.OpenAI) -> None:
    model = _model(client)
    texts: dict[int, str] = {}
    for chunk in client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX, n=2, seed=9, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {0: _alone(client, PROMPT, 9, 0), 1: _alone(client, PROMPT, 9, 1)}
    for kwargs, param in (({"best_of": 3, "stream": True}, "best_of"), ({"n": 3, "best_of": 2}, "best_of"),
                          ({"n": 100, "prompt": ["a", "b"]}, "n")):
        body: Any = {"model": model, "prompt": PROMPT, "max_tokens": MAX, **kwargs}
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**body)
        assert e.value.body["param"] == param  # type: ignore[index]


def test_async_whole_and_sync_streamed_chat(gw: Gateway, client: openai.OpenAI) -> None:
    model = _model(client)
    msgs: Any = [{"role": "user", "content": "Name a colour."}]

    async def whole() -> tuple[Any, Any]:
        ac = openai.AsyncOpenAI(base_url=gw.http + "/v1", api_key=KEY, max_retries=0, timeout=120)
        try:
            chat = await ac.chat.completions.create(model=model, messages=msgs, max_tokens=MAX, n=2, seed=21)
            best = await ac.completions.create(model=model, prompt=PROMPT, max_tokens=MAX, best_of=3, seed=21)
        finally:
            await ac.close()
        return chat, best

    chat, best = asyncio.run(whole())
    assert [c.index for c in chat.choices] == [0, 1] and len(best.choices) == 1
    texts: dict[int, str] = {}
    usage = None
    for chunk in client.chat.completions.create(model=model, messages=msgs, max_tokens=MAX, n=2, seed=21,
                                                stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert texts == {c.index: c.message.content for c in chat.choices}
    assert usage is not None and chat.usage is not None and usage.total_tokens == chat.usage.total_tokens
    scored = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX, n=3, seed=21, logprobs=0)
    top = max(scored.choices, key=lambda c: sum(c.logprobs.token_logprobs))  # type: ignore[union-attr,arg-type]
    assert best.choices[0].text == top.text


def test_batched_prompts_sync_streamed_and_async_whole_and_async_best_of_refusal(gw: Gateway,
                                                                                  client: openai.OpenAI) -> None:
    """The ways test_batched_prompts_index_prompt_times_n_plus_j does not ask: the same batch
    streamed sync and whole async gives the same choices; best_of streamed is refused async too."""
    model = _model(client)
    prompts = ["Once upon a time", "Hello"]
    whole = client.completions.create(model=model, prompt=prompts, max_tokens=MAX, n=2, seed=6)
    want = {c.index: c.text for c in whole.choices}
    assert sorted(want) == [0, 1, 2, 3]
    texts: dict[int, str] = {}
    for chunk in client.completions.create(model=model, prompt=prompts, max_tokens=MAX, n=2, seed=6, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == want

    async def async_side() -> None:
        async with openai.AsyncOpenAI(base_url=gw.http + "/v1", api_key=KEY, max_retries=0, timeout=120) as ac:
            r = await ac.completions.create(model=model, prompt=prompts, max_tokens=MAX, n=2, seed=6)
            assert {c.index: c.text for c in r.choices} == want
            assert r.usage is not None and whole.usage is not None
            assert r.usage.completion_tokens == whole.usage.completion_tokens
            with pytest.raises(openai.BadRequestError) as e:
                await ac.completions.create(model=model, prompt=PROMPT, max_tokens=MAX, best_of=3, stream=True)
            assert e.value.body["param"] == "best_of"  # type: ignore[index]

    asyncio.run(async_side())
