"""URL parsing, the rdma:// fallback chain with its one log line, and the probe report."""

from __future__ import annotations

import logging

import pytest

from transport.errors import RdmaUnavailable
from transport.probe import probe_report
from transport.select import BadURL, choose, parse_url


def test_parse_urls() -> None:
    assert parse_url("tcp://127.0.0.1:7000").port == 7000
    assert parse_url("tcp://[::1]:0").host == "::1"
    assert parse_url("unix:///tmp/x.sock").path == "/tmp/x.sock"
    assert parse_url("rdma://10.0.0.1:18515").scheme == "rdma"
    for bad in (
        "http://x:1",
        "tcp://x",
        "tcp://:5",
        "unix://relative",
        "tcp://x:99999",
        "x",
        "tcp://h:1/path",
    ):
        with pytest.raises(BadURL):
            parse_url(bad)


def test_rdma_falls_back_to_tcp_with_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="transport.select")
    choice = choose("rdma://127.0.0.1:7001", probe=lambda: (None, "no RDMA device (test)"))
    assert (choice.kind, choice.target.scheme, choice.target.port) == ("tcp", "tcp", 7001)
    lines = [r.getMessage() for r in caplog.records if r.name == "transport.select"]
    assert len(lines) == 1
    assert "falling back to tcp://127.0.0.1:7001" in lines[0] and "no RDMA device (test)" in lines[0]


def test_rdma_required_fails_clearly() -> None:
    with pytest.raises(RdmaUnavailable, match="required.*no RDMA device"):
        choose("rdma://127.0.0.1:7001", rdma_required=True, probe=lambda: (None, "no RDMA device"))


def test_rdma_uses_a_device_when_present(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="transport.select")
    choice = choose("rdma://127.0.0.1:7001", probe=lambda: ("rxe0", "soft-RoCE device rxe0"))
    assert (choice.kind, choice.device) == ("rdma", "rxe0")
    assert sum("using RDMA" in r.getMessage() for r in caplog.records) == 1


def test_real_probe_on_this_machine(caplog: pytest.LogCaptureFixture) -> None:
    """This machine has no RDMA device: the real probe falls back (and says why)."""
    from transport.rdma import list_devices

    if any(d.active for d in list_devices()):
        pytest.skip("machine has an RDMA device")
    caplog.set_level(logging.INFO, logger="transport.select")
    assert choose("rdma://127.0.0.1:7001").kind == "tcp"
    with pytest.raises(RdmaUnavailable):
        choose("rdma://127.0.0.1:7001", rdma_required=True)
    assert choose("tcp://127.0.0.1:1").kind == "tcp"  # no log line for plain schemes
    assert sum(r.name == "transport.select" for r in caplog.records) == 1


def test_probe_report_explains_soft_roce() -> None:
    report = probe_report()
    assert "pyverbs" in report and "RDMA device" in report
    from transport.rdma import list_devices

    if not any(d.active for d in list_devices()):
        assert "rdma link add rxe0 type rxe netdev" in report
