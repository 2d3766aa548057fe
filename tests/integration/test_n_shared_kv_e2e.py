"""A block-aligned prompt wholly in the prefix cache, through the real thing: `quicserve serve --engine jax`
(the tiny random-weight model in a worker process, block size 16) and the official openai SDK.

The prompt is 1008 tokens (the byte tokenizer's bos + 1007 bytes): 63 full blocks. Asked again, it is
wholly cached: every block is shared and only its last token runs again, for its logits, with no K/V
written (``SeqWork.shared_tokens``), so usage reports 1007 cached tokens (992 before, when the last block
was recomputed), and the answer is the same as the first time (same seed). With ``n`` = 8 the seven
followers take the same path (``Engine._follows``): choice j is what the prompt alone gives with
sub_seed(s, j).
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from gateway.api.fan_merge import sub_seed
from tests.integration.test_gateway_e2e import Gateway, start_gateway, stop_gateway

pytest.importorskip("jax")

TEXT = "".join(chr(97 + (i * 7) % 26) for i in range(1007))  # + bos: 1008 tokens, 63 blocks of 16
MAX, SEED = 8, 11


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    g: Gateway = start_gateway(tmp_path_factory.mktemp("state"), "--engine", "jax", "--log-level", "error")
    c = openai.OpenAI(base_url=g.http + "/v1", api_key="x", max_retries=0, timeout=120)
    try:
        yield c
    finally:
        c.close()
        assert stop_gateway(g) == 0


def _ask(client: openai.OpenAI, seed: int, n: int = 1) -> tuple[list[str], int, int]:
    model = client.models.list().data[0].id
    r = client.completions.create(model=model, prompt=TEXT, max_tokens=MAX, seed=seed, n=n)
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    return texts, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens or 0


def test_a_wholly_cached_aligned_prompt_reruns_one_token_and_answers_the_same(client: openai.OpenAI) -> None:
    first, tokens, cached = _ask(client, SEED)
    assert tokens == 1008 and cached == 0
    again, _, cached = _ask(client, SEED)
    assert cached == 1007 and again == first  # every prompt block shared; its last token computed again
    many, tokens, _ = _ask(client, SEED, n=8)
    assert tokens == 1008 and len(many) == 8 and many[0] == first[0]
    for j in (1, 5, 7):
        assert many[j] == _ask(client, sub_seed(SEED, j))[0][0]
