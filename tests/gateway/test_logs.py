"""Log formatters, the access log record, and the level that reaches the workers."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from gateway.observability.config import LogSettings
from gateway.observability.logs import (
    ACCESS_LOGGER,
    access_log,
    access_record,
    configure_logging,
)
from tests.integration.test_gateway_e2e import wait_ready

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def root_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def test_access_record_leaves_out_what_is_unknown() -> None:
    rec = access_record(method="POST", path="/v1/chat/completions", protocol="h2", status=200, duration_s=0.25,
                        request_id="r-7", model="tiny", ttft_s=0.0125, prompt_tokens=5, completion_tokens=0)
    assert rec == {"method": "POST", "path": "/v1/chat/completions", "protocol": "h2", "status": 200,
                   "duration_ms": 250.0, "ttft_ms": 12.5, "request_id": "r-7", "model": "tiny", "prompt_tokens": 5,
                   "completion_tokens": 0}


@pytest.mark.usefixtures("root_logging")
def test_access_log_through_the_configured_json_handler() -> None:
    out = io.StringIO()
    env: dict[str, str] = {}
    configure_logging("info", "json", stream=out, environ=env)
    assert env == {"QUICSERVE_LOG": "INFO", "QUICSERVE_LOG_FORMAT": "json"}
    access_log(method="GET", path="/v1/models", protocol="http/1.1", status=404, duration_s=0.001,
               request_id="r-9", trace_id="4bf92f3577b34da6a3ce929d0e0e4736", peer="10.0.0.9", error="not found")
    (line,) = out.getvalue().splitlines()
    obj = orjson.loads(line)
    assert obj["logger"] == ACCESS_LOGGER and obj["msg"] == "GET /v1/models http/1.1 404"
    assert obj["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736" and obj["status"] == 404 and obj["peer"] == "10.0.0.9"
    logging.getLogger(ACCESS_LOGGER).setLevel(logging.WARNING)  # access log off
    try:
        access_log(method="GET", path="/", protocol="h2", status=200, duration_s=0.0)
    finally:
        logging.getLogger(ACCESS_LOGGER).setLevel(logging.NOTSET)
    assert len(out.getvalue().splitlines()) == 1


def test_format_setting_is_checked() -> None:
    problems: list[str] = []
    LogSettings(format="xml")._validate(problems)
    LogSettings(format="json")._validate(problems)
    assert problems == ["log.format: 'xml' is not one of text, json"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("level", "worker_says_info"), [("warning", False), ("info", True)])
def test_the_gateway_log_level_reaches_the_worker(tmp_path: Path, level: str, worker_says_info: bool) -> None:
    """The worker logs "pinned to CPUs" at INFO: seen with --log-level info, not with warning."""
    cpu = min(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if k != "QUICSERVE_LOG"}
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--engine", "synthetic", "--port", "0", "--no-tls",
           "--grpc-port", "0", "--state-dir", str(tmp_path), "--progress", "off", "--log-level", level, "--worker-option", f"cpus={cpu}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(proc)  # type: ignore[arg-type]
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert ("pinned to CPUs" in err) is worker_says_info, err


def test_a_worker_logs_in_the_format_the_gateway_exports(tmp_path: Path) -> None:
    """configure_logging's environment, given to a worker: its lines come out as JSON objects."""
    env: dict[str, str] = {k: v for k, v in os.environ.items() if not k.startswith("QUICSERVE_LOG")}
    configure_logging("info", "json", stream=io.StringIO(), environ=env)
    logging.getLogger().handlers.clear()
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "worker", "--engine", "synthetic", "--numa-node", "4095"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=60)  # no such node: one error line
    (line,) = [orjson.loads(x) for x in r.stderr.splitlines()]  # every line is one JSON object
    assert line["logger"] == "inference.worker" and line["level"] == "error" and "NUMA node 4095" in line["msg"]
