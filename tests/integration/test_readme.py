"""The README's curl examples, run as pasted against what `make run` starts.

`make run` is `quicserve serve` with no arguments: the gateway plus one local
worker on the built-in tiny JAX model. This test starts exactly that (on free
ports instead of 8080/8443), pulls every `curl` command out of the README's
"Try it" section, points it at the test ports and checks each returns what the
README says it does.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from tests.integration.test_gateway_e2e import Gateway, start_gateway, stop_gateway

REPO = Path(__file__).resolve().parents[2]

pytest.importorskip("jax")


def readme_curl_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Try it", 1)[1]
    cmds: list[str] = []
    for block in re.findall(r"```sh\n(.*?)```", section, re.S):
        joined = block.replace("\\\n", " ")
        cmds += [line.strip() for line in joined.splitlines() if line.strip().startswith("curl ")]
    return cmds


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    # Default engine (JAX) and model (tiny): what `make run` serves.
    gw = start_gateway_default(tmp_path_factory.mktemp("state"))
    yield gw
    assert stop_gateway(gw) == 0


def start_gateway_default(tmp: Path) -> Gateway:
    # start_gateway passes --engine synthetic; override it with the real one.
    return start_gateway(tmp, "--engine", "jax")


def run_curl(cmd: str, gw: Gateway) -> str:
    cmd = cmd.replace("http://127.0.0.1:8080", gw.http).replace("https://127.0.0.1:8443", gw.https)
    out = subprocess.run(shlex.split(cmd), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, (cmd, out.stderr)
    return out.stdout


def test_readme_has_the_examples() -> None:
    cmds = readme_curl_commands()
    assert len(cmds) >= 6
    assert any("/v1/models" in c for c in cmds)
    assert any("/v1/completions" in c for c in cmds)
    assert any('"stream": true' in c for c in cmds)


@pytest.mark.slow
def test_readme_curl_examples_return_what_they_say(served: Gateway) -> None:
    for cmd in readme_curl_commands():
        body = run_curl(cmd, served)
        if '"stream": true' in cmd:
            events = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]", body
            chunks = [orjson.loads(e) for e in events[:-1]]
            assert chunks and all(c["object"] == "chat.completion.chunk" for c in chunks)
            assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        elif "/v1/models" in cmd:
            doc = orjson.loads(body)
            assert doc["object"] == "list"
            assert [m["id"] for m in doc["data"]] == ["tiny"]
        elif "/v1/chat/completions" in cmd:
            doc = orjson.loads(body)
            assert doc["object"] == "chat.completion"
            assert doc["choices"][0]["message"]["role"] == "assistant"
            assert isinstance(doc["choices"][0]["message"]["content"], str)
            assert 1 <= doc["usage"]["completion_tokens"] <= 8
        elif "/v1/completions" in cmd:
            doc = orjson.loads(body)
            assert doc["object"] == "text_completion"
            assert isinstance(doc["choices"][0]["text"], str)
            assert 1 <= doc["usage"]["completion_tokens"] <= 8
        else:  # pragma: no cover - a new README example this test does not know
            raise AssertionError(f"unchecked README example: {cmd}")


def test_readme_models_example_passes_config_check() -> None:
    """The worked example of "Several models, routing rules, ..." is a valid configuration."""
    from gateway.settings import check_mapping

    text = (REPO / "README.md").read_text().split("### Several models, routing rules", 1)[1]
    block = re.findall(r"```toml\n(.*?)```", text, re.S)[0]
    import tomllib

    settings, problems = check_mapping(tomllib.loads(block))
    assert problems == [] and settings is not None
    tree = settings.rule_tree()
    assert tree is not None and "ab" in tree.leaves
    assert [m.name for m in settings.models] == ["llama-8b", "tiny-chat", "llama-8b-v2"]
    assert settings.rollouts[0].candidate == "llama-8b-v2"
