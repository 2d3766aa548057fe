"""``/v1/embeddings``'s input rules (gateway/api/embeddings.py) and its answer through a real
``quicserve serve --engine synthetic`` (the synthetic engine's embeddings are a pure function of the
prompt: the same input, the same vector, whatever else is asked with it)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from gateway.api.embeddings import MAX_INPUTS, PARALLEL, parse_inputs
from gateway.errors import APIError
from tests.integration.test_gateway_e2e import Gateway, start_gateway, stop_gateway


@pytest.mark.parametrize("v, want", [
    ("hi", ["hi"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [(1, 2, 3)]),
    ([[1], [2, 3]], [(1,), (2, 3)]),
])
def test_inputs(v: object, want: list[object]) -> None:
    assert parse_inputs(v) == want


@pytest.mark.parametrize("v", ["", [], [""], [[]], [1, "a"], [[1, -1]], [[2**32]], None, 5, {"a": 1},
                               ["x"] * (MAX_INPUTS + 1)])
def test_bad_inputs_are_400s(v: object) -> None:
    with pytest.raises(APIError) as ei:
        parse_inputs(v)
    assert ei.value.status == 400 and ei.value.param == "input"


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    g = start_gateway(Path(tmp_path_factory.mktemp("state")))
    yield g
    assert stop_gateway(g) == 0


def test_synthetic_embeddings_through_serve(gw: Gateway) -> None:
    url = gw.http + "/v1/embeddings"
    a = httpx.post(url, json={"model": "tiny", "input": ["same", "other"]}).json()
    b = httpx.post(url, json={"model": "tiny", "input": "same", "encoding_format": "base64", "dimensions": 32}).json()
    assert [d["index"] for d in a["data"]] == [0, 1] and a["usage"] == {"prompt_tokens": 11, "total_tokens": 11}
    vec = np.frombuffer(base64.b64decode(b["data"][0]["embedding"]), "<f4")
    np.testing.assert_array_equal(vec, np.asarray(a["data"][0]["embedding"], np.float32))
    assert abs(float(np.linalg.norm(vec)) - 1) < 1e-6 and a["data"][0]["embedding"] != a["data"][1]["embedding"]
    for body, param in [({"input": "x", "encoding_format": "hex"}, "encoding_format"),
                        ({"input": "x", "pooling": "max"}, "pooling"), ({"input": "x", "extra": 1}, "extra"),
                        ({"input": "x", "dimensions": 0}, "dimensions")]:
        r = httpx.post(url, json={"model": "tiny", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert httpx.post(url, json={"model": "nope", "input": "x"}).status_code == 404
    assert httpx.get(url).status_code == 405
    many = httpx.post(url, json={"model": "tiny", "input": [f"input {i}" for i in range(3 * PARALLEL)]}, timeout=60)
    assert [d["index"] for d in many.json()["data"]] == list(range(3 * PARALLEL))  # in order, past the gate
    metrics = httpx.get(gw.http + "/metrics").text
    assert 'route="/v1/embeddings"' in metrics and 'status="400"' in metrics  # counted as every route is
