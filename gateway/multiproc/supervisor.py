"""``[server] processes = N``: one supervisor, N gateway processes, one local worker pool.

How it works: the supervisor binds every listener once per process (:mod:`.bind`: SO_REUSEPORT
groups for TCP, TLS, gRPC and QUIC, whose group steers by connection ID; one Unix socket for all),
starts the local workers itself (the usual :class:`~gateway.workers.supervisor.WorkerSupervisor`,
whose connections only watch them) and then N ``quicserve serve`` processes, each with its own
sockets (``pass_fds``) and a control socket. Over the control socket a process hears the shared
secret its session tickets are sealed under and the local workers' URLs whenever they change; it
connects to each (a worker serves any number of gateway connections), and to remote workers by
itself. A process's ``ready`` line counts; once every one has said it, the supervisor says it.

Signals fan out: SIGTERM/SIGINT go to every process, which drain as one would alone; once all
have exited the workers stop. SIGHUP goes to every process (keys, rules, rollouts reload). A
process that exits on its own is started again (with backoff) on the same sockets: the
supervisor holds them open, so its QUIC socket keeps its place in the steering group and the
datagrams and connections queued meanwhile wait for it; only the connections it held are lost.
The workers and the other processes never notice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import replace
from typing import Any, TextIO

import orjson

from ..http.tls import load_or_create_tls
from ..observability.metrics import GatewayMetrics
from ..observability.systemd import SystemdNotifier, required_models
from ..routing.pool import ModelPool
from ..settings import Settings, state_dir
from ..workers.process import Backoff, child_setup
from ..workers.supervisor import WorkerSupervisor
from .bind import ListenerGroups
from .local_store import LocalStore
from .process import PROCESS_ENV

__all__ = ["run_processes"]

log = logging.getLogger("quicserve.processes")


class _PublishingPool(ModelPool):
    """The supervisor's pool: not served from, it tells the processes which workers are up."""

    def __init__(self, publish: Any) -> None:
        super().__init__()
        self.urls: dict[int, str] = {}  # id(conn) -> the URL it was reached at
        self._publish = publish

    def add(self, conn: Any, models: Any = None) -> None:
        super().add(conn, models)
        self._publish()

    def remove(self, conn: Any) -> None:
        super().remove(conn)
        self.urls.pop(id(conn), None)
        self._publish()


class _Process:
    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: asyncio.subprocess.Process | None = None
        self.control: asyncio.StreamWriter | None = None
        self.ready = False
        self.starts = 0


