"""Elastic local pools, live: :mod:`gateway.workers.elastic`'s controller driving the supervisor.

How it works: a model whose ``[workers]`` settings have ``max_replicas > 0`` gets an
:class:`ElasticPool`. Every ``tick`` (and at once when a request finds the pool empty) it reads
what the gateway sees of the model -- requests that arrived since the last tick (counted by
:class:`ElasticModelPool`, the pool the gateway then runs on), each replica's requests in flight
against its slots (``Hello.max_batch``), the waiting room -- measures a replica's throughput from
them (Little's law: busy slot-seconds over completions), and asks the controller what to do. A
start is :meth:`~gateway.workers.supervisor.WorkerSupervisor.start_replica`; its spawn-to-ready
time, measured by the supervisor, feeds the controller's start-up horizon. A drain moves the
replica's requests that have no token yet to the others, then retires it (its requests in flight
finish; the process stops). With ``min_replicas = 0`` the pool may reach zero: a request then waits
in the model's :class:`~gateway.workers.waiting.WaitingRoom` while a replica starts (progress in the
log), or gets 503 + Retry-After at once when the start would outlast the room's timeout.

A model with remote workers (or discovered ones) is not started or stopped here: its pool computes
the same decision over the replicas it has and exports it (``quicserve_pool_desired_replicas``), the
signal Kubernetes' autoscaler scales the worker Deployment on (``config/k8s/``). Only a gateway of
one process runs elastic pools (with ``[server] processes``, the pools stay as configured).
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
from collections import deque
from collections.abc import Iterator, Sequence

from transport.api import WorkerConnection

from .. import clock
from ..observability.metrics import GatewayMetrics
from ..routing.pool import ModelPool
from ..routing.routed import RoutedStream, SubmitFactory
from .config import WorkersSettings, served_name_of
from .elastic import Decision, ElasticController, PoolLimits, PoolView, ReplicaView, StartupTimes
from .elastic_metrics import ElasticCollector, PoolFigures
from .supervisor import LocalWorker, Worker, WorkerSupervisor
from .waiting import WaitingRoom

__all__ = ["ElasticModelPool", "ElasticPool", "ElasticPools", "pool_class"]

log = logging.getLogger("quicserve.workers")

TICK_S = 0.25
PRIOR_SERVICE_S = 1.0  # seconds a request holds a slot, until measured
SERVICE_TAU_S = 10.0  # the throughput measurement's memory


class ElasticModelPool(ModelPool):
    """A :class:`ModelPool` that counts each elastic model's arrivals and hands out its waiting room
    when no replica can take a request (the gateway runs on this one only when a pool is elastic)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.arrivals: dict[str, int] = {}  # elastic models only
        self.rooms: dict[str, WaitingRoom] = {}

    def open(self, model: str, make_submit: SubmitFactory, subject: object = None) -> RoutedStream:
        a = self.arrivals
        if model in a:
            a[model] += 1
        return super().open(model, make_submit, subject)

    def choose(self, model: str, subject: object = None, exclude: tuple[WorkerConnection, ...] = (),
               make_submit: SubmitFactory | None = None) -> WorkerConnection | None:
        pick = super().choose(model, subject, exclude, make_submit)
        if pick is None:
            room = self.rooms.get(model)
            if room is not None and room.conn not in exclude and room.can_take():
                return room.conn
        return pick


    def models(self) -> list[str]:
        """Models with a ready replica, and those whose elastic pool at zero takes requests (they wait
        while a replica starts): what /v1/models lists and /readyz counts."""
        waiting = {m for m, room in self.rooms.items() if room.can_take()}
        return sorted({*super().models(), *waiting, *(a for a, m in self.aliases.items() if m in waiting)})


def pool_class(models: Sequence[WorkersSettings]) -> type[ModelPool]:
    """The pool the gateway runs on: counting arrivals only where some model is elastic."""
    return ElasticModelPool if any(m.elastic for m in models) else ModelPool


