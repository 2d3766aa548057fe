"""A real ``quicserve serve`` from a config text, for the real-process tests: cleartext HTTP only
unless asked, its output read until it is ready, and (``models``) until every named model is
listed. Stop it with test_gateway_e2e.stop_gateway."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import httpx

from tests.integration.test_gateway_e2e import Gateway, stop_gateway, wait_ready

__all__ = ["serve_config"]

REPO = Path(__file__).resolve().parents[2]


def serve_config(state: Path, config: str, *, models: Iterable[str] = (), env: Mapping[str, str] | None = None,
                 args: Iterable[str] = ("--no-tls", "--grpc-port", "-1", "--quic-port", "-1"),
                 log_level: str = "error") -> Gateway:
    """``quicserve serve --config`` with ``config`` written to ``state``/config.toml (the state
    directory too); ``env`` adds to this process's environment."""
    state.mkdir(parents=True, exist_ok=True)
    (state / "config.toml").write_text(config)
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(state / "config.toml"), "--port", "0",
           *args, "--state-dir", str(state), "--progress", "lines", "--log-level", log_level]
    g = wait_ready(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True,
                                    env={**os.environ, "QUICSERVE_SHUTDOWN__GRACE_PERIOD": "0", **(env or {})}))
    wanted = set(models)
    deadline = time.monotonic() + 120
    try:
        while wanted and not wanted <= {m["id"] for m in httpx.get(g.http + "/v1/models").json()["data"]}:
            assert time.monotonic() < deadline, f"models never all ready: {wanted}"
            time.sleep(0.1)
    except BaseException:
        stop_gateway(g)  # not left running (with its workers) past the test that gave up on it
        raise
    return g
