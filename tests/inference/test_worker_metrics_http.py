"""A worker's own /metrics (--metrics-listen): the engine's figures without a gateway in between."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.inference.test_worker import collect
from transport.client import connect
from transport.common.worker_options import EXIT_CONFIG
from transport.messages import Finish, SamplingParams, Submit

ROOT = Path(__file__).resolve().parents[2]
WORKER = [sys.executable, "-c", "import sys; from inference.worker import main; raise SystemExit(main(sys.argv[1:]))",
          "--engine", "synthetic"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _samples(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


@contextlib.asynccontextmanager
async def ready_worker(*flags: str) -> AsyncIterator[tuple[asyncio.subprocess.Process, dict[str, Any]]]:
    """A synthetic worker subprocess and its ready event; killed on the way out if still running."""
    proc = await asyncio.create_subprocess_exec(*WORKER, *flags, stdout=asyncio.subprocess.PIPE, env=ENV,
                                                cwd=str(ROOT))
    assert proc.stdout is not None
    try:
        event: dict[str, Any] = {}
        while event.get("event") != "ready":
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
            assert line, "worker exited before ready"
            event = json.loads(line)
        yield proc, event
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_worker_serves_its_engine_counters() -> None:
    """One request of 8 tokens on an idle worker: a prefill step (token 1) and 7 decode steps, one
    sequence each, so 8 steps and 8 step-sequences once the next Stats after it are taken."""
    async with ready_worker("--metrics-listen", "127.0.0.1:0", "--stats-interval", "0.05") as (proc, ready):
        url = ready["metrics_url"]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        conn = await connect(ready["url"])
        stream = conn.submit(Submit(conn.next_request_id(), "tiny", SamplingParams(max_tokens=8), prompt="hi"))
        _, _, end = await collect(stream)
        await conn.close()
        assert isinstance(end, Finish) and end.completion_tokens == 8
        deadline = time.monotonic() + 10
        while (got := await asyncio.to_thread(_samples, url)).get("quicserve_worker_steps_total") != 8:
            assert time.monotonic() < deadline, got
            await asyncio.sleep(0.05)
        assert got["quicserve_worker_step_sequences_total"] == 8
        assert got["quicserve_worker_step_seconds_total"] > 0
        assert got["quicserve_worker_preemptions_total"] == 0 and got["quicserve_worker_running"] == 0
        assert got["quicserve_worker_info"] == 1
        proc.send_signal(signal.SIGTERM)  # the metrics thread does not hold the worker up
        assert await asyncio.wait_for(proc.wait(), 30) == 0


def test_a_taken_metrics_port_is_a_configuration_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([*WORKER, "--metrics-listen", f"127.0.0.1:{port}"], capture_output=True, text=True,
                           env=ENV, cwd=str(ROOT), timeout=60)
    assert r.returncode == EXIT_CONFIG, r.stderr
    (event,) = [json.loads(x) for x in r.stdout.splitlines() if '"fatal"' in x]
    assert f"cannot serve metrics on 127.0.0.1:{port}" in event["message"]
