"""n = 8 through a real `quicserve serve` (its defaults: the synthetic engine, which runs the real
scheduler and prefix cache): the request's eight sequences go to one worker, which prefills the
prompt once -- seven of the eight take its blocks from the prefix cache, so the worker's prefix-cache
hit ratio (its Stats, on the gateway's /metrics) is about 7/8 after this one request. Had each
sequence prefilled its own copy, or gone to another worker, it would be 0."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.integration.test_gateway_e2e import Gateway, start_gateway, stop_gateway


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    g = start_gateway(tmp_path_factory.mktemp("state"), "--workers", "2")
    yield g
    assert stop_gateway(g) == 0


def _hit_ratios(gw: Gateway) -> list[float]:
    text = httpx.get(gw.http + "/metrics").text
    return [float(v) for v in re.findall(r"^quicserve_worker_prefix_hit_ratio\{[^}]*\} (\S+)$", text, re.M)]


def test_n8_prefills_its_prompt_once_on_one_worker(gw: Gateway) -> None:
    client = openai.OpenAI(base_url=gw.http + "/v1", api_key="x", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    prompt = "".join(chr(97 + (i * 7) % 26) for i in range(2000))
    r = client.completions.create(model=model, prompt=prompt, max_tokens=4, n=8, seed=1)
    assert [c.index for c in r.choices] == list(range(8)) and r.usage is not None
    tokens = r.usage.prompt_tokens
    expected = 7 * (tokens - 16) / (8 * tokens)  # the leader's 0, each follower all but its last block
    deadline = time.monotonic() + 20
    ratios: list[float] = []
    while time.monotonic() < deadline:  # the workers' Stats come every 0.5 s
        ratios = _hit_ratios(gw)
        if len(ratios) == 2 and max(ratios) >= expected:
            break
        time.sleep(0.2)
    assert len(ratios) == 2 and sorted(ratios)[0] == 0.0  # the other worker saw none of it
    assert expected - 0.01 <= max(ratios) <= 7 / 8, ratios
