"""systemd service notifications: READY/STATUS/STOPPING and the watchdog, without libsystemd.

How it works: the sd_notify protocol is one datagram of ``KEY=VALUE`` lines sent
to the ``AF_UNIX`` socket named by ``$NOTIFY_SOCKET`` (a leading ``@`` names the
abstract namespace). :class:`ReadinessGate` is the sans-I/O part: it is told
which models are ready and says when every required model has its first worker
(``READY=1``), and what to put in ``STATUS=`` meanwhile. :class:`SystemdNotifier`
sends the datagrams and runs one asyncio task that pings ``WATCHDOG=1`` every
half ``$WATCHDOG_USEC`` -- from the event loop itself, so a loop that is stuck
(a blocking call, a busy callback) stops pinging and systemd restarts the
service. Outside systemd (no ``$NOTIFY_SOCKET``) every call is a no-op.

serve.py hooks (one line each): ``notifier = SystemdNotifier.from_environ()``,
``notifier.progress_display(mode)`` as the supervisor's progress sink,
``notifier.start(required_models(settings.workers), pool.models)`` once the
supervisor runs, ``notifier.stopping()`` when the drain begins and
``await notifier.close()`` at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable, Iterable, MutableMapping

from ..workers.config import WorkersSettings, served_name_of
from .progress import ProgressDisplay

__all__ = ["ReadinessGate", "SystemdNotifier", "encode", "required_models", "socket_address",
           "watchdog_interval"]

log = logging.getLogger("quicserve.systemd")

READINESS_POLL = 0.5  # seconds between readiness checks besides the ones worker events trigger


def socket_address(name: str) -> str | bytes:
    """``$NOTIFY_SOCKET`` as a ``sendto`` address; ``@name`` is the abstract namespace (a leading NUL)."""
    if name.startswith("@"):
        return b"\0" + name[1:].encode()
    return name


def encode(**fields: str | int) -> bytes:
    """One notification datagram: ``KEY=VALUE`` lines (newlines in values would split a field)."""
    return "\n".join(f"{k}={str(v).replace(chr(10), ' ')}" for k, v in fields.items()).encode() + b"\n"


def watchdog_interval(environ: MutableMapping[str, str], pid: int) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings (half the timeout, as sd_watchdog_enabled(3) advises).

    None when the watchdog is off or meant for another process (``$WATCHDOG_PID``).
    """
    usec, for_pid = environ.get("WATCHDOG_USEC", ""), environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if for_pid and (not for_pid.isdigit() or int(for_pid) != pid):
        return None
    return int(usec) / 2e6


def required_models(*models: WorkersSettings) -> frozenset[str]:
    """Models that must have a ready worker before the service is READY (one ``[workers]`` settings
    per model served).

    Each model with local workers, under the name its workers announce (the served name,
    else the checkpoint directory's name); remote workers announce theirs only once
    connected, so with remote workers only, the first ready worker of any model counts.
    """
    return frozenset(served_name_of(ws) for ws in models if ws.local > 0)


class ReadinessGate:
    """Sans-I/O: opens once every required model has a ready worker (any model, if none is required)."""

    def __init__(self, required: Iterable[str]) -> None:
        self.required = frozenset(required)
        self.ready = False

    def update(self, ready_models: Iterable[str]) -> bool:
        """Feed the models that have a ready worker now; True exactly once, when the gate opens."""
        if self.ready:
            return False
        have = set(ready_models)
        self.ready = self.required <= have if self.required else bool(have)
        return self.ready

    def waiting_for(self, ready_models: Iterable[str]) -> list[str]:
        return sorted(self.required - set(ready_models))


class _NotifyingProgress(ProgressDisplay):
    """The supervisor's progress display, also reporting each line as ``STATUS=`` while loading."""

    def __init__(self, notifier: SystemdNotifier, mode: str) -> None:
        super().__init__(mode)
        self._notifier = notifier

    def progress(self, worker: str, stage: str, done: int, total: int, message: str = "") -> None:
        super().progress(worker, stage, done, total, message)
        if not self._notifier.gate.ready:
            count = f"{done}/{total}" if total else str(done)
            self._notifier.status(f"loading: {worker} {stage} {count} {message}".rstrip())

    def note(self, worker: str, text: str) -> None:
        super().note(worker, text)
        self._notifier.check_ready()  # a worker was just added to (or left) the pool
        if not self._notifier.gate.ready:
            self._notifier.status(f"{worker}: {text}")


class SystemdNotifier:
    """Sends sd_notify datagrams; no-op without ``$NOTIFY_SOCKET``."""

    def __init__(self, address: str | bytes | None, watchdog: float | None = None) -> None:
        self.address = address
        self.watchdog = watchdog
        self.gate = ReadinessGate(())
        self._ready_models: Callable[[], Iterable[str]] = tuple
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._failed = False
        if address is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.setblocking(False)

    @classmethod
    def from_environ(cls, environ: MutableMapping[str, str] | None = None,
                     pid: int | None = None) -> SystemdNotifier:
        """Read and remove ``NOTIFY_SOCKET``/``WATCHDOG_*`` (workers, our children, must not inherit them)."""
        env = os.environ if environ is None else environ
        pid = os.getpid() if pid is None else pid
        name = env.get("NOTIFY_SOCKET", "")
        watchdog = watchdog_interval(env, pid)
        for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
            env.pop(key, None)
        return cls(socket_address(name) if name else None, watchdog)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, **fields: str | int) -> None:
        if self._sock is None or self.address is None:
            return
        try:
            self._sock.sendto(encode(**fields), self.address)
        except OSError as e:  # systemd gone or queue full: the service keeps serving
            if not self._failed:
                log.warning("sd_notify to %r failed: %s", self.address, e)
            self._failed = True

    def status(self, text: str) -> None:
        self.send(STATUS=text)

    def stopping(self) -> None:
        self.send(STOPPING=1, STATUS="draining")

    def progress_display(self, mode: str) -> ProgressDisplay:
        """The supervisor's progress sink; it also feeds ``STATUS=`` and readiness checks."""
        return _NotifyingProgress(self, mode) if self.enabled else ProgressDisplay(mode)

    def check_ready(self) -> None:
        models = list(self._ready_models())
        if self.gate.update(models):
            self.send(READY=1, STATUS=f"ready: {', '.join(models)}", MAINPID=os.getpid())

    def start(self, required: Iterable[str], ready_models: Callable[[], Iterable[str]]) -> None:
        """Begin readiness checks and watchdog pings on the running loop."""
        if not self.enabled:
            return
        self.gate = ReadinessGate(required)
        self._ready_models = ready_models
        waiting = self.gate.required or {"a worker"}
        self.status(f"starting workers; waiting for {', '.join(sorted(waiting))}")
        self._task = asyncio.get_running_loop().create_task(self._run(), name="systemd notify")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_ping = loop.time()
        while True:
            now = loop.time()
            if self.watchdog is not None and now >= next_ping:
                self.send(WATCHDOG=1)
                next_ping = now + self.watchdog
            self.check_ready()
            if self.gate.ready and self.watchdog is None:
                return
            wait = READINESS_POLL if not self.gate.ready else float("inf")
            if self.watchdog is not None:
                wait = min(wait, max(0.0, next_ping - loop.time()))
            await asyncio.sleep(wait)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
