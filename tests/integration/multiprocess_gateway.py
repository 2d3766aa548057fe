"""A real ``quicserve serve --processes N`` for the multi-process tests: its ports, its gateway
processes' pids (kept current: the output is read to the end), each process's own figures (the
snapshots the processes publish in the supervisor's runtime directory) and which process holds a
given TCP connection (from /proc)."""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.test_gateway_e2e import Gateway

__all__ = ["Fleet", "fleet_of", "process_figures", "until"]


def until(check: Callable[[], bool], timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what or check}"
        time.sleep(0.05)


@dataclass
class Fleet:
    gw: Gateway
    n: int
    ports: dict[str, int]
    runtime: Path
    pids: dict[int, int] = field(default_factory=dict)
    _reader: threading.Thread | None = None

    def follow(self) -> None:
        """Keep reading the supervisor's output (restarts name their new pid)."""
        for line in self.gw.lines:
            self._note(line)

        def read() -> None:
            assert self.gw.proc.stdout is not None
            for line in self.gw.proc.stdout:
                self.gw.lines.append(line)
                self._note(line)

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()

    def _note(self, line: str) -> None:
        if m := re.search(r"gateway process (\d+) started \(pid (\d+)\)", line):
            self.pids[int(m.group(1))] = int(m.group(2))

    def figures(self, index: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Process ``index``'s own figures, as of its last snapshot (a second old at most while
        /metrics is read: this scrape keeps them coming)."""
        with contextlib.suppress(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{self.ports['http']}/metrics", headers={"connection": "close"})
        return process_figures(self.runtime / f"metrics-{index}.prom")

    def owner_of(self, client_port: int) -> int:
        """The index of the gateway process holding the TCP connection from ``client_port``."""
        inode = _tcp_inode(client_port)
        for index, pid in self.pids.items():
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                        return index
                except OSError:
                    continue
        raise AssertionError(f"no gateway process holds the connection from port {client_port}")


def _tcp_inode(client_port: int) -> str:
    """The server side's socket inode of the loopback connection from ``client_port``."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for row in f:
                cols = row.split()
                remote, inode = cols[2], cols[9]
                if int(remote.rsplit(":", 1)[1], 16) == client_port and inode != "0":
                    return inode
    raise AssertionError(f"no connection from port {client_port}")


def process_figures(path: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    try:
        text = path.read_text()
    except OSError:
        return {}
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def fleet_of(gw: Gateway, n: int) -> Fleet:
    text = "".join(gw.lines)
    ports = {"http": int(re.search(r"listening on http://[^:]+:(\d+)", text).group(1)),  # type: ignore[union-attr]
             "runtime": 0}
    for name, pattern in (("tls", r"listening on https://[^:]+:(\d+) \(h2"), ("quic", r"listening on https://[^:]+:(\d+) \(h3"),
                          ("grpc", r"listening on grpc://[^:]+:(\d+)")):
        if m := re.search(pattern, text):
            ports[name] = int(m.group(1))
    runtime = Path(re.search(r"runtime (\S+)\)", text).group(1))  # type: ignore[union-attr]
    fleet = Fleet(gw, n, ports, runtime)
    fleet.follow()
    until(lambda: len(fleet.pids) == n, 5, "every process's pid")
    return fleet