class ElasticPool:
    """One model's elastic pool (see the module's docstring)."""

    def __init__(self, ws: WorkersSettings, supervisor: WorkerSupervisor, pool: ElasticModelPool,
                 drain_timeout: float, advisory: bool = False) -> None:
        self.name = name = served_name_of(ws)
        self.ws = ws
        self.sup = supervisor
        self.pool = pool
        self.drain_timeout = drain_timeout
        self.acts = not (advisory or ws.remote)  # local replicas started and stopped here; else only counted
        limits = PoolLimits(ws.min_replicas, ws.max_replicas, ws.queue_budget, ws.scale_in_after)
        self.controller = ElasticController(limits, StartupTimes())
        self.room = pool.rooms[name] = WaitingRoom(name, ws.waiting_room, ws.waiting_timeout, clock.now,
                                                   on_arrival=self.arrived)
        self.room.eta = self.eta
        pool.arrivals.setdefault(name, 0)
        pool.configure([(name, ())])
        self.workers: list[Worker] = [w for w in supervisor.workers
                                      if isinstance(w, LocalWorker) and served_name_of(w.ws) == name]
        self.starting_since: dict[Worker, float] = {w: clock.now() for w in self.workers}
        self.retiring: set[Worker] = set()
        self.startups: deque[float] = deque(maxlen=64)  # measured spawn-to-ready seconds
        self.wake = asyncio.Event()
        self.view: PoolView | None = None
        self.slots = ws.max_batch  # until a replica says (Hello.max_batch)
        self.service_s = PRIOR_SERVICE_S
        self._busy = self._done = 0.0  # decayed slot-seconds and completions
        self._seen = 0  # arrivals counted so far
        self._in_flight = 0
        self._last: float | None = None
        self.started = self.drained = 0
        supervisor.startup.listeners.append(self._started)
        supervisor.on_ready.append(self._ready)

    # -- what the supervisor and the room tell it -------------------------------------------------
    def arrived(self) -> None:
        """A request entered the waiting room: decide now, not at the next tick."""
        self.wake.set()
        if len(self.room.streams) == 1:
            eta = self.eta()
            self._say("a request waits for a replica to start" + (
                f" (ready in about {eta:.1f} s)" if eta is not None else ""))

    def _started(self, model: str, seconds: float) -> None:
        if model == self.name:
            self.startups.append(seconds)
            self.controller.observe_startup(seconds)

    def _ready(self, worker: Worker, conn: WorkerConnection) -> None:
        if self.name not in conn.peer_hello.models:
            return
        self.starting_since.pop(worker, None)
        if conn.peer_hello.max_batch:
            self.slots = conn.peer_hello.max_batch
        oldest = self.room.oldest_wait(clock.now())
        moved = self.room.release(self.pool)
        if moved:
            self._say(f"{worker.name} ready: {moved} waiting request(s) sent to it (the oldest waited {oldest:.1f} s)")

    def _say(self, text: str) -> None:
        """A line in the log and on the progress display."""
        log.info("elastic %s: %s", self.name, text)
        self.sup.progress.note(f"elastic {self.name}", text)

    def eta(self) -> float | None:
        """Seconds until a replica should be ready: the slowest recent start (P90 of at least two), less
        what the oldest start under way has run; None before two starts were measured."""
        if len(self.startups) < 2:
            return None
        expect = statistics.quantiles(self.startups, n=10, method="inclusive")[8]
        now = clock.now()
        running = max((now - t for t in self.starting_since.values()), default=0.0)
        return max(0.0, expect - running)

    def figures(self) -> PoolFigures:
        """What ``/metrics`` shows of the pool (the scaling signal and what it came from)."""
        v, c = self.view, self.controller
        ready = len(v.replicas) if v is not None else 0
        return PoolFigures(self.name, c.last_need, ready, v.starting if v is not None else 0, len(self.retiring),
                           (v.oldest_wait_s if v is not None else 0.0) / self.ws.queue_budget,
                           v.queued if v is not None else 0, c.last_demand, v.capacity_rps if v is not None else 0.0,
                           c.startup.horizon(), self.room.in_flight, self.room.timed_out, self.started, self.drained)

    # -- one decision ----------------------------------------------------------------------------------
    def tick(self, now: float) -> Decision:
        self.room.expire(now)
        arrivals = self.pool.arrivals[self.name]
        if arrivals > self._seen:
            self.controller.observe_arrival(now, arrivals - self._seen)
        view = self.view = self._view(now, arrivals)
        self._seen = arrivals
        d = self.controller.decide(now, view)
        if self.acts and self.pool.knows(self.name):  # (a reload that removed the model retires its replicas)
            for _ in range(min(d.start, self.ws.max_replicas - len(self._live()))):
                self._start(now, view)
            for rid in d.drain:
                w = next((w for w in self.workers if id(w) == rid), None)
                if w is not None and len(self._live()) - 1 >= self.ws.min_replicas:
                    self.retiring.add(w)
                    asyncio.get_running_loop().create_task(self._drain(w))
        return d

    def _live(self) -> list[Worker]:
        """Managed replicas ready or starting (not retiring, not failed for good)."""
        return [w for w in self.workers if w not in self.retiring and w.failure is None]

    def _conns(self) -> list[tuple[int, WorkerConnection | None, Worker | None]]:
        if self.acts:
            return [(id(w), w.conn, w) for w in self._live()]
        return [(id(c), c, None) for c in self.pool.replicas().get(self.name, ())]

    def _view(self, now: float, arrivals: int) -> PoolView:
        slots = self.slots
        replicas: list[ReplicaView] = []
        starting = 0
        queued = in_flight = self.room.in_flight
        busy = 0
        for rid, conn, _ in self._conns():
            if conn is None or conn.closed:
                starting += 1
                continue
            n = conn.in_flight
            in_flight += n
            replicas.append(ReplicaView(rid, min(n, slots)))
            busy += min(n, slots)
            queued += max(0, n - slots)
        if self._last is not None:  # Little's law: a slot is held service_s per request
            dt = now - self._last
            decay = math.exp(-dt / SERVICE_TAU_S)
            done = max(0, (arrivals - self._seen) - (in_flight - self._in_flight))
            self._busy = self._busy * decay + busy * dt
            self._done = self._done * decay + done
            if self._done >= 1.0:
                self.service_s = max(1e-3, self._busy / self._done)
        self._last, self._in_flight = now, in_flight
        return PoolView(tuple(replicas), starting, slots, slots / self.service_s, queued, self.room.oldest_wait(now))

    def _start(self, now: float, view: PoolView) -> None:
        w = self.sup.start_replica(self.ws)
        self.workers.append(w)
        self.starting_since[w] = now
        self.started += 1
        c = self.controller
        log.info("elastic %s: starting %s (%d ready, %d starting, %d queued; forecast %.1f req/s over the %.1f s "
                 "horizon, a replica serves %.1f)", self.name, w.name, len(view.replicas), view.starting, view.queued,
                 c.last_demand, c.startup.horizon(), view.capacity_rps)
        self.sup.progress.note(w.name, f"elastic {self.name}: scaling out")

    async def _drain(self, w: Worker) -> None:
        """Its requests with no token yet move to the other replicas; then it stops like a retired one."""
        conn = w.conn
        dwell = min(self.ws.scale_in_after, self.controller.slow.memory_s)
        log.info("elastic %s: draining %s (capacity the forecast has not needed for %g s)", self.name, w.name, dwell)
        if conn is not None:
            queued = list(self.pool.unstarted.get(conn, ()))
            self.pool.remove(conn)
            for routed in queued:
                target = self.pool.choose(self.name, routed.subject, (conn,), None)
                if routed.on_moved is not None and target is not None and target is not self.room.conn:
                    routed.move(target)
        await self.sup.retire([w], self.drain_timeout)
        self.drained += 1
        self.retiring.discard(w)
        if w in self.workers:
            self.workers.remove(w)
        log.info("elastic %s: %s stopped (%d replica(s) left)", self.name, w.name, len(self._live()))


