"""``quicserve serve`` under a real NOTIFY_SOCKET, the way systemd runs a ``Type=notify`` unit.

The test binds the datagram socket systemd would, starts the gateway with a synthetic
worker and ``WATCHDOG_USEC``/``WATCHDOG_PID`` set, and reads what arrives: STATUS lines
while the worker loads, READY=1 once it serves (``/readyz`` is 200 at that moment),
WATCHDOG=1 often enough that systemd's timer never runs out, STOPPING=1 on SIGTERM.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WATCHDOG_USEC = 1_000_000  # the unit's WatchdogSec, shortened so the test sees several pings
PING = b"WATCHDOG=1\n"


def _fields(datagram: bytes) -> dict[str, str]:
    return dict(line.split("=", 1) for line in datagram.decode().splitlines() if "=" in line)


def _recv_until(sock: socket.socket, key: str, timeout: float) -> list[tuple[float, bytes]]:
    got: list[tuple[float, bytes]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            d = sock.recv(4096)
        except TimeoutError:
            break
        got.append((time.monotonic(), d))
        if key in _fields(d):
            return got
    raise AssertionError(f"no {key} within {timeout} s: {got}")


@pytest.mark.timeout(180)
def test_notify_ready_watchdog_stopping(tmp_path: Path) -> None:
    path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    env = {**os.environ, "NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": str(WATCHDOG_USEC)}
    # systemd sets WATCHDOG_PID to the main process: the shell's pid is the gateway's after exec
    cmd = (f"WATCHDOG_PID=$$ exec {sys.executable} -m gateway.cli serve --engine synthetic --port 0 --no-tls --grpc-port 0"
           f" --state-dir {tmp_path} --progress lines --log-level warning")
    proc = subprocess.Popen(["sh", "-c", cmd], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.search(r"listening on (http://\S+)", line)
        assert m, line
        url = m.group(1)
        loading = _recv_until(sock, "READY", 120)
        with urllib.request.urlopen(url + "/readyz", timeout=10) as r:
            assert r.status == 200  # READY=1 means requests are served now
        ready = _fields(loading[-1][1])
        assert ready["MAINPID"] == str(proc.pid) and "tiny" in ready["STATUS"]
        statuses = [_fields(d)["STATUS"] for _, d in loading[:-1] if d != PING]
        assert statuses and statuses[0].startswith("starting workers"), statuses
        assert any("worker-0" in s for s in statuses), statuses  # the worker's own start-up lines

        # the watchdog: pings every WATCHDOG_USEC/2, never a gap systemd would act on
        window = 4 * WATCHDOG_USEC / 1e6
        t0 = time.monotonic()
        pings = [t for t, d in loading if d == PING]
        while time.monotonic() - t0 < window:
            sock.settimeout(window)
            d = sock.recv(4096)
            assert d == PING, d  # nothing else is said while serving
            pings.append(time.monotonic())
        gaps = [b - a for a, b in zip(pings, pings[1:], strict=False)]
        assert len(gaps) >= window / (WATCHDOG_USEC / 1e6), gaps
        assert max(gaps) < WATCHDOG_USEC / 1e6, gaps
        assert min(gaps) > WATCHDOG_USEC / 1e6 / 4, gaps  # paced, not a busy loop

        proc.send_signal(signal.SIGTERM)
        stopping = _recv_until(sock, "STOPPING", 30)
        assert _fields(stopping[-1][1])["STOPPING"] == "1"
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sock.close()
