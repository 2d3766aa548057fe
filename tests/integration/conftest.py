"""Fixtures shared by the integration modules.

``jax_gateway``: ONE real ``quicserve serve --engine jax`` (the tiny random-weight model in a worker
process, default settings otherwise, API keys required: :data:`KEY`) for the whole session, shared by
the #31 modules (test_structured_output, test_sampling_breadth, test_prompt_tasks, test_n_choices).
Each of them started its own before, and a JAX worker's start (load and compile) is most of what
those modules cost. Nothing the modules assert depends on what another module asked before (no
metric totals, no cold prefix cache), so they pass in any order and alone."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gateway.admission.keys import hash_key
from tests.integration.test_gateway_e2e import Gateway, start_gateway, stop_gateway

#: the shared JAX gateway's one API key (OpenAI SDK ``api_key``, gRPC ``authorization`` metadata)
KEY = "sk-prompt-tasks-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}
GRPC_AUTH = (("authorization", f"Bearer {KEY}"),)


#: the shared gateway while it runs, then its exit status (stopped after the last test that uses it)
_SHARED: dict[str, Gateway | int] = {}


@pytest.fixture(scope="session")
def jax_compilation_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """``--worker-option=compilation_cache=DIR``: one JAX persistent compilation cache for the session's
    JAX gateways (the default, ``auto``, is in each one's state directory, so each starts cold). A start
    over a warm cache: the tiny model ready and answering in 6.0-7.5 s against 44 s cold (this host)."""
    return f"--worker-option=compilation_cache={tmp_path_factory.mktemp('jax-compilation-cache')}"


@pytest.fixture(scope="session")
def jax_gateway(tmp_path_factory: pytest.TempPathFactory, jax_compilation_cache: str) -> Iterator[Gateway]:
    pytest.importorskip("jax")
    state = tmp_path_factory.mktemp("jax-state")
    keys = state / "keys.toml"
    keys.write_text(f'[[keys]]\nid = "t"\nsha256 = "{hash_key(KEY)}"\n')
    config = state / "config.toml"
    config.write_text(f'[admission]\nkeys_file = "{keys}"\n')
    g = start_gateway(state, "--engine", "jax", "--config", str(config), "--log-level", "error", jax_compilation_cache)
    _SHARED["gateway"] = g
    yield g
    if _SHARED.pop("gateway", None) is not None:
        _SHARED["rc"] = stop_gateway(g)
    assert _SHARED.pop("rc") == 0


def _uses(item: pytest.Item) -> bool:
    return "jax_gateway" in getattr(item, "fixturenames", ())


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the shared gateway once no later test of the session uses it, not at the session's end:
    the rest of the suite would run beside an idle JAX worker (its memory, its threads)."""
    if "gateway" in _SHARED and _uses(item):
        items = item.session.items
        if not any(_uses(i) for i in items[items.index(item) + 1:]):
            g = _SHARED.pop("gateway")
            assert isinstance(g, Gateway)
            _SHARED["rc"] = stop_gateway(g)