class ElasticPools:
    """Every elastic pool of the gateway and the loop that ticks them."""

    def __init__(self, pools: list[ElasticPool], tick: float = TICK_S) -> None:
        self.pools = pools
        self.tick = tick
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def start(cls, models: Sequence[WorkersSettings], supervisor: WorkerSupervisor, pool: ModelPool,
              metrics: GatewayMetrics, drain_timeout: float, advisory: bool = False) -> ElasticPools | None:
        """The pools of the elastic ``models`` ticking (None when there are none); ``advisory``: workers
        are found by DNS, so no pool starts or stops any (each exports what it calls for)."""
        if not isinstance(pool, ElasticModelPool):
            return None
        self = cls([ElasticPool(ws, supervisor, pool, drain_timeout, advisory) for ws in models if ws.elastic])
        metrics.registry.register(ElasticCollector(lambda: [p.figures() for p in self.pools]))
        self._task = asyncio.create_task(self.run(), name="elastic pools")
        return self

    def __iter__(self) -> Iterator[ElasticPool]:
        return iter(self.pools)

    async def run(self) -> None:
        wake = [p.wake for p in self.pools]
        while True:
            waits = [asyncio.ensure_future(w.wait()) for w in wake]
            _, pending = await asyncio.wait(waits, timeout=self.tick, return_when=asyncio.FIRST_COMPLETED)
            for f in waits:
                f.cancel()
            now = clock.now()
            for p in self.pools:
                p.wake.clear()
                try:
                    p.tick(now)
                except Exception:  # noqa: BLE001 - one bad tick must not stop scaling
                    log.exception("elastic %s: tick failed", p.name)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
