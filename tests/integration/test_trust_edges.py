"""The edges of the trust boundaries (#36), each through a real ``quicserve serve``: /metrics on a
listener of its own (``[observability] metrics_listen``) and 404 on the public one; gRPC ListModels
behind the API key like ``GET /v1/models`` (grpcio, the official client); a remote worker URL
without transport authentication refused at start."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from gateway.admission.keys import hash_key
from gateway.grpc.quicserve.v1 import quicserve_pb2 as pb
from tests.integration.serve_process import REPO, serve_config
from tests.integration.test_gateway_e2e import Gateway, stop_gateway

pytestmark = pytest.mark.timeout(120)

KEY = "sk-trust-edges-0123456789"
CONFIG = f"""
[workers]
engine = "synthetic"

[admission]
keys = ["ops:{hash_key(KEY)}"]

[observability]
metrics_listen = "127.0.0.1:0"
"""


def _line(gw: Gateway, pattern: str) -> str:
    found = [m.group(1) for line in gw.lines if (m := re.search(pattern, line))]
    assert found, f"no line matches {pattern!r}: {gw.lines}"
    return found[-1]


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    g = serve_config(tmp_path_factory.mktemp("edges"), CONFIG, args=("--no-tls", "--grpc-port", "0", "--quic-port", "-1"))
    try:
        yield g
    finally:
        stop_gateway(g)


def _list_models(target: str, metadata: tuple[tuple[str, str], ...]) -> list[str]:
    with grpc.insecure_channel(target) as ch:
        call = ch.unary_unary("/quicserve.v1.Inference/ListModels", request_serializer=lambda m: m.SerializeToString(),
                              response_deserializer=pb.ListModelsResponse.FromString)
        return [m.id for m in call(pb.ListModelsRequest(), metadata=metadata, timeout=10).models]


def test_metrics_are_served_on_their_own_listener_only(gw: Gateway) -> None:
    scrape = _line(gw, r"metrics on (http://\S+)/metrics")
    assert scrape != gw.http
    r = httpx.get(scrape + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "quicserve_requests_in_flight" in r.text
    assert httpx.get(scrape + "/v1/models").status_code == 404  # that listener serves nothing else
    assert httpx.post(scrape + "/metrics").status_code == 405
    public = httpx.get(gw.http + "/metrics")
    assert public.status_code == 404 and public.json()["error"]["code"] == "unknown_url"
    assert httpx.get(gw.http + "/healthz").status_code == 200  # the probes stay where they were
    # what the public listener counts shows on the scrape
    httpx.post(gw.http + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2},
               headers={"authorization": f"Bearer {KEY}"}).raise_for_status()
    assert 'route="/v1/completions"' in httpx.get(scrape + "/metrics").text


def test_grpc_list_models_needs_the_key(gw: Gateway) -> None:
    target = _line(gw, r"listening on grpc://(\S+)")
    for metadata in ((), (("authorization", "Bearer sk-wrong"),)):
        with pytest.raises(grpc.RpcError) as err:
            _list_models(target, metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "API key" in (err.value.details() or "")
    deadline = time.monotonic() + 60
    while (models := _list_models(target, (("authorization", f"Bearer {KEY}"),))) != ["tiny"]:
        assert time.monotonic() < deadline, models
        time.sleep(0.1)


def test_a_remote_worker_without_authentication_is_refused_at_start(tmp_path: Path) -> None:
    config = '[workers]\nengine = "synthetic"\nlocal = 0\nremote = ["tcp://10.255.0.9:7000"]\n'
    (tmp_path / "config.toml").write_text(config)
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(tmp_path / "config.toml"), "--port", "0",
           "--no-tls", "--grpc-port", "-1", "--quic-port", "-1", "--state-dir", str(tmp_path), "--progress", "off"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "tcp://10.255.0.9:7000" in out and "transport_tls_cert" in out and "transport_psk_file" in out, out
    assert "insecure" in out, out
    assert "listening on" not in out  # refused before anything was opened
    # the explicit opt-out: starts (the worker is unreachable, which is another matter)
    (tmp_path / "config.toml").write_text(config + "insecure = true\n")
    with subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        assert p.stdout is not None
        first = p.stdout.readline()
        p.terminate()
        p.wait(30)
    assert "listening on" in first, first