class GatewayProcesses:
    """The supervisor of ``n`` gateway processes (see the module docstring)."""

    def __init__(self, settings: Settings, argv: list[str], n: int, out: TextIO) -> None:
        self.settings, self.argv, self.n, self.out = settings, argv, n, out
        self.groups = ListenerGroups(n)
        self.procs = [_Process(i) for i in range(n)]
        self.stopping = False
        self.announced = False
        self.secret = os.urandom(32)  # session tickets: every process seals and opens under it
        self.runtime = tempfile.mkdtemp(prefix="quicserve-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.store = LocalStore(settings, self.runtime)
        self.pool = _PublishingPool(self._publish)
        self.workers: WorkerSupervisor | None = None
        self.notifier = SystemdNotifier.from_environ()  # and out of the environment the processes inherit

    def _say(self, text: str) -> None:
        self.out.write(f"quicserve: {text}\n")
        self.out.flush()

    def bind(self) -> None:
        """Every listener, as ``quicserve serve`` would open them, announced the same way."""
        s, srv = self.settings, self.settings.server
        g = self.groups
        port = g.bind("port", "tcp", srv.host, srv.port)
        self._say(f"listening on http://{_hostport(srv.host, port)} (HTTP/1.1, h2c)")
        if srv.tls_port >= 0:
            _, fingerprint = load_or_create_tls(srv.tls_cert or None, srv.tls_key or None, state_dir(s))
            if s.quic.port >= 0:
                q = g.bind("quic_port", "udp", srv.host, s.quic.port)
                self._say(f"listening on https://{srv.host}:{q} (h3, UDP)")
            t = g.bind("tls_port", "tcp", srv.host, srv.tls_port)
            self._say(f"listening on https://{_hostport(srv.host, t)} (h2, HTTP/1.1) cert sha256 {fingerprint}")
        if srv.unix_socket:
            g.bind_unix(os.path.expanduser(srv.unix_socket))
            self._say(f"listening on unix:{g.unix_path} (HTTP/1.1, h2c)")
        if s.grpc.port >= 0:
            host = s.grpc.host or srv.host
            self._say(f"listening on grpc://{_hostport(host, g.bind('grpc_port', 'tcp', host, s.grpc.port))} "
                      "(gRPC, h2c)")

    def _flags(self) -> list[str]:
        """The processes' command line: ours, with every port as bound."""
        p, flags = self.groups.ports, ["--port", str(self.groups.ports["port"])]
        flags += ["--tls-port", str(p["tls_port"])] if "tls_port" in p else ["--no-tls"]
        flags += ["--quic-port", str(p.get("quic_port", -1)), "--grpc-port", str(p.get("grpc_port", -1))]
        return [sys.executable, "-m", "gateway.cli", *self.argv, *flags]

    def _hello(self) -> dict[str, Any]:
        return {"secret": self.secret.hex(), "runtime": self.runtime, "redis_url": self.store.url,
                "workers": sorted(set(self.pool.urls.values()))}

    def _publish(self) -> None:
        line = orjson.dumps({"workers": sorted(set(self.pool.urls.values()))}) + b"\n"
        for p in self.procs:
            if p.control is not None and not p.control.is_closing():
                p.control.write(line)

    async def _connect(self, url: str, **kw: Any) -> Any:
        from transport.client import connect

        conn = await connect(url, **kw)
        self.pool.urls[id(conn)] = url
        return conn

    async def _run_one(self, p: _Process) -> None:
        """Start process ``p`` and restart it whenever it exits, until stopping."""
        backoff = Backoff(0.2, 10.0)
        loop = asyncio.get_running_loop()
        while not self.stopping:
            ours, theirs = socket.socketpair()
            inherited = self.groups.inherited_by(p.index)
            env = {**os.environ, PROCESS_ENV: orjson.dumps({
                "index": p.index, "of": self.n, "control": theirs.fileno(), "sockets": inherited}).decode()}
            t0 = loop.time()
            p.starts += 1
            p.proc = await asyncio.create_subprocess_exec(
                *self._flags(), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, env=env,
                pass_fds=[theirs.fileno(), *(fd for _, _, fd in inherited)], start_new_session=True,
                preexec_fn=child_setup)
            theirs.close()
            self._say(f"gateway process {p.index} started (pid {p.proc.pid})")
            _, p.control = await asyncio.open_connection(sock=ours)
            p.control.write(orjson.dumps(self._hello()) + b"\n")
            assert p.proc.stdout is not None
            relay = asyncio.create_task(self._relay(p, p.proc.stdout))
            rc = await p.proc.wait()
            await asyncio.wait([relay], timeout=1.0)
            p.control.close()
            p.control, p.ready = None, False
            if self.stopping:
                return
            delay = backoff.next_delay(loop.time() - t0)
            self._say(f"gateway process {p.index} exited with status {rc}; restarting it in {delay:.1f} s")
            await asyncio.sleep(delay)

    async def _relay(self, p: _Process, stdout: asyncio.StreamReader) -> None:
        """A process's lines, said once for the gateway (listening, ready, stopped) or tagged."""
        async for raw in stdout:
            text = raw.decode(errors="replace").rstrip("\n").removeprefix("quicserve: ")
            if text.startswith(("listening on ", "stopped")):
                continue
            if text.startswith("ready"):
                p.ready = True
                if not self.announced and all(q.ready for q in self.procs):
                    self.announced = True
                    self._say(f"ready ({self.n} gateway processes; {text.removeprefix('ready (').rstrip(')')})")
                continue
            self._say(f"process {p.index}: {text}")

    def _signal_all(self, sig: signal.Signals) -> None:
        for p in self.procs:
            if p.proc is not None and p.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    p.proc.send_signal(sig)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        def on_stop(sig: signal.Signals) -> None:
            if not self.stopping:
                self.notifier.stopping()
            self.stopping = True
            self._signal_all(sig)  # a second one reaches them too: they skip what is left of the drain
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_stop, sig)
        loop.add_signal_handler(signal.SIGHUP, self._signal_all, signal.SIGHUP)
        try:
            self.bind()
            await self.store.start()
            for warning in [*self.groups.warnings, *([self.store.warning] if self.store.warning else [])]:
                log.warning("%s", warning)
                self._say(warning)
            s = self.settings
            models = [m.worker_settings() for m in s.served()] if s.models else [s.workers]
            models = [replace(m, remote=[]) for m in models]  # remote workers: each process connects itself
            self.workers = WorkerSupervisor(models, self.pool, GatewayMetrics(),
                                            self.notifier.progress_display(s.log.progress), connect=self._connect)
            self.workers.start()
            # systemd hears the supervisor alone (the processes do not inherit NOTIFY_SOCKET): ready once
            # every process is, watchdog pings from this loop
            self.notifier.start(required_models(*models),
                                lambda: self.pool.models() if all(p.ready for p in self.procs) else ())
            self._say(f"{self.n} gateway processes over one worker pool (runtime {self.runtime})")
            tasks = [asyncio.create_task(self._run_one(p)) for p in self.procs]
            await stop.wait()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self.stopping = True
            self._signal_all(signal.SIGTERM)
            for p in self.procs:
                if p.proc is not None:
                    with contextlib.suppress(Exception):
                        await p.proc.wait()
            if self.workers is not None:
                await self.workers.stop()
            await self.store.stop()
            await self.notifier.close()
            self.groups.close()
            shutil.rmtree(self.runtime, ignore_errors=True)
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            self._say("stopped")
        return 0


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def run_processes(settings: Settings, argv: list[str], n: int) -> int:
    """Supervise ``n`` gateway processes until SIGTERM/SIGINT; the exit status."""
    from ..observability.logs import configure_logging

    configure_logging(settings.log.level, settings.log.format)
    try:
        return asyncio.run(GatewayProcesses(settings, argv, n, sys.stdout).run())
    except OSError as e:
        print(f"quicserve: cannot start: {e}", file=sys.stderr)
        return 1
