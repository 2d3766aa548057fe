"""Embeddings, echo with prompt logprobs, tokenize and detokenize through the real thing (#31): a
`quicserve serve --engine jax` (the tiny model, default settings, API keys required) and real
clients (the openai SDK, sync and async; httpx). The numbers are checked against a numpy Llama
(tests/inference/model/test_prompt_pass.py), the token ids against the worker's own /tokenize."""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import openai
import pytest

from tests.inference.model.test_prompt_pass import ATOL, reference
from tests.integration.conftest import AUTH, KEY
from tests.integration.test_gateway_e2e import Gateway

TEXTS = ["hello world", "The quick brown fox"]


@pytest.fixture(scope="module")
def gw(jax_gateway: Gateway) -> Gateway:
    """The session's one JAX gateway (conftest.py): API keys on, every client sends KEY."""
    return jax_gateway


def tokenize(gw: Gateway, text: str) -> list[int]:
    r = httpx.post(gw.http + "/tokenize", json={"model": "tiny", "prompt": text}, headers=AUTH)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    return list(body["tokens"])


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def test_embeddings_sync_float_and_async_base64_equal_the_model(gw: Gateway) -> None:
    ids = [tokenize(gw, t) for t in TEXTS]
    want = [unit(reference(i)[0].mean(0)) for i in ids]
    with openai.OpenAI(base_url=gw.http + "/v1", api_key=KEY, max_retries=0) as client:
        r = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
        assert [d.index for d in r.data] == [0, 1]
        for d, w in zip(r.data, want, strict=True):
            np.testing.assert_allclose(d.embedding, w, atol=ATOL)
        assert r.usage.prompt_tokens == sum(len(i) for i in ids)
        one = client.embeddings.create(model="tiny", input=ids[1])  # token ids; the SDK's default is base64
        np.testing.assert_allclose(one.data[0].embedding, want[1], atol=ATOL)
        with pytest.raises(openai.BadRequestError, match="dimensions"):
            client.embeddings.create(model="tiny", input="x", dimensions=8)

    async def async_side() -> None:
        async with openai.AsyncOpenAI(base_url=gw.http + "/v1", api_key=KEY, max_retries=0) as client:
            raw = await client.embeddings.with_raw_response.create(model="tiny", input=TEXTS[0],
                                                                   encoding_format="base64")
            b64 = raw.http_response.json()["data"][0]["embedding"]
            np.testing.assert_allclose(np.frombuffer(base64.b64decode(b64), "<f4"), want[0], atol=ATOL)
            last = await client.embeddings.create(model="tiny", input=TEXTS[0], extra_body={"pooling": "last"})
            np.testing.assert_allclose(last.data[0].embedding, unit(reference(ids[0])[0][-1]), atol=ATOL)

    asyncio.run(async_side())


def test_echo_with_prompt_logprobs_sync_async_streamed_and_not(gw: Gateway) -> None:
    prompt = "Echo this prompt"
    ids = tokenize(gw, prompt)
    _, lsm = reference(ids)
    want = [lsm[i - 1, ids[i]] for i in range(1, len(ids))]
    with openai.OpenAI(base_url=gw.http + "/v1", api_key=KEY, max_retries=0) as client:
        # lm-eval-harness's loglikelihood request: the prompt alone, scored
        r = client.completions.create(model="tiny", prompt=prompt, echo=True, max_tokens=0, logprobs=3)
        c = r.choices[0]
        assert c.text == prompt and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
        lp = c.logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        np.testing.assert_allclose(lp.token_logprobs[1:], want, atol=ATOL)
        assert all(len(t) == 3 for t in lp.top_logprobs[1:])
        whole = client.completions.create(model="tiny", prompt=prompt, echo=True, max_tokens=4, logprobs=1,
                                          temperature=0)
        assert whole.choices[0].text.startswith(prompt) and whole.usage.completion_tokens == 4
        assert len(whole.choices[0].logprobs.token_logprobs) == len(ids) + 4
        chunks = list(client.completions.create(model="tiny", prompt=prompt, echo=True, max_tokens=4, logprobs=1,
                                                temperature=0, stream=True))
        assert "".join(ch.choices[0].text for ch in chunks) == whole.choices[0].text
        assert chunks[0].choices[0].text.startswith(prompt)
        plain = client.completions.create(model="tiny", prompt=prompt, echo=True, max_tokens=4, temperature=0)
        assert plain.choices[0].text == whole.choices[0].text and plain.choices[0].logprobs is None

    async def async_side() -> None:
        async with openai.AsyncOpenAI(base_url=gw.http + "/v1", api_key=KEY, max_retries=0) as client:
            r = await client.completions.create(model="tiny", prompt=prompt, echo=True, max_tokens=0, logprobs=1)
            np.testing.assert_allclose(r.choices[0].logprobs.token_logprobs[1:], want, atol=ATOL)
            text = ""
            async for ch in await client.completions.create(model="tiny", prompt=prompt, echo=True, max_tokens=4,
                                                            temperature=0, stream=True):
                text += ch.choices[0].text
            assert text == whole.choices[0].text

    asyncio.run(async_side())


