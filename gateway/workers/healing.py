"""Self-healing: every second, the replicas whose error rate over the healing window passed its
bound (gateway/routing/health.py ``to_heal``: one per pool at a time, never a pool's last) are
drained and restarted if local, ejected and probed if remote."""

from __future__ import annotations

import asyncio
import logging

from .. import clock
from ..routing.health import to_heal
from ..routing.pool import ModelPool
from .process import terminate
from .supervisor import LocalWorker, WorkerSupervisor

__all__ = ["heal_forever", "heal"]

log = logging.getLogger("quicserve.workers")


async def heal_forever(supervisor: WorkerSupervisor, pool: ModelPool, drain_timeout: float,
                       interval: float = 1.0) -> None:
    busy: set[str] = set()  # models a replica of which is being healed (until it is back)
    tasks: set[asyncio.Task[None]] = set()
    while True:
        await asyncio.sleep(interval)
        now = clock.now()
        pools = {m: rs for m, rs in pool.replicas().items() if m not in busy}
        for conn, why in to_heal(pool.health, pools, now):
            worker = supervisor.worker_of(conn)
            if isinstance(worker, LocalWorker):
                models = {m for m, rs in pools.items() if conn in rs}
                busy.update(models)
                task = asyncio.create_task(_heal(supervisor, worker, why, drain_timeout, busy, models))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            else:  # a remote replica cannot be restarted from here: ejected, then probed
                b = pool.health.breakers.get(conn)
                if b is not None and b.state == "closed":
                    b.trip(why, pool.health.s, now)
                    b.healed()


async def _heal(supervisor: WorkerSupervisor, worker: LocalWorker, why: str, timeout: float, busy: set[str],
                models: set[str]) -> None:
    """Restart one replica; its pool may lose another only once this one is serving again."""
    try:
        old = worker.conn
        await heal(supervisor, worker, why, timeout)
        deadline = clock.now() + max(60.0, worker.ws.ready_timeout)
        while (worker.conn is None or worker.conn is old) and clock.now() < deadline and not worker.stopping:
            await asyncio.sleep(0.1)
    finally:
        busy.difference_update(models)


async def heal(supervisor: WorkerSupervisor, worker: LocalWorker, why: str, timeout: float) -> None:
    """Drain ``worker`` (out of the pool; its requests in flight finish, up to ``timeout``) and
    restart it: its process is stopped and started again by its loop."""
    conn = worker.conn
    if conn is None or worker.proc is None:
        return
    log.warning("healing: %s %s; draining and restarting it", worker.name, why)
    supervisor.progress.note(worker.name, f"{why}; restarting it")
    supervisor.pool.remove(conn)
    deadline = asyncio.get_running_loop().time() + timeout
    while conn.in_flight and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    proc = worker.proc
    if proc is not None and proc.returncode is None:
        await terminate(proc, worker.ws.stop_timeout)  # its loop sees it exit and starts it again
    supervisor.healed += 1
