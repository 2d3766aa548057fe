"""The transport's TLS version and suites, with real processes: a ``quicserve serve`` and a
``quicserve worker`` with mutual TLS speak TLS 1.2 with ECDHE and an AEAD suite (the worker's log
says which), and the worker still serves a TLS 1.3-only gateway, as an earlier release's was
(transport/security.py: why the transport speaks 1.2). Helpers: test_transport_trust.py."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

from tests.integration.test_transport_trust import (
    PKI,
    Proc,
    completes_16_tokens,
    local,
    pki,
    procs,
    start_gateway,
    start_worker,
)

__all__ = ["pki", "procs"]  # the fixtures, used here by name


def test_gateway_and_worker_speak_tls_1_2_with_ecdhe_and_aead(pki: PKI, tmp_path: Path, procs: list[Proc]) -> None:
    worker = start_worker(tmp_path, "--listen", "tcp://0.0.0.0:0", *pki.worker.worker_flags())
    procs.append(worker)
    gateway = start_gateway(tmp_path, local(worker.url), pki.gateway.settings())
    procs.append(gateway)
    completes_16_tokens(gateway)
    line = worker.wait_log("TLS verified")
    assert "TLS verified (CN=gateway-1) over TLSv1.2 ECDHE-ECDSA-AES256-GCM-SHA384" in line, line


def test_a_worker_serves_a_tls_1_3_gateway(pki: PKI, tmp_path: Path, procs: list[Proc]) -> None:
    worker = start_worker(tmp_path, "--listen", "tcp://127.0.0.1:0", *pki.worker.worker_flags())
    procs.append(worker)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(pki.gateway.cert, pki.gateway.key)
    ctx.load_verify_locations(cafile=pki.gateway.ca)
    ctx.check_hostname = False
    host, port = worker.url.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw, ctx.wrap_socket(raw) as tls:
        assert tls.version() == "TLSv1.3"
        hello = tls.recv(4096)  # the worker's HELLO, sent to a verified gateway alone
        assert hello[:1] == b"\x01", hello  # wire version 1
    assert "TLS verified (CN=gateway-1) over TLSv1.3" in worker.wait_log("TLS verified")
