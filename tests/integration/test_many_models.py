"""Several models in one real ``quicserve serve`` (issue #28, item 1): two JAX tiny models and a
synthetic one side by side, each with its own workers, called with the openai SDK by name and by
alias; /v1/models lists them; any other name is OpenAI's 404 model_not_found; every request metric
carries the model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.integration.serve_process import serve_config
from tests.integration.test_gateway_e2e import Gateway, stop_gateway

REPO = Path(__file__).resolve().parents[2]
CONFIG = """
[workers]
max_batch = 1                  # the fewest shapes to compile at start (two JAX workers on two cores)

[[models]]
name = "tiny-a"
aliases = ["a"]
model = "tiny"

[[models]]
name = "tiny-b"
model = "tiny"
workers = { max_model_len = 512 }

[[models]]
name = "echo"
aliases = ["default", "e"]
engine = "synthetic"
"""

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    g = serve_config(tmp_path_factory.mktemp("models"), CONFIG, models=("tiny-a", "tiny-b", "echo"),
                     log_level="warning")
    yield g
    assert stop_gateway(g) == 0


def test_every_model_by_name_and_alias(gw: Gateway) -> None:
    with openai.OpenAI(base_url=gw.http + "/v1", api_key="unused", max_retries=0) as client:
        listed = {m.id: getattr(m, "root", None) for m in client.models.list().data}
        assert listed == {"tiny-a": None, "a": "tiny-a", "tiny-b": None, "echo": None, "default": "echo", "e": "echo"}
        for asked, served in [("tiny-a", "tiny-a"), ("a", "tiny-a"), ("tiny-b", "tiny-b"), ("echo", "echo"),
                              ("default", "echo")]:
            r = client.chat.completions.create(model=asked, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
            assert r.model == served and r.usage is not None and 1 <= r.usage.completion_tokens <= 4
            chunks = list(client.completions.create(model=asked, prompt="Once", max_tokens=3, stream=True))
            assert chunks and all(c.model == served for c in chunks)
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert e.value.code == "model_not_found"


def test_request_metrics_carry_the_model(gw: Gateway) -> None:
    text = httpx.get(gw.http + "/metrics").text
    for model in ("tiny-a", "tiny-b", "echo"):
        assert f'model="{model}",protocol="http/1.1",route="/v1/chat/completions",status="200"' in text
        assert f'quicserve_time_to_first_token_seconds_count{{model="{model}",route="/v1/completions"}}' in text
    assert 'model="",protocol="http/1.1",route="/v1/chat/completions",status="404"' in text
    assert 'model="gpt-4"' not in text and 'model="a"' not in text  # configured names only
