"""One gateway process of several: what it hears from its supervisor (see :mod:`.supervisor`).

The supervisor starts ``quicserve serve`` with :data:`PROCESS_ENV` set to JSON (the process's
index, how many there are, its control socket and its inherited sockets). Before the event loop
starts, :func:`from_environ` adopts the sockets (:mod:`.inherited`), makes the QUIC connection IDs
name this process (:mod:`.steering`) and reads the supervisor's hello from the control socket:
the secret session tickets are sealed under, the runtime directory (tickets and metrics snapshots
live there), the local store's URL (shared limits) and the local workers' URLs. While serving,
:meth:`GatewayProcess.follow` keeps the worker set in step with the supervisor's, and
:meth:`GatewayProcess.publish_metrics` keeps this process's figures where the others read them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from . import inherited, steering
from .metrics_merge import merge_expositions

__all__ = ["PROCESS_ENV", "GatewayProcess", "from_environ"]

PROCESS_ENV = "QUICSERVE_PROCESS"
SNAPSHOT_EVERY = 1.0  # seconds between a busy process's metrics snapshots (how stale another's view is)
SNAPSHOT_IDLE = 15.0  # ... an idle one's
SCRAPED_WITHIN = 120.0  # seconds after the last /metrics scrape that snapshots are still written


@dataclass(slots=True)
class GatewayProcess:
    """This process's place among the gateway's processes."""

    index: int
    of: int
    control: socket.socket
    secret: bytes = b""
    runtime: str = ""
    redis_url: str = ""
    workers: set[str] = field(default_factory=set)
    first_workers: asyncio.Event | None = None  # set once the supervisor has named a worker

    def read_hello(self) -> None:
        """The supervisor's first line, read before the event loop runs (no byte past it)."""
        raw = bytearray()
        while not raw.endswith(b"\n"):
            chunk = self.control.recv(1)
            if not chunk:
                raise RuntimeError("the supervisor closed the control socket")
            raw += chunk
        hello = orjson.loads(raw)
        self.secret = bytes.fromhex(hello["secret"])
        self.runtime = str(hello["runtime"])
        self.redis_url = str(hello["redis_url"])
        self.workers = set(hello["workers"])

    async def follow(self, add: Callable[[str], None], remove: Callable[[str], None]) -> None:
        """Add and remove workers as the supervisor names them, until the control socket closes."""
        ready = self.first_workers = self.first_workers or asyncio.Event()
        for url in sorted(self.workers):
            add(url)
        if self.workers:
            ready.set()
        self.control.setblocking(False)
        reader, _ = await asyncio.open_connection(sock=self.control)
        async for line in reader:
            urls = set(orjson.loads(line).get("workers", ()))
            for url in sorted(self.workers - urls):
                remove(url)
            for url in sorted(urls - self.workers):
                add(url)
            self.workers = urls
            if urls:
                ready.set()

    def snapshot_path(self, index: int) -> str:
        return os.path.join(self.runtime, f"metrics-{index}.prom")

    async def publish_metrics(self, render: Callable[[], bytes]) -> None:
        """Keep this process's own exposition where the others read it (written atomically).

        Only while someone reads ``/metrics`` (a scrape within :data:`SCRAPED_WITHIN` seconds: the
        scraped process touches a marker) and only what moved: every :data:`SNAPSHOT_EVERY`
        seconds if this process did any work since (its CPU time went on), else every
        :data:`SNAPSHOT_IDLE` seconds. So a gateway nobody scrapes writes nothing, an idle process
        costs a ``stat`` a second, and a scrape sees the others as of a second ago (the first scrape
        after a quiet spell: as of their last snapshot, counters late by that, never wrong in sign).
        """
        path, tmp = self.snapshot_path(self.index), self.snapshot_path(self.index) + ".tmp"
        marker = os.path.join(self.runtime, "scraped")
        loop = asyncio.get_running_loop()
        published, cpu = -SNAPSHOT_IDLE, -1.0
        while True:
            await asyncio.sleep(SNAPSHOT_EVERY)
            now, used = loop.time(), time.process_time()
            try:
                wanted = time.time() - os.stat(marker).st_mtime < SCRAPED_WITHIN
            except OSError:
                wanted = False
            if not wanted or (used - cpu < 0.002 and now - published < SNAPSHOT_IDLE):
                continue
            with contextlib.suppress(OSError):
                with open(tmp, "wb") as f:
                    f.write(render())
                os.replace(tmp, path)
            published, cpu = now, time.process_time()

    def merged(self, own: bytes) -> bytes:
        """This process's exposition (``own``, live, first: the freshest view of what every process
        reports alike) with the others' latest snapshots: the gateway."""
        marker = os.path.join(self.runtime, "scraped")
        with contextlib.suppress(OSError):
            with open(marker, "ab"):
                pass
            os.utime(marker)  # the others: someone reads /metrics, keep snapshots coming
        texts = [own]
        for i in range(self.of):
            if i != self.index:
                with contextlib.suppress(OSError):
                    with open(self.snapshot_path(i), "rb") as f:
                        texts.append(f.read())
        return merge_expositions(texts)


def from_environ(environ: Any = None) -> GatewayProcess | None:
    """This process's place if a supervisor started it (None: a gateway of one process)."""
    raw = (environ if environ is not None else os.environ).get(PROCESS_ENV)
    if not raw:
        return None
    spec = orjson.loads(raw)
    inherited.adopt([(kind, where, fd) for kind, where, fd in spec["sockets"]])
    steering.install_cid_owner(int(spec["index"]))
    p = GatewayProcess(int(spec["index"]), int(spec["of"]), socket.socket(fileno=int(spec["control"])))
    p.read_hello()
    return p
