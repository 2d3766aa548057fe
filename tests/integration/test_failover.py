"""Mid-stream failover through the real thing (#30): a ``quicserve serve`` with two local workers,
100 concurrent streams of 64 tokens, and kill -9 of one worker once the streams have ~20 tokens:
every stream completes, and its text equals an undisturbed run's byte for byte; the wait between
the last token before the kill and the next one (the failover's gap) is printed, and with a warm
second replica its 99th percentile is at most 2 s.

Two engines: the synthetic one (fast; greedy and seeded sampling, with whole responses and native
gRPC streams in the same load) and the JAX tiny model (greedy, what the issue asks for)."""

from __future__ import annotations

import asyncio
import re
import statistics
from pathlib import Path

import httpx
import pytest

from tests.integration.failover_load import Load, across, gaps_at, local_workers, p99, run_load, step_seconds
from tests.integration.serve_process import serve_config
from tests.integration.test_gateway_e2e import Gateway, stop_gateway

ARGS = ("--no-tls", "--grpc-port", "0", "--quic-port", "-1")


def _ready(g: Gateway) -> str:
    """Both workers up; the gRPC port's target."""
    for _ in range(3000):
        if httpx.get(g.http + "/readyz").json().get("workers") == 2 and len(local_workers(g)) == 2:
            break
        asyncio.run(asyncio.sleep(0.1))
    else:
        raise AssertionError("the two workers never came up")
    return next(m.group(1) for line in g.lines if (m := re.search(r"listening on grpc://(\S+)", line)))


def _metric(g: Gateway, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(g.http + "/metrics").text.splitlines()
               if line.startswith(name))


def _failover(g: Gateway, load: Load, kill_at: int, label: str) -> list[float]:
    """The load undisturbed, then again with a worker killed ``kill_at`` engine steps (their mean
    time measured in the undisturbed run) after the requests were placed -- its prompts' prefills,
    then ~20 tokens: the same texts; returns the gaps."""
    target = _ready(g)
    calm = asyncio.run(run_load(g, target, load))
    assert not calm.bad, calm.bad[:5]
    step = step_seconds(httpx.get(g.http + "/metrics").text)
    hit = asyncio.run(run_load(g, target, load, kill_after=kill_at * step))
    assert not hit.bad, f"{len(hit.bad)} requests did not complete: {hit.bad[:5]}"
    assert hit.killed_at
    differ = [k for k in calm.texts if calm.texts[k] != hit.texts.get(k)]
    assert not differ, f"{len(differ)} texts differ from the undisturbed run's, e.g. {differ[:3]}"
    assert len(hit.texts) == load.streams + load.wholes + load.grpc_streams
    gaps = gaps_at(hit)
    assert gaps, f"no stream was mid-way at the kill: {across(hit)}; {hit.timeline()}"
    failovers = _metric(g, "quicserve_stream_failovers_total")
    done, mid, later = across(hit)
    print(f"{label}: at the kill {done} streams had ended, {mid} were mid-way, {later} had not begun; "
          f"{failovers:g} failovers (engine step {step * 1e3:.1f} ms); gap after the kill p50 {statistics.median(gaps):.3f} s, "
          f"p99 {p99(gaps):.3f} s, max {max(gaps):.3f} s ({hit.timeline()})")
    assert failovers >= 1
    return gaps


SYNTHETIC = """
[workers]
engine = "synthetic"
synthetic_step_ms = 15
max_batch = 128

[[models]]
name = "m"
local = 2
"""


@pytest.mark.timeout(240)
def test_streams_survive_a_killed_synthetic_worker(tmp_path: Path) -> None:
    """Greedy and seeded SSE streams, whole responses and gRPC streams: all the same as undisturbed."""
    g = serve_config(tmp_path, SYNTHETIC, models=("m",), args=ARGS)
    try:
        gaps = _failover(g, Load("m", streams=100, wholes=10, grpc_streams=10, seeded=True), 22, "synthetic")
    finally:
        assert stop_gateway(g) == 0
    assert p99(gaps) <= 2.0


# The tiny model's buckets kept few (compiles dominate the start): 100 streams fit one worker's
# batch (the survivor takes them all), prompts + 64 tokens fit 96 positions, and the resumed
# streams' prefills go 8 at a time.
JAX = """
[workers]
engine = "jax"
max_batch = 104
max_model_len = 96
num_blocks = 1024
max_prefill_batch = 8

[[models]]
name = "tiny"
local = 2
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_streams_survive_a_killed_jax_worker_byte_for_byte(tmp_path: Path) -> None:
    """The issue's figure: 100 greedy streams of 64 tokens on the JAX tiny model, the worker killed
    after ~20 tokens; the gap's p99 at most 2 s with the survivor warm (it compiled every shape at
    start and has served the undisturbed run)."""
    pytest.importorskip("jax")
    g = serve_config(tmp_path, JAX, models=("tiny",), args=ARGS)
    try:
        gaps = _failover(g, Load("tiny", streams=100), 28, "jax tiny")
    finally:
        assert stop_gateway(g) == 0
    assert p99(gaps) <= 2.0
