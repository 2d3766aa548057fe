"""Hostile structured-output requests against a real `quicserve serve` (synthetic engine: its worker
compiles grammars exactly as the JAX one does) while 32 normal streams run: every hostile request
gets a 400 that says why or a valid answer, and every normal stream finishes whole.

tests/bench/bench_hostile_schemas.py runs the same load and reports the normal streams' p99
inter-token latency with and without the hostile requests (a timing, so not asserted here).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.integration.test_gateway_e2e import Gateway, start_gateway, stop_gateway

pytest.importorskip("llguidance")

NORMAL_TOKENS = 120


def _deep(n: int) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "integer"}
    for _ in range(n):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


def hostile() -> list[tuple[str, Any]]:
    """100 (kind, value) pairs: response_format schemas and structured_outputs of every kind, each
    built to cost something (depth, breadth, size, ambiguity) or to be wrong."""
    out: list[tuple[str, Any]] = []
    for i in range(100):
        k = i % 10
        if k == 0:
            out.append(("json", _deep(150 + i)))  # too deep to enforce
        elif k == 1:
            out.append(("json", {"enum": [f"value {j} {i}" for j in range(3000)]}))  # a huge enum
        elif k == 2:
            out.append(("json", {"type": "string", "pattern": f"(a|b)*a(a|b){{{20 + i}}}"}))  # a DFA blow-up
        elif k == 3:
            out.append(("json", {"type": "object", "required": [f"p{j}" for j in range(1500)],
                                 "properties": {f"p{j}": {"type": "integer"} for j in range(1500)}}))
        elif k == 4:
            out.append(("json", {"type": "array", "uniqueItems": True, "items": {"not": {"type": "null"}}}))
        elif k == 5:
            out.append(("regex", "(x+x+)+y" * (1 + i % 7)))  # catastrophic for a backtracking engine
        elif k == 6:
            out.append(("regex", "(" * (i + 1)))  # not a regex
        elif k == 7:
            out.append(("grammar", "start: a\na: a a | \"x\"" if i % 20 else "start: ("))  # ambiguous / broken
        elif k == 8:
            s: Any = {"type": "integer"}
            for j in range(60):  # (each level once: a schema shared by two branches would be 2^60 as text)
                s = {"anyOf": [{"type": "array", "items": s, "maxItems": 2}, {"type": "string", "maxLength": j}]}
            out.append(("json", s))  # deep alternatives
        else:
            out.append(("json", {"type": "string", "minLength": 100000}))  # never done before max_tokens
    return out


def hostile_body(kind: str, value: Any, i: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": f"hostile {i}"}],
                            "max_tokens": 40}
    if kind == "json" and i % 2:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "h", "schema": value}}
    else:
        body["structured_outputs"] = {kind: value}
    return body


async def normal_stream(client: httpx.AsyncClient, i: int, itl: list[float]) -> int:
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"normal {i}"}], "max_tokens": NORMAL_TOKENS,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    last = None
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                if last is not None:
                    itl.append(now - last)
                last = now
    return tokens


async def hostile_one(client: httpx.AsyncClient, i: int, kind: str, value: Any) -> str:
    r = await client.post("/v1/chat/completions", json=hostile_body(kind, value, i))
    if r.status_code == 400:
        msg = r.json()["error"]["message"]
        assert msg and r.json()["error"]["type"] == "invalid_request_error"
        return "400"
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "length":
        return "length"
    text = choice["message"]["content"]
    if kind == "json":
        import jsonschema

        jsonschema.validators.validator_for(value)(value).validate(json.loads(text))
    return "valid"


async def run_load(base: str, with_hostile: bool) -> tuple[list[int], list[float], list[str]]:
    """32 normal streams, and (``with_hostile``) the 100 hostile requests sent meanwhile, 8 at a time."""
    itl: list[float] = []
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        normal = [asyncio.create_task(normal_stream(client, i, itl)) for i in range(32)]
        outcomes: list[str] = []
        if with_hostile:
            sem = asyncio.Semaphore(8)

            async def one(i: int, kind: str, value: Any) -> str:
                async with sem:
                    return await hostile_one(client, i, kind, value)

            outcomes = list(await asyncio.gather(*(one(i, k, v) for i, (k, v) in enumerate(hostile()))))
        tokens = list(await asyncio.gather(*normal))
    return tokens, itl, outcomes


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    g = start_gateway(tmp_path_factory.mktemp("state"), "--worker-option=synthetic_step_ms=5")
    yield g
    assert stop_gateway(g) == 0


def test_hostile_schemas_get_a_400_or_a_valid_answer_while_normal_streams_finish(gw: Gateway) -> None:
    assert len(hostile()) == 100
    tokens, itl, outcomes = asyncio.run(run_load(gw.http, True))
    assert tokens == [NORMAL_TOKENS] * 32
    assert len(outcomes) == 100 and set(outcomes) <= {"400", "valid", "length"}
    assert "400" in outcomes and "valid" in outcomes  # both kinds of end were exercised
    itl.sort()
    print(f"hostile outcomes: { {o: outcomes.count(o) for o in set(outcomes)} }; normal p99 ITL "
          f"{1e3 * itl[int(0.99 * (len(itl) - 1))]:.1f} ms")
    r = httpx.post(gw.http + "/v1/chat/completions", json={"model": "tiny", "max_tokens": 4,
                                                           "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
