"""Who may talk to a worker, with real processes: a ``quicserve worker`` with mutual TLS or a
pre-shared key serves a ``quicserve serve`` holding the right credentials and refuses the others,
each refusal one clear log line on both sides; a worker beyond loopback without authentication
does not start, and a gateway will not connect to one.

Certificates are made here (tests/transport/certs.py: a CA, gateways' leaves with clientAuth,
workers' with serverAuth). Gateways start side by side (each needs a couple of seconds) and
are stopped at the end of each test.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.transport.certs import TestCA, write_psk

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "QUICSERVE_SHUTDOWN__GRACE_PERIOD": "0"}


@dataclass
class Proc:
    """A process whose stderr (the log) goes to a file we read while it runs."""

    proc: subprocess.Popen[str]
    log: Path
    url: str = ""
    out: list[str] = field(default_factory=list)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_log(self, needle: str, timeout: float = 30.0) -> str:
        """The first log line holding ``needle`` (fails after ``timeout`` with the whole log)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.text().splitlines():
                if needle in line:
                    return line
            time.sleep(0.05)
        raise AssertionError(f"no log line with {needle!r} in:\n{self.text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_worker(tmp: Path, *flags: str) -> Proc:
    """``quicserve worker --engine synthetic``; returns once it is ready (its URL in ``url``)."""
    log = tmp / f"worker-{time.monotonic_ns()}.log"
    cmd = [sys.executable, "-m", "gateway.cli", "worker", "--engine", "synthetic", *flags]
    p = Proc(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env=ENV), log)
    assert p.proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = p.proc.stdout.readline()
        if not line:
            break
        ev = json.loads(line)
        if ev["event"] == "ready":
            p.url = ev["url"]
            return p
    raise AssertionError(f"worker not ready (exit {p.proc.poll()}):\n{p.text()}")


def start_gateway(tmp: Path, worker_url: str, workers: Mapping[str, str] | None = None) -> Proc:
    """``quicserve serve`` with no local worker, connecting to ``worker_url`` with these [workers]
    settings; returns once it listens (its HTTP URL in ``url``), ready or not."""
    state = tmp / f"gw-{time.monotonic_ns()}"
    state.mkdir()
    log = state / "gateway.log"
    env = {**ENV, **{f"QUICSERVE_WORKERS__{k.upper()}": v for k, v in (workers or {}).items()}}
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--workers", "0", "--worker-url", worker_url, "--port", "0",
           "--no-tls", "--grpc-port", "-1", "--quic-port", "-1", "--state-dir", str(state), "--progress", "off",
           "--log-level", "info"]
    p = Proc(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env=env), log)
    assert p.proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = p.proc.stdout.readline()
        if not line:
            break
        p.out.append(line)
        if m := re.search(r"listening on (http://\S+)", line):
            p.url = m.group(1)
            return p
    raise AssertionError(f"gateway did not start (exit {p.proc.poll()}):\n{p.text()}")


def completes_16_tokens(gw: Proc) -> None:
    deadline = time.monotonic() + 30
    while httpx.get(gw.url + "/readyz").status_code != 200:
        assert time.monotonic() < deadline, gw.text()
        time.sleep(0.05)
    r = httpx.post(gw.url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 16,
                                                      "ignore_eos": True}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16


def not_ready(gw: Proc) -> None:
    r = httpx.get(gw.url + "/readyz")
    assert r.status_code == 503, r.text


