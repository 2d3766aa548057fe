"""Start, watch, restart and stop workers; keep the model pool in sync.

How it works: each local worker is a child process (``python -m gateway.cli
worker ...``, i.e. ``quicserve worker``) in its own session. Its stdout is
JSON lines: ``progress`` events go to the :class:`ProgressDisplay`, one
``ready`` event carries the transport URL, which we connect to and add to the
:class:`ModelPool`. When the process exits or its connection dies we take it
out of the pool and start it again after a :class:`Backoff` delay (doubling
per consecutive failure, reset once a worker has stayed up a while), unless it
exited before ready with a status restarting cannot fix (a usage or
configuration error, :data:`~transport.common.worker_options.PERMANENT_EXITS`): that
worker is reported once, stays down, and :attr:`WorkerSupervisor.failure` says
why (the worker's ``fatal`` event names the bad option). Remote
workers (by URL) get the same treatment minus the process. :meth:`stop` takes
every worker out of the pool, closes connections, SIGTERMs the children and
SIGKILLs any that outlive ``stop_timeout``. Every start-up is logged per model
(:class:`~gateway.workers.startup.StartupLog`: spawn to ready as measured here, the phases the worker
reports); :meth:`WorkerSupervisor.start_replica` and :meth:`WorkerSupervisor.retire` are how an
elastic pool (:mod:`gateway.workers.elastic_pool`) grows and shrinks a model's local replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson

from transport.api import WorkerConnection
from transport.common.worker_options import PERMANENT_EXITS
from transport.errors import SecurityConfigError
from transport.security import security_of

from .. import clock
from ..observability.metrics import GatewayMetrics
from ..observability.progress import ProgressDisplay
from ..routing.pool import ModelPool
from .config import WorkersSettings
from .process import Backoff, WorkerUnusable, child_setup, terminate, worker_command
from .startup import PHASES, StartupLog

__all__ = ["Backoff", "WorkerSupervisor", "LocalWorker", "RemoteWorker", "WorkerUnusable", "worker_command",
           "Connector"]

log = logging.getLogger("quicserve.workers")

Connector = Callable[..., Awaitable[WorkerConnection]]

def _default_connector() -> Connector:
    from transport.client import connect  # imported late so tests can run without it

    return connect


class _Worker:
    """Shared loop: run once, then restart with backoff until stopped."""

    name: str

    def __init__(self, sup: WorkerSupervisor, ws: WorkersSettings) -> None:
        self.sup = sup
        self.ws = ws  # its model's [workers] settings (timeouts, backoff, options)
        self.conn: WorkerConnection | None = None
        self.ready_once = asyncio.Event()
        self.failure: str | None = None  # why it stopped for good (never restarted), if it did
        self.starts = 0
        self.stopping = False
        self.task: asyncio.Task[None] | None = None

    async def run_once(self) -> None:
        raise NotImplementedError

    async def loop(self) -> None:
        backoff = Backoff(self.ws.restart_backoff_initial, self.ws.restart_backoff_max)
        while not self.stopping:
            t0 = clock.now()
            self.starts += 1
            try:
                await self.run_once()
                why = "exited"
            except asyncio.CancelledError:
                raise
            except WorkerUnusable as e:  # bad options: a restart would fail the same way
                self.failure = why = str(e)
            except Exception as e:  # noqa: BLE001 - any failure means "restart it"
                why = f"failed: {e}"
                log.debug("%s failed", self.name, exc_info=True)
            finally:
                await self._release()
            if self.stopping:
                return
            if self.failure is not None:
                self.sup.progress.note(self.name, f"{self.failure}; not restarting it")
                log.error("%s %s; not restarting it (fix the [workers] settings)", self.name, self.failure)
                self.sup.changed.set()
                return
            delay = backoff.next_delay(clock.now() - t0)
            self.sup.metrics.worker_restarts.inc()
            self.sup.progress.note(self.name, f"{why}; restarting in {delay:.1f} s")
            log.warning("%s %s; restarting in %.1f s", self.name, why, delay)
            await asyncio.sleep(delay)

    async def attach(self, url: str, models: Sequence[str] | None, started: float | None = None,
                     phases: Sequence[float] = ()) -> WorkerConnection:
        """Connect to the worker at ``url`` and add it to the pool (``started``: when a local one was
        spawned, on the request clock; ``phases``: its start-up as its ready event told it)."""
        ws = self.ws
        try:  # the [workers] transport_* keys: TLS, the pre-shared key, default deny (transport/security.py)
            conn = await self.sup.connect(url, identity=self.sup.identity, timeout=ws.connect_timeout,
                                          heartbeat_interval=ws.heartbeat_interval, dead_after=ws.dead_after,
                                          security=security_of(ws))
        except SecurityConfigError as e:  # our own settings refuse it: a reconnect would too
            raise WorkerUnusable(str(e)) from None
        self.conn = conn
        served = list(models) if models else list(conn.peer_hello.models)
        self.sup.pool.add(conn, served)
        model = served[0] if served else ""
        if started is not None:
            self.sup.startup.ready(model, clock.now() - started, phases or conn.peer_hello.startup)
        else:
            self.sup.startup.reported(model, conn.peer_hello.startup)
        for hook in self.sup.on_ready:
            hook(self, conn)
        self.sup.progress.note(self.name, f"ready at {url} serving {', '.join(served)}")
        self.ready_once.set()
        self.sup.changed.set()
        return conn

    async def _release(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            self.sup.pool.remove(conn)
            with contextlib.suppress(Exception):
                await conn.close()

    async def stop(self) -> None:
        self.stopping = True


Worker = _Worker  # what other modules name one supervised worker by (reload retires them)


class LocalWorker(_Worker):
    def __init__(self, sup: WorkerSupervisor, ws: WorkersSettings, index: int, argv: list[str]) -> None:
        super().__init__(sup, ws)
        self.name = f"worker-{index}"
        self.argv = argv
        self.proc: asyncio.subprocess.Process | None = None
        self.models: list[str] = []
        self.fatal = ""  # the message of the worker's last ``fatal`` event

    async def run_once(self) -> None:
        ws = self.ws
        started = clock.now()
        self.proc = proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, limit=1 << 20,
            start_new_session=True, preexec_fn=child_setup)
        assert proc.stdout is not None
        self.sup.progress.note(self.name, f"starting (pid {proc.pid}): {' '.join(self.argv[3:])}")
        try:
            ready = await asyncio.wait_for(self._read_until_ready(proc.stdout), ws.ready_timeout)
        except TimeoutError:
            raise RuntimeError(f"not ready after {ws.ready_timeout:g} s") from None
        if ready is None:
            rc = await proc.wait()
            if rc in PERMANENT_EXITS:
                raise WorkerUnusable(f"exited with status {rc} before it was ready: "
                                     f"{self.fatal or 'bad options (see its log)'}")
            raise RuntimeError(f"exited with status {rc} before it was ready")
        reader = asyncio.create_task(self._read_rest(proc.stdout))
        try:
            told = ready.get("startup")
            phases = [float(told.get(p, 0.0)) for p in PHASES] if isinstance(told, dict) else []
            conn = await self.attach(str(ready["url"]), ready.get("models"), started, phases)
            waits = [asyncio.ensure_future(proc.wait()), asyncio.ensure_future(conn.wait_closed())]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
            if proc.returncode is not None:
                raise RuntimeError(f"exited with status {proc.returncode}")
            raise RuntimeError("transport connection lost")
        finally:
            reader.cancel()

    async def _read_until_ready(self, stdout: asyncio.StreamReader) -> dict[str, Any] | None:
        async for raw in stdout:
            ev = self._event(raw)
            if ev is None:
                continue
            kind = ev.get("event")
            if kind == "progress":
                self.sup.progress.progress(self.name, str(ev.get("stage", "")), int(ev.get("done", 0)),
                                           int(ev.get("total", 0)), str(ev.get("message", "")))
            elif kind == "ready" and isinstance(ev.get("url"), str):
                return ev
            elif kind == "fatal":
                self.fatal = str(ev.get("message", ""))
        return None

    async def _read_rest(self, stdout: asyncio.StreamReader) -> None:
        async for raw in stdout:
            self._event(raw)

    def _event(self, raw: bytes) -> dict[str, Any] | None:
        line = raw.strip()
        if not line:
            return None
        try:
            ev = orjson.loads(line)
        except orjson.JSONDecodeError:
            ev = None
        if not isinstance(ev, dict):
            log.info("%s: %s", self.name, line.decode(errors="replace"))
            return None
        return ev

    async def _release(self) -> None:
        await super()._release()
        proc, self.proc = self.proc, None
        if proc is not None and proc.returncode is None:
            await terminate(proc, self.ws.stop_timeout)


class RemoteWorker(_Worker):
    def __init__(self, sup: WorkerSupervisor, ws: WorkersSettings, url: str) -> None:
        super().__init__(sup, ws)
        self.name = url
        self.url = url

    async def run_once(self) -> None:
        conn = await self.attach(self.url, None)
        await conn.wait_closed()
        raise RuntimeError("transport connection lost")


class WorkerSupervisor:
    """Every configured worker, local and remote, of every model (``models``: each model's
    ``[workers]`` settings, as :meth:`~gateway.workers.config.ModelSettings.worker_settings` gives
    them; one ``WorkersSettings`` for the one-model case). ``commands`` replaces the local workers'
    argv (tests), with the first model's settings."""

    def __init__(self, models: WorkersSettings | Sequence[WorkersSettings], pool: ModelPool, metrics: GatewayMetrics,
                 progress: ProgressDisplay | None = None, *, connect: Connector | None = None,
                 commands: Sequence[list[str]] | None = None, state_dir: str | None = None) -> None:
        specs = [models] if isinstance(models, WorkersSettings) else list(models)
        self.ws = ws = specs[0]  # the first model's (discovered workers are supervised with these)
        self.pool = pool
        self.metrics = metrics
        self.progress = progress if progress is not None else ProgressDisplay("off")
        self.connect = connect if connect is not None else _default_connector()
        self.identity = f"gateway@{os.uname().nodename}:{os.getpid()}"
        self.changed = asyncio.Event()  # a worker became ready or stopped for good
        self.healed = 0  # replicas restarted by self-healing
        self.state_dir = state_dir  # where local workers keep their compilation caches (None: their default)
        self.startup = StartupLog()
        if metrics is not None:  # (tests run supervisors without metrics)
            metrics.registry.register(self.startup)
        self.on_ready: list[Callable[[_Worker, WorkerConnection], None]] = []  # a worker joined the pool
        self.workers: list[_Worker] = []
        self._next_index = 0  # local workers numbered across models, never reused (unix:// paths stay apart)
        self.may_start_empty = any(s.elastic and not s.initial_replicas and not s.remote for s in specs)
        if commands is not None:
            self.workers += [LocalWorker(self, ws, i, c) for i, c in enumerate(commands)]
            self._next_index = len(commands)
        else:
            for spec in specs:
                self.workers += [self._local(spec) for _ in range(spec.initial_replicas)]
        self.workers += [RemoteWorker(self, spec, u) for spec in specs for u in spec.remote]

    def _local(self, ws: WorkersSettings) -> LocalWorker:
        i = self._next_index
        self._next_index += 1
        return LocalWorker(self, ws, i, worker_command(ws, i, self.state_dir))

    def start_replica(self, ws: WorkersSettings) -> LocalWorker:
        """One more local worker of the model ``ws`` describes, started now (an elastic pool's scale-out)."""
        w = self._local(ws)
        self.workers.append(w)
        w.task = asyncio.create_task(w.loop(), name=f"supervise {w.name}")
        return w

    def start(self) -> None:
        for w in self.workers:
            w.task = asyncio.create_task(w.loop(), name=f"supervise {w.name}")

    def add_model(self, ws: WorkersSettings) -> list[_Worker]:
        """Start the workers of a model added by a reload (``ws``: its [workers] settings)."""
        new: list[_Worker] = [self._local(ws) for _ in range(ws.initial_replicas)]
        new += [RemoteWorker(self, ws, u) for u in ws.remote]
        for w in new:
            self.workers.append(w)
            w.task = asyncio.create_task(w.loop(), name=f"supervise {w.name}")
        return new

    def worker_of(self, conn: WorkerConnection) -> _Worker | None:
        return next((w for w in self.workers if w.conn is conn), None)

    def of_model(self, name: str) -> list[_Worker]:
        """The configured workers serving ``name`` (its [workers] served name)."""
        return [w for w in self.workers if w.ws.served_name == name]

    async def retire(self, workers: list[_Worker], timeout: float) -> None:
        """Drain ``workers`` and stop them (a reload removed or replaced their model): out of the
        pool at once, so no new request goes there; their requests in flight finish (up to
        ``timeout``); then they stop like at shutdown and are forgotten."""
        for w in workers:
            w.stopping = True
            if w.conn is not None:
                self.pool.remove(w.conn)
        deadline = asyncio.get_running_loop().time() + timeout
        while any(w.conn is not None and w.conn.in_flight for w in workers):
            if asyncio.get_running_loop().time() >= deadline:
                log.warning("reload: %d request(s) still open on retired workers after %g s; stopping them anyway",
                            sum(w.conn.in_flight for w in workers if w.conn is not None), timeout)
                break
            await asyncio.sleep(0.05)
        tasks = [w.task for w in workers if w.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(w._release() for w in workers), return_exceptions=True)
        for w in workers:
            if w in self.workers:
                self.workers.remove(w)

    def add_remote(self, url: str) -> None:
        """A worker that appeared (DNS discovery): supervised like the configured remote ones."""
        if any(isinstance(w, RemoteWorker) and w.url == url for w in self.workers):
            return
        w = RemoteWorker(self, self.ws, url)
        self.workers.append(w)
        w.task = asyncio.create_task(w.loop(), name=f"supervise {w.name}")

    def remove_remote(self, url: str) -> None:
        """A worker that went away (DNS discovery): out of the pool, its connection closed."""
        for w in [w for w in self.workers if isinstance(w, RemoteWorker) and w.url == url]:
            self.workers.remove(w)
            if w.conn is not None:
                self.pool.remove(w.conn)
            if w.task is not None:
                w.task.cancel()
            asyncio.get_running_loop().create_task(w._release())

    @property
    def failure(self) -> str | None:
        """Why workers stopped for good, one clause per worker ("worker-0 exited with status 2 before it
        was ready: quicserve worker: --max-batch: must be >= 1, got 0"); None while none has. For
        ``/readyz`` and the operator."""
        return "; ".join(f"{w.name} {w.failure}" for w in self.workers if w.failure is not None) or None

    async def wait_ready(self, timeout: float | None = None, *, all_workers: bool = False) -> bool:
        """True once one (or every) worker has been ready at least once; False at the timeout, or
        as soon as too many workers have stopped for good (:attr:`failure`) for that to happen."""
        need = len(self.workers) if all_workers else 1
        if not self.workers and self.may_start_empty:
            return True  # an elastic pool at zero serves by starting a replica when a request comes
        try:
            async with asyncio.timeout(timeout):
                while self.workers:
                    ready = sum(w.ready_once.is_set() for w in self.workers)
                    if ready >= need:
                        return True
                    if ready + sum(not w.ready_once.is_set() and w.failure is None for w in self.workers) < need:
                        return False
                    self.changed.clear()
                    await self.changed.wait()
        except TimeoutError:
            pass
        return False

    async def stop(self) -> None:
        """Out of the pool, close connections, SIGTERM children (SIGKILL after stop_timeout)."""
        for w in self.workers:
            await w.stop()
        for w in self.workers:
            if w.conn is not None:
                self.pool.remove(w.conn)
        tasks = [w.task for w in self.workers if w.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(w._release() for w in self.workers), return_exceptions=True)
