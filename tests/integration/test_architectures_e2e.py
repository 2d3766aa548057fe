"""Qwen2, Qwen3 and Mistral with a sliding window, each a random checkpoint written by transformers (with
a tokenizer and the family's chat template), served by a real ``quicserve serve --model DIR`` and asked
by a real HTTP client: the greedy chat completions are transformers' ``generate``'s, token for token
(the ids read from each token's top alternative, ``token_id:<id>``), their text its tokenizer's, and
the prompt its chat template's. Mistral's prompts and generations are longer than its window.

The Mistral server's KV cache holds the sequences' windows but not the sequences whole (block size 4,
40 blocks): the worker's preemption counter stays at zero because the blocks that fall out of every
window go back to the cache as it runs. Every server compiles one prompt per prefill call
(``max_prefill_batch = 1``): half the shapes a worker compiles before it is ready, the rest of the
settings the defaults.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("jax")
pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.integration.hf_checkpoints import hf_greedy, write_checkpoint  # noqa: E402
from tests.integration.serve_process import serve_config  # noqa: E402
from tests.integration.test_gateway_e2e import Gateway, stop_gateway  # noqa: E402

pytestmark = pytest.mark.slow

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1, rope_theta=1000000.0)
WINDOW = 16
BLOCK, BLOCKS = 4, 40
WORKERS = "[workers]\nmax_prefill_batch = 1\n"
MODELS: dict[str, tuple[str, dict[str, Any], str]] = {  # name: (model_type, config, [workers] settings)
    "qwen2-tied": ("qwen2", dict(BASE, tie_word_embeddings=True), WORKERS),
    "qwen3-untied": ("qwen3", dict(BASE, head_dim=32, tie_word_embeddings=False), WORKERS),
    "mistral-window": ("mistral", dict(BASE, sliding_window=WINDOW, tie_word_embeddings=False),
                       WORKERS + f"block_size = {BLOCK}\nnum_blocks = {BLOCKS}\nmax_batch = 4\n"),
}
CHATS = [
    [{"role": "user", "content": "how many legs does a spider have?"}],
    [{"role": "user", "content": "the quick brown fox jumps over the lazy dog; " * 3 + "how many legs?"}],
]
NEW_TOKENS = 32
Served = tuple[Any, Path, Gateway]


@pytest.fixture(scope="module", params=list(MODELS))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model_type, config, workers = MODELS[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    hf = write_checkpoint(tmp / request.param, model_type, config, seed=7)
    g = serve_config(tmp / "state", workers, args=("--no-tls", "--grpc-port", "-1", "--quic-port", "-1",
                                                    "--engine", "jax", "--model", str(tmp / request.param)))
    yield hf, tmp / request.param, g
    stop_gateway(g)


async def _chat(g: Gateway, model: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=g.http, timeout=120) as c:
        r = await c.post("/v1/chat/completions", json={
            "model": model, "messages": messages, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 1})
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body


def _token_ids(choice: dict[str, Any]) -> list[int]:
    """The greedy token of each position: its most likely alternative, named ``token_id:<id>``."""
    return [int(re.fullmatch(r"token_id:(\d+)", t["top_logprobs"][0]["token"]).group(1))  # type: ignore[union-attr]
            for t in choice["logprobs"]["content"]]


async def _all(g: Gateway, model: str) -> list[dict[str, Any]]:
    return list(await asyncio.gather(*(_chat(g, model, m) for m in CHATS)))


def test_greedy_chat_equals_transformers_generate(served: Served) -> None:
    hf, path, g = served
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    answers = asyncio.run(_all(g, path.name))  # both at once: they share engine steps
    prompts = []
    for messages, body in zip(CHATS, answers, strict=True):
        prompt, expected = hf_greedy(hf, path, messages, NEW_TOKENS)
        prompts.append(prompt)
        choice = body["choices"][0]
        assert body["usage"]["prompt_tokens"] == len(prompt)
        assert _token_ids(choice) == expected
        assert choice["message"]["content"] == tok.decode(expected, skip_special_tokens=True)
    assert len(prompts[1]) > 2 * WINDOW and NEW_TOKENS > WINDOW  # Mistral's window hides keys in both


def _preemptions(g: Gateway, wait: float = 60.0) -> float:
    """The worker's preemption counter as the gateway exports it, once its first Stats has come (a
    JAX worker's load reports can lag its readiness while it compiles the shapes a batch needs)."""
    deadline = time.monotonic() + wait
    while True:
        text = httpx.get(g.http + "/metrics").text
        values = [float(m.group(1)) for m in re.finditer(
            r"^quicserve_worker_preemptions(?:_total)?(?:\{[^}]*\})? (\S+)$", text, re.M)]
        if values or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert values, "no quicserve_worker_preemptions series on /metrics"
    return sum(values)


def test_a_cache_that_holds_only_the_windows_serves_without_preemption(served: Served) -> None:
    """Four chats at once whose sequences would need more blocks whole than the cache has; once past
    its prefill, each holds only the blocks its window touches (5, and the one it writes)."""
    hf, path, g = served
    if hf.config.model_type != "mistral":
        pytest.skip("a sliding window is Mistral's here")
    chats = [[{"role": "user", "content": f"{i}: " + "the quick brown fox jumps over the lazy dog; " * 2}]
             for i in range(4)]
    expected = [hf_greedy(hf, path, m, NEW_TOKENS) for m in chats]
    whole = sum(-(-(len(prompt) + NEW_TOKENS) // BLOCK) for prompt, _ in expected)
    assert whole > BLOCKS  # the premise: without the releases, the engine would have to preempt
    before = _preemptions(g)

    async def run() -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(_chat(g, path.name, m) for m in chats)))

    for (_, new), body in zip(expected, asyncio.run(run()), strict=True):
        assert _token_ids(body["choices"][0]) == new
    time.sleep(1.5)  # the worker reports every 0.5 s: a report after the last step
    assert _preemptions(g) == before == 0