class PKI:
    def __init__(self, root: Path) -> None:
        self.ca = TestCA(root / "ca")
        self.other = TestCA(root / "other", "another transport CA")
        self.worker = self.ca.issue("worker-1", "worker")
        self.gateway = self.ca.issue("gateway-1", "gateway")
        self.foreign = self.other.issue("gateway-x", "gateway")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return PKI(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in started:
        p.stop()


def local(url: str) -> str:
    """The worker listens on every address; gateways reach it on loopback."""
    return url.replace("0.0.0.0", "127.0.0.1")


def test_mutual_tls_serves_the_right_gateway_and_refuses_the_others(pki: PKI, tmp_path: Path, procs: list[Proc]
                                                                     ) -> None:
    worker = start_worker(tmp_path, "--listen", "tcp://0.0.0.0:0", *pki.worker.worker_flags())
    procs.append(worker)
    assert worker.wait_log("(transport authentication: mutual TLS)")
    url = local(worker.url)
    right = start_gateway(tmp_path, url, pki.gateway.settings())
    plain = start_gateway(tmp_path, url)
    foreign = start_gateway(tmp_path, url, {**pki.foreign.settings(), "transport_tls_ca": str(pki.ca.ca_file)})
    procs += [right, plain, foreign]

    completes_16_tokens(right)
    assert "TLS verified (CN=gateway-1)" in worker.wait_log("TLS verified")

    # plain TCP: the worker says so, and tells the gateway in a plain ERROR frame, which it logs
    assert "the gateway spoke plain TCP and this worker requires mutual TLS" in worker.wait_log("spoke plain TCP")
    line = plain.wait_log("this worker requires mutual TLS and the gateway connected in plain TCP")
    assert "WARNING" in line and url in line and "transport_tls_cert" in line
    # a certificate from another CA
    line = worker.wait_log("does not verify against this worker's transport_tls_ca")
    assert "TLS handshake with the gateway at 127.0.0.1:" in line
    assert "the worker refused this gateway's certificate" in foreign.wait_log("refused this gateway's certificate")
    # a TLS client with no certificate at all (not a configuration quicserve accepts: a hand-made client)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cafile=pki.worker.ca)
    ctx.check_hostname = False
    host, port = url.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw, ctx.wrap_socket(raw) as tls:
        with pytest.raises((ssl.SSLError, ConnectionError)):
            tls.sendall(b"\x01" * 12)
            assert tls.recv(100) == b""  # no HELLO: the worker closes instead
            raise ConnectionError("closed")
    assert "the gateway presented no certificate" in worker.wait_log("presented no certificate")
    for gw in (plain, foreign):
        not_ready(gw)
    completes_16_tokens(right)  # the refusals cost the served gateway nothing


def test_pre_shared_key_serves_the_right_gateway_and_refuses_the_others(tmp_path: Path, procs: list[Proc]) -> None:
    key = write_psk(tmp_path / "transport.psk")
    wrong = write_psk(tmp_path / "other.psk", "a different key of the same length!")
    worker = start_worker(tmp_path, "--listen", "tcp://0.0.0.0:0", f"--transport-psk-file={key}")
    procs.append(worker)
    url = local(worker.url)
    right = start_gateway(tmp_path, url, {"transport_psk_file": key})
    none = start_gateway(tmp_path, url)
    other = start_gateway(tmp_path, url, {"transport_psk_file": wrong})
    procs += [right, none, other]

    completes_16_tokens(right)
    assert "this worker requires a pre-shared key and the gateway offered none" in worker.wait_log("offered none")
    assert "the worker requires a pre-shared key and this gateway has none" in none.wait_log("this gateway has none")
    assert "refused the gateway at 127.0.0.1:" in worker.wait_log("the gateway's proof does not match")
    assert "the worker's proof does not match this side's key" in other.wait_log("proof does not match")
    for gw in (none, other):
        not_ready(gw)
    completes_16_tokens(right)


def test_a_worker_beyond_loopback_without_authentication_does_not_start(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "worker", "--engine", "synthetic", "--listen",
                        "tcp://0.0.0.0:0"], cwd=REPO, capture_output=True, text=True, env=ENV, timeout=60)
    assert r.returncode == 2  # a usage error: the supervisor does not restart it
    (fatal,) = [json.loads(line) for line in r.stdout.splitlines()]
    assert fatal["event"] == "fatal"
    said = fatal["message"]
    assert "--listen: refusing to listen on tcp://0.0.0.0:0 without transport authentication" in said
    for what in ("--transport-tls-cert", "--transport-tls-key", "--transport-tls-ca", "--transport-psk-file",
                 "--insecure"):
        assert what in said
    assert "refusing to listen" in r.stderr
    # the same worker, told to, starts
    ok = start_worker(tmp_path, "--listen", "tcp://0.0.0.0:0", "--insecure")
    assert "(transport authentication: none)" in ok.wait_log("listening on")
    ok.stop()


def test_a_gateway_will_not_connect_to_an_unauthenticated_remote_worker(tmp_path: Path) -> None:
    """Refused at start (a configuration problem: exit 2), before any listener or connection."""
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--workers", "0", "--worker-url", "tcp://10.255.255.1:7000",
           "--port", "0", "--no-tls", "--grpc-port", "-1", "--quic-port", "-1", "--state-dir", str(tmp_path),
           "--progress", "off"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=ENV, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    said = r.stdout + r.stderr
    assert "refusing to connect to the worker at tcp://10.255.255.1:7000 without transport authentication" in said
    assert "transport_psk_file" in said and "listening on" not in said
