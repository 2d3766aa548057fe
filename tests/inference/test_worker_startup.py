"""A worker reports its start-up (#35): the seconds of each phase -- load, compile, warm-up -- in its
``ready`` event and in its Hello; the synthetic engine's ``synthetic_startup_ms`` is spent loading."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

from transport.client import connect

ROOT = Path(__file__).resolve().parents[2]


async def test_the_phases_reach_the_ready_event_and_the_hello() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "worker", "--engine", "synthetic", "--synthetic-startup-ms", "400",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, cwd=str(ROOT))
    assert proc.stdout is not None
    try:
        while True:
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            assert line, "worker exited before ready"
            ready = json.loads(line)
            if ready["event"] == "ready":
                break
        phases = ready["startup"]
        assert set(phases) == {"load", "compile", "warmup"}
        assert phases["load"] >= 0.4  # the imitated cold start is part of loading
        assert phases["compile"] == 0.0  # nothing to compile
        assert 0.0 <= phases["warmup"] < phases["load"]
        conn = await connect(ready["url"])
        assert conn.peer_hello.startup == (phases["load"], phases["compile"], phases["warmup"])
        await conn.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 30)
