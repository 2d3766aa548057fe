"""WorkerSupervisor with a fake worker process (tests/gateway/fake_worker.py) and a connect double."""

from __future__ import annotations

import asyncio
import io
import os
import sys
from pathlib import Path

import pytest

from gateway.observability.metrics import GatewayMetrics
from gateway.observability.progress import ProgressDisplay
from gateway.routing.pool import ModelPool
from gateway.workers.config import WorkersSettings
from gateway.workers.supervisor import Backoff, WorkerSupervisor, worker_command
from tests.gateway.doubles import ScriptedWorkerConnection
from tests.waiting import wait_for

FAKE = str(Path(__file__).parents[1] / "fake_worker.py")
WS = WorkersSettings(local=1, engine="synthetic", restart_backoff_initial=0.05, restart_backoff_max=0.2,
                     stop_timeout=2.0, ready_timeout=10.0)


class ConnectDouble:
    """Records URLs and hands out ScriptedWorkerConnections."""

    def __init__(self) -> None:
        self.urls: list[str] = []
        self.conns: list[ScriptedWorkerConnection] = []

    async def __call__(self, url: str, **kw: object) -> ScriptedWorkerConnection:
        self.urls.append(url)
        c = ScriptedWorkerConnection()
        self.conns.append(c)
        return c


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_backoff_doubles_caps_and_resets() -> None:
    b = Backoff(0.5, 3.0)
    assert [b.next_delay(1.0) for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert b.next_delay(60.0) == 0.5


def test_worker_command_runs_quicserve_worker() -> None:
    cmd = worker_command(WorkersSettings(engine="synthetic", max_batch=8, kv_cache_dtype="int8",
                                         prefix_cache=False, listen="unix:///tmp/w"), 1)
    assert cmd[:4] == [sys.executable, "-m", "gateway.cli", "worker"]
    # listen, engine and model always; the other options where they differ from the shared defaults
    assert cmd[4:] == ["--listen=unix:///tmp/w-1", "--engine=synthetic", "--model=tiny", "--max-batch=8",
                       "--kv-cache-dtype=int8", "--no-prefix-cache"]


async def test_start_ready_progress_and_stop() -> None:
    pool, out, connect = ModelPool(), io.StringIO(), ConnectDouble()
    sup = WorkerSupervisor(WS, pool, GatewayMetrics(), ProgressDisplay("lines", out), connect=connect,
                           commands=[[sys.executable, FAKE]])
    sup.start()
    assert await sup.wait_ready(10)
    assert pool.models() == ["tiny"] and pool.ready_workers() == 1
    pid = sup.workers[0].proc.pid  # type: ignore[attr-defined]
    assert connect.urls == [f"tcp://127.0.0.1:{pid}"]
    text = out.getvalue()
    assert "worker-0: load 1/4 weights" in text and "worker-0: load 4/4 weights" in text
    assert "ready at tcp://127.0.0.1:" in text
    await sup.stop()
    assert pool.ready_workers() == 0 and connect.conns[0].closed
    assert not alive(pid)


async def test_crash_before_ready_restarts_with_backoff() -> None:
    metrics = GatewayMetrics()
    out = io.StringIO()
    sup = WorkerSupervisor(WS, ModelPool(), metrics, ProgressDisplay("lines", out), connect=ConnectDouble(),
                           commands=[[sys.executable, FAKE, "--crash-before-ready"]])
    sup.start()
    await wait_for(lambda: sup.workers[0].starts >= 3, 10.0)
    await sup.stop()
    assert metrics.worker_restarts._value.get() >= 2
    assert "exited with status 3 before it was ready; restarting in 0.1 s" in out.getvalue()


async def test_crash_after_ready_leaves_pool_then_comes_back() -> None:
    pool, connect = ModelPool(), ConnectDouble()
    sup = WorkerSupervisor(WS, pool, GatewayMetrics(), connect=connect,
                           commands=[[sys.executable, FAKE, "--exit-after", "0.3"]])
    sup.start()
    await wait_for(lambda: len(connect.conns) >= 2, 10.0)  # ready, died, restarted, ready again
    assert connect.conns[0].closed and connect.urls[0] != connect.urls[1]
    assert pool.ready_workers() <= 1
    await sup.stop()


async def test_lost_connection_kills_and_restarts_the_process() -> None:
    pool, connect = ModelPool(), ConnectDouble()
    sup = WorkerSupervisor(WS, pool, GatewayMetrics(), connect=connect, commands=[[sys.executable, FAKE]])
    sup.start()
    assert await sup.wait_ready(10)
    pid = sup.workers[0].proc.pid  # type: ignore[attr-defined]
    await connect.conns[0].close()  # the worker's transport died
    await wait_for(lambda: len(connect.conns) >= 2 and pool.ready_workers() == 1, 10.0)
    assert not alive(pid)
    await sup.stop()


async def test_stop_kills_a_worker_that_ignores_sigterm() -> None:
    ws = WorkersSettings(local=1, stop_timeout=0.3)
    sup = WorkerSupervisor(ws, ModelPool(), GatewayMetrics(), connect=ConnectDouble(),
                           commands=[[sys.executable, FAKE, "--ignore-term"]])
    sup.start()
    assert await sup.wait_ready(10)
    pid = sup.workers[0].proc.pid  # type: ignore[attr-defined]
    await sup.stop()
    assert not alive(pid)


async def test_remote_worker_reconnects() -> None:
    pool, connect = ModelPool(), ConnectDouble()
    ws = WorkersSettings(local=0, remote=["tcp://10.9.9.9:7000"], restart_backoff_initial=0.05)
    sup = WorkerSupervisor(ws, pool, GatewayMetrics(), connect=connect)
    sup.start()
    assert await sup.wait_ready(5)
    await connect.conns[0].close()
    await wait_for(lambda: len(connect.conns) == 2 and pool.ready_workers() == 1, 10.0)
    assert connect.urls == ["tcp://10.9.9.9:7000"] * 2
    await sup.stop()


@pytest.mark.parametrize("mode", ["bar", "lines", "off"])
def test_progress_display_modes(mode: str) -> None:
    out = io.StringIO()
    d = ProgressDisplay(mode, out)
    for i in range(11):
        d.progress("w0", "compile", i, 10, "bucket")
    d.note("w0", "ready")
    text = out.getvalue()
    if mode == "off":
        assert text == ""
    elif mode == "bar":
        assert "\r" in text and "[########################] 10/10" in text and text.endswith("w0: ready\n")
    else:
        assert text.count("\n") == 6  # 0%, 25%, 50%, 75%, 100% and the note


async def test_a_worker_usage_error_is_reported_once_and_not_restarted() -> None:
    """A real `quicserve worker` child given a bad option (settings built in code skip `config
    check`) exits 2 before ready: one clear report naming the flag, no restart loop, and the reason
    on the supervisor for /readyz."""
    metrics, out = GatewayMetrics(), io.StringIO()
    ws = WorkersSettings(local=1, engine="synthetic", max_batch=0, restart_backoff_initial=0.05,
                         restart_backoff_max=0.05, ready_timeout=60.0)
    sup = WorkerSupervisor(ws, ModelPool(), metrics, ProgressDisplay("lines", out), connect=ConnectDouble())
    assert sup.failure is None
    sup.start()
    try:
        assert await sup.wait_ready(60) is False  # returns once no worker can become ready, not at the timeout
        failure = sup.failure
        assert failure is not None and failure.startswith("worker-0 exited with status 2 before it was ready")
        assert "--max-batch: must be >= 1, got 0" in failure
        await asyncio.sleep(0.3)  # several backoff periods: still one start
        assert sup.workers[0].starts == 1 and metrics.worker_restarts._value.get() == 0
        assert out.getvalue().count("not restarting it") == 1
    finally:
        await sup.stop()


async def test_a_crash_is_still_restarted_while_another_worker_has_stopped_for_good() -> None:
    """Only statuses a restart cannot fix stop a worker (exit 3 is restarted), and wait_ready waits
    for the worker that can still come up."""
    sup = WorkerSupervisor(WS, ModelPool(), GatewayMetrics(), connect=ConnectDouble(),
                           commands=[[sys.executable, FAKE, "--crash-before-ready"],
                                     [sys.executable, "-m", "gateway.cli", "worker", "--engine", "synthetic",
                                      "--kv-cache-dtype", "int4"]])
    sup.start()
    try:
        await wait_for(lambda: sup.workers[0].starts >= 3 and sup.failure is not None, 30)
        assert sup.failure is not None and sup.failure.startswith("worker-1 exited with status 2")
        assert "--kv-cache-dtype: invalid choice: 'int4'" in sup.failure
        assert sup.workers[0].failure is None
        assert await sup.wait_ready(0.2) is False  # worker-0 might still come up: wait to the timeout
    finally:
        await sup.stop()
