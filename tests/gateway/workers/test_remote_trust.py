"""Default deny at start: a remote worker URL beyond loopback with neither mutual TLS nor a pre-shared
key is a configuration problem (``quicserve serve`` and ``config check`` refuse it, naming the URL and
what to set), unless ``insecure`` says so on purpose."""

from __future__ import annotations

import pytest

from gateway.workers.config import WorkersSettings


def _problems(**kw: object) -> list[str]:
    p: list[str] = []
    WorkersSettings(local=0, **kw)._validate(p)  # type: ignore[arg-type]
    return p


@pytest.mark.parametrize("url", ["tcp://10.0.0.9:7000", "tcp://quicserve-worker-0.svc:7000", "tcp://[fd00::1]:7000",
                                 "rdma://10.0.0.9:7000"])
def test_an_unauthenticated_remote_worker_is_refused(url: str) -> None:
    (problem,) = _problems(remote=[url])
    assert problem.startswith("workers.remote: refusing to connect to the worker at ")
    assert url.split("://")[1].strip("[]").split("]")[0].split(":")[0] in problem
    for needed in ("transport_tls_cert", "transport_tls_key", "transport_tls_ca", "transport_psk_file", "insecure"):
        assert needed in problem


@pytest.mark.parametrize("kw", [{"transport_psk_file": "/run/credentials/quicserve/psk"},
                                {"transport_tls_cert": "c", "transport_tls_key": "k", "transport_tls_ca": "a"},
                                {"insecure": True}], ids=["psk", "tls", "insecure"])
def test_authenticated_or_explicitly_insecure_remotes_pass(kw: dict[str, object]) -> None:
    assert _problems(remote=["tcp://10.0.0.9:7000"], **kw) == []


@pytest.mark.parametrize("url", ["tcp://127.0.0.1:7000", "tcp://localhost:7000", "tcp://[::1]:7000",
                                 "unix:///run/quicserve/w.sock"])
def test_loopback_and_unix_need_nothing(url: str) -> None:
    assert _problems(remote=[url]) == []
