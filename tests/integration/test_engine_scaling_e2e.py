"""Chunked prefill and tensor parallelism through a real ``quicserve serve`` with its JAX worker.

- Chunked prefill (the worker's default ``step_tokens``): streams decode while a prompt several
  chunks long arrives; every request's greedy tokens equal those of the engine in this process
  without chunking, one request at a time.
- Tensor parallelism: ``[workers] tensor_parallel = 2`` over two forced CPU devices (the worker
  inherits ``XLA_FLAGS``); a request's greedy tokens equal the one-device engine's. And over two
  worker processes joined by ``jax.distributed``, the gateway talking to the first.

Token ids are read from each token's top alternative (``token_id:<id>``), so a byte the text
cannot show still counts. ``max_prefill_batch = 1`` halves the shapes the worker compiles before
it is ready; the tensor-parallel servers also take a 128-token context and no chunking (``SMALL``).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("jax")

from tests.integration.serve_process import REPO, serve_config  # noqa: E402
from tests.integration.test_gateway_e2e import Gateway, stop_gateway  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CONFIG = """
[workers]
engine = "jax"
max_prefill_batch = 1
{extra}
"""
# The tensor-parallel servers compile fewer shapes: a short context, no mixed passes (chunking is tested above).
SMALL = "max_model_len = 128\nstep_tokens = 0"
STREAMS = ["Once upon a time", "The quick brown fox", "In a hole in the ground", "It was a bright cold day"]
LONG = "".join(f"line {i}: the paged cache holds this prompt in chunks. " for i in range(16))  # ~850 bytes


def _reference(prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of each prompt alone, the engine in this process, one device, no chunking."""
    from inference.engine import Engine, EngineConfig
    from inference.model.jax_runner import JaxRunner
    from inference.tokenizer import load_tokenizer
    from tests.inference.doubles import Collector, run_until_done
    from transport.messages import SamplingParams

    tok = load_tokenizer("tiny")
    runner = JaxRunner.load("tiny", max_batch=4, max_prefill_batch=1, step_tokens=0)
    out = []
    for i, p in enumerate(prompts):
        eng = Engine(runner, tok, EngineConfig(max_batch=4, prefill_batch=1, step_tokens=0))
        eng.add(i, tok.encode(p), SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), 0.0)
        col = Collector()
        run_until_done(eng, col)
        out.append(col.tokens(i))
    return out


def _serve(tmp: Path, extra: str = "", env: dict[str, str] | None = None) -> Gateway:
    return serve_config(tmp, CONFIG.format(extra=extra), models=["tiny"], env=env)


async def _complete(c: httpx.AsyncClient, prompt: str, max_tokens: int, stream: bool) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "stream": stream}
    if not stream:
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return _ids(r.json()["choices"][0]["logprobs"]["top_logprobs"])
    ids: list[int] = []
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                if choice.get("logprobs"):
                    ids += _ids(choice["logprobs"]["top_logprobs"])
    return ids


def _ids(top: list[dict[str, Any]]) -> list[int]:
    return [int(re.fullmatch(r"token_id:(\d+)", next(iter(t))).group(1)) for t in top]  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def chunked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    g = _serve(tmp_path_factory.mktemp("chunked"))
    yield g
    stop_gateway(g)


def test_a_long_prompt_chunked_beside_streams_gives_the_unchunked_tokens(chunked: Gateway) -> None:
    async def run() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=chunked.http, timeout=300) as c:
            streams = [asyncio.create_task(_complete(c, p, 48, True)) for p in STREAMS]
            await asyncio.sleep(0.5)  # the streams are decoding when the long prompt arrives
            long = await _complete(c, LONG, 8, False)
            return [*await asyncio.gather(*streams), long]

    got = asyncio.run(run())
    assert len(LONG) > 3 * 256  # three chunks at the default budget, beside the streams' decodes
    assert got == _reference_cached()


_CACHE: dict[str, list[list[int]]] = {}


def _reference_cached() -> list[list[int]]:
    if "ref" not in _CACHE:
        streams = _reference(STREAMS, 48)
        _CACHE["ref"] = [*streams, *_reference([LONG], 8)]
    return _CACHE["ref"]


def test_tensor_parallel_2_gives_one_devices_tokens(tmp_path: Path) -> None:
    g = _serve(tmp_path, f"tensor_parallel = 2\n{SMALL}", env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    try:
        async def run() -> list[list[int]]:
            async with httpx.AsyncClient(base_url=g.http, timeout=300) as c:
                return list(await asyncio.gather(*(_complete(c, p, 48, False) for p in STREAMS[:2])))

        got = asyncio.run(run())
    finally:
        stop_gateway(g)
    assert got == _reference_cached()[:2]


def test_two_jax_distributed_processes_serve_a_request(tmp_path: Path) -> None:
    """`quicserve worker` twice on localhost, one CPU device each, ``jax.distributed`` between them
    and the model split over both (tensor_parallel = 2): process 0 serves the transport and runs the
    engine, process 1 follows its steps. A `quicserve serve` with process 0 as its remote worker
    answers with the one-device engine's greedy tokens; stopping the leader stops the follower."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = ["--engine", "jax", "--max-prefill-batch", "1", "--max-model-len", "128", "--step-tokens", "0",
             "--tensor-parallel", "2", "--distributed-processes", "2", "--distributed-coordinator", f"127.0.0.1:{port}"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}

    def worker(rank: int) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-m", "gateway.cli", "worker", *flags, "--distributed-process-id",
                                 str(rank)], cwd=REPO, stdout=subprocess.PIPE, text=True, env=env)

    follower, leader = worker(1), worker(0)
    try:
        url = _ready_url(leader)
        g = serve_config(tmp_path, f'[workers]\nlocal = 0\nremote = ["{url}"]\n', models=["tiny"])
        try:
            async def run() -> list[int]:
                async with httpx.AsyncClient(base_url=g.http, timeout=300) as c:
                    return await _complete(c, STREAMS[0], 48, True)

            got = asyncio.run(run())
        finally:
            stop_gateway(g)
        assert got == _reference_cached()[0]
        leader.send_signal(signal.SIGTERM)
        assert leader.wait(60) == 0 and follower.wait(60) == 0
    finally:
        for p in (leader, follower):
            if p.poll() is None:
                p.kill()
                p.wait(10)


def _ready_url(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:
        ev = json.loads(line) if line.startswith("{") else {}
        if ev.get("event") == "ready":
            return str(ev["url"])
        assert ev.get("event") != "fatal", ev
    raise AssertionError(f"the leader exited ({proc.wait()}) before it was ready")
