"""sd_notify encoding, the watchdog environment, the readiness gate, and pings from the loop itself."""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid

import pytest

from gateway.observability.systemd import (
    ReadinessGate,
    SystemdNotifier,
    encode,
    required_models,
    socket_address,
    watchdog_interval,
)
from gateway.workers.config import WorkersSettings


def test_encode_and_abstract_address() -> None:
    assert encode(READY=1, STATUS="ready: tiny") == b"READY=1\nSTATUS=ready: tiny\n"
    assert encode(STATUS="two\nlines") == b"STATUS=two lines\n"  # a newline would start a bogus field
    assert socket_address("@quicserve/notify") == b"\0quicserve/notify"
    assert socket_address("/run/systemd/notify") == "/run/systemd/notify"


@pytest.mark.parametrize(("env", "pid", "want"), [
    ({"WATCHDOG_USEC": "30000000"}, 7, 15.0),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "7"}, 7, 15.0),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "8"}, 7, None),  # meant for another process
    ({"WATCHDOG_USEC": "0"}, 7, None),
    ({"WATCHDOG_USEC": "soon"}, 7, None),
    ({}, 7, None),
])
def test_watchdog_interval(env: dict[str, str], pid: int, want: float | None) -> None:
    assert watchdog_interval(env, pid) == want


def test_from_environ_hides_the_socket_from_children() -> None:
    env = {"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "42", "PATH": "/bin"}
    n = SystemdNotifier.from_environ(env, pid=42)
    try:
        assert n.enabled and n.address == b"\0x" and n.watchdog == 1.0
        assert env == {"PATH": "/bin"}
    finally:
        asyncio.run(n.close())
    off = SystemdNotifier.from_environ({}, pid=1)
    assert not off.enabled
    off.send(READY=1)  # no socket: nothing to do, no error


def test_required_models() -> None:
    assert required_models(WorkersSettings()) == {"tiny"}
    assert required_models(WorkersSettings(model="/models/Llama-3-8B")) == {"Llama-3-8B"}
    assert required_models(WorkersSettings(model="/models/x", served_name="chat")) == {"chat"}
    assert required_models(WorkersSettings(local=0, remote=["tcp://w:9000"])) == frozenset()


def test_readiness_gate_opens_once_when_every_required_model_is_ready() -> None:
    g = ReadinessGate({"a", "b"})
    assert not g.update([]) and g.waiting_for([]) == ["a", "b"]
    assert not g.update(["a", "c"]) and g.waiting_for(["a"]) == ["b"]
    assert g.update(["a", "b"]) and g.ready
    assert not g.update(["a", "b"])  # READY=1 is sent once
    anyone = ReadinessGate(())
    assert not anyone.update([]) and anyone.update(["m"])


class _Listener:
    """A NOTIFY_SOCKET bound in the abstract namespace. A unix datagram is queued by ``sendto``
    itself, so :meth:`drain` sees exactly what was sent before it is called."""

    def __init__(self) -> None:
        self.name = f"@quicserve-test-{uuid.uuid4().hex}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(socket_address(self.name))
        self.sock.setblocking(False)

    def drain(self) -> list[bytes]:
        out = []
        while True:
            try:
                out.append(self.sock.recv(4096))
            except BlockingIOError:
                return out


def test_pings_come_from_the_event_loop_and_stop_while_it_is_stuck() -> None:
    """A blocked loop sends no WATCHDOG=1, so systemd's timer runs out and restarts the service."""
    listener = _Listener()
    interval = 0.05
    ping = b"WATCHDOG=1\n"

    async def main() -> tuple[list[bytes], list[bytes], list[bytes]]:
        n = SystemdNotifier(socket_address(listener.name), watchdog=interval)
        ready: list[str] = []
        n.start({"tiny"}, lambda: ready)
        await asyncio.sleep(6 * interval)
        ready.append("tiny")
        await asyncio.sleep(6 * interval)
        before = listener.drain()
        time.sleep(10 * interval)  # the loop is stuck: no ping may be sent in here
        during = listener.drain()
        await asyncio.sleep(6 * interval)
        await n.close()
        return before, during, listener.drain()

    try:
        before, during, after = asyncio.run(main())
    finally:
        listener.sock.close()
    assert before.count(ping) >= 2 and ping in after, (before, after)
    assert during == []
    msgs = [d for d in before if d != ping]
    assert msgs[0].startswith(b"STATUS=starting workers; waiting for tiny")
    assert sum(m.startswith(b"READY=1\n") for m in msgs) == 1


def test_a_lost_socket_does_not_break_serving(caplog: pytest.LogCaptureFixture) -> None:
    n = SystemdNotifier(f"/nonexistent-{os.getpid()}/notify")
    n.send(READY=1)
    n.send(READY=1)
    assert sum("sd_notify" in r.message for r in caplog.records) == 1
    asyncio.run(n.close())