def test_lm_eval_harness_loglikelihood_batch(gw: Gateway) -> None:
    """What lm-eval-harness's local-completions model sends: token-id prompts in a batch, echo,
    max_tokens 1, logprobs 1; it reads token_logprobs[ctxlen:-1] and compares each with its top."""
    prompts = [tokenize(gw, t) for t in TEXTS]
    r = httpx.post(gw.http + "/v1/completions", headers=AUTH, timeout=60, json={
        "model": "tiny", "prompt": prompts, "echo": True, "max_tokens": 1, "logprobs": 1, "temperature": 0,
        "seed": 1234}).json()
    for choice, ids in zip(sorted(r["choices"], key=lambda c: c["index"]), prompts, strict=True):
        lps, tops = choice["logprobs"]["token_logprobs"], choice["logprobs"]["top_logprobs"]
        assert len(lps) == len(ids) + 1 and lps[0] is None and tops[0] is None
        _, lsm = reference(ids)
        np.testing.assert_allclose(lps[1:-1], [lsm[i - 1, ids[i]] for i in range(1, len(ids))], atol=ATOL)
        for i in range(1, len(ids)):  # lm-eval's is_greedy, exactly: the token's logprob is its top one's
            assert (lps[i] == max(tops[i].values())) == (int(np.argmax(lsm[i - 1])) == ids[i])
    assert r["usage"]["completion_tokens"] == 2


def test_max_tokens_zero_needs_echo(gw: Gateway) -> None:
    r = httpx.post(gw.http + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 0}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_tokenize_and_detokenize(gw: Gateway) -> None:
    ids = tokenize(gw, "héllo")
    r = httpx.post(gw.http + "/detokenize", json={"model": "tiny", "tokens": ids[1:]}, headers=AUTH)
    assert r.status_code == 200 and r.json() == {"prompt": "héllo"}
    chat = httpx.post(gw.http + "/tokenize", headers=AUTH,
                      json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}).json()
    text = httpx.post(gw.http + "/detokenize", json={"model": "tiny", "tokens": chat["tokens"]}, headers=AUTH).json()
    assert "hi" in text["prompt"] and chat["count"] > 2  # the template's rendering around it
    bad = httpx.post(gw.http + "/detokenize", json={"model": "tiny", "tokens": [10**6]}, headers=AUTH)
    assert bad.status_code == 400
    missing = httpx.post(gw.http + "/tokenize", json={"model": "nope", "prompt": "x"}, headers=AUTH)
    assert missing.status_code == 404


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/v1/embeddings"])
def test_the_api_key_is_checked(gw: Gateway, path: str) -> None:
    body = {"model": "tiny", "prompt": "x", "tokens": [1], "input": "x"}
    assert httpx.post(gw.http + path, json=body).status_code == 401
    assert httpx.post(gw.http + path, json=body, headers={"authorization": "Bearer sk-wrong"}).status_code == 401


def _streamed_logprobs(chunks: list[openai.types.Completion]) -> tuple[str, list[float | None]]:
    text, lps = "", []
    for ch in chunks:
        for c in ch.choices:
            text += c.text
            lps += c.logprobs.token_logprobs or [] if c.logprobs is not None else []
    return text, lps


def test_streamed_echo_carries_the_prompt_logprobs_and_the_async_rest(gw: Gateway) -> None:
    """Echo's prompt logprobs streamed (sync and async) are the whole answer's; embeddings as floats
    and /tokenize, /detokenize from an async client."""
    prompt = "Echo this prompt"
    kw: dict[str, object] = dict(model="tiny", prompt=prompt, echo=True, max_tokens=4, logprobs=1, temperature=0)
    with openai.OpenAI(base_url=gw.http + "/v1", api_key=KEY, max_retries=0) as client:
        whole = client.completions.create(**kw)  # type: ignore[call-overload]
        text, lps = _streamed_logprobs(list(client.completions.create(**kw, stream=True)))  # type: ignore[call-overload]
    want = whole.choices[0].logprobs.token_logprobs
    assert text == whole.choices[0].text and len(lps) == len(want) and lps[0] is None
    np.testing.assert_allclose(lps[1:], want[1:], atol=ATOL)
    ids = tokenize(gw, TEXTS[1])

    async def async_side() -> None:
        async with openai.AsyncOpenAI(base_url=gw.http + "/v1", api_key=KEY, max_retries=0) as client:
            chunks = [c async for c in await client.completions.create(**kw, stream=True)]  # type: ignore[call-overload]
            a_text, a_lps = _streamed_logprobs(chunks)
            assert a_text == text and a_lps[0] is None
            np.testing.assert_allclose(a_lps[1:], want[1:], atol=ATOL)
            r = await client.embeddings.create(model="tiny", input=TEXTS[1], encoding_format="float")
            np.testing.assert_allclose(r.data[0].embedding, unit(reference(ids)[0].mean(0)), atol=ATOL)
        async with httpx.AsyncClient(base_url=gw.http, headers=AUTH, timeout=60) as h:
            tok = (await h.post("/tokenize", json={"model": "tiny", "prompt": TEXTS[1]})).json()
            assert tok["tokens"] == ids
            back = await h.post("/detokenize", json={"model": "tiny", "tokens": ids[1:]})
            assert back.json() == {"prompt": TEXTS[1]}

    asyncio.run(async_side())
