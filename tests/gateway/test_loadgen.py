"""The bench load generator against the app on a real listener (scripted worker double)."""

from __future__ import annotations

import pytest

from gateway.app import App
from gateway.http.server import start_server
from gateway.loadgen import run_load
from gateway.routing.pool import ModelPool

from .doubles import ScriptedWorkerConnection


@pytest.mark.parametrize("stream", [False, True])
async def test_run_load_counts_requests(stream: bool) -> None:
    pool = ModelPool()
    conn = ScriptedWorkerConnection()
    pool.add(conn)
    server = await start_server(App(pool).handle, host="127.0.0.1", port=0)
    try:
        r = await run_load(f"http://127.0.0.1:{server.port}", concurrency=4, duration=0.3, stream=stream,
                           max_tokens=16)
    finally:
        await server.close()
    assert r.errors == 0 and r.requests > 10
    assert len(conn.submits) >= r.requests
    assert 0 < r.percentile(50) <= r.percentile(99)


async def test_run_load_counts_errors() -> None:
    server = await start_server(App(ModelPool()).handle, host="127.0.0.1", port=0)
    try:
        r = await run_load(f"http://127.0.0.1:{server.port}", concurrency=2, duration=0.2, stream=False,
                           max_tokens=16)
    finally:
        await server.close()
    assert r.requests == 0 and r.errors > 0 and r.first_error.startswith("503")
