"""Requests waiting for a replica move to one that becomes ready (#20), with real processes: two
synthetic workers of 2 batch slots each; one is killed with requests queued on it (they move to the
survivor before their first token), the supervisor restarts it, and once it is ready the queue on
the survivor is split with it at once instead of draining on one worker."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from .test_gateway_e2e import CHAT, start_gateway, stop_gateway

pytestmark = pytest.mark.timeout(120)


async def test_queued_requests_are_served_by_a_restarted_replica(tmp_path: Path) -> None:
    g = start_gateway(tmp_path, "--no-tls", "--workers", "2", "--worker-option=synthetic_step_ms=20",
                      "--worker-option=max_batch=2")
    try:
        async with httpx.AsyncClient(base_url=g.http, timeout=60) as c:
            for _ in range(200):
                if (await c.get("/readyz")).json().get("workers") == 2:
                    break
                await asyncio.sleep(0.05)
            t0 = time.monotonic()
            reqs = [asyncio.create_task(c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 40}))
                    for _ in range(16)]
            await asyncio.sleep(0.3)  # 8 on each worker: 2 running, 6 queued
            victim = g.worker_pid
            os.kill(victim, signal.SIGKILL)  # its 8 move to the survivor (no token yet): 2 running, 14 queued
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not g.metric("quicserve_rebalanced_requests_total"):
                await asyncio.sleep(0.05)
            moved = g.metric("quicserve_rebalanced_requests_total")
            results = await asyncio.gather(*reqs)
            took = time.monotonic() - t0
        assert all(r.status_code == 200 for r in results), [(r.status_code, r.text[:200]) for r in results if r.status_code != 200]
        assert moved >= 4, f"{moved} requests moved to the restarted replica"
        assert g.metric("quicserve_worker_restarts_total") == 1
        assert took < 60
    finally:
        assert stop_gateway(g) == 0
