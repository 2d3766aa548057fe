"""Reloading the configuration of a running gateway (SIGHUP, or its config file changed) without
losing a request.

What a reload applies: the rule tree (``[[routes]]``: the next request is decided by the new one),
the rollouts (``[[rollouts]]``: one still releasing the same candidate goes on from its step), and
the models (``[[models]]``): an added model starts its workers, and the new rules and rollouts
apply once it has a ready one (they may send it traffic); a removed one stops taking new
requests at once, its requests in flight finish on the workers they started on (up to
``shutdown.drain_timeout``), then its workers stop; a model whose aliases changed is renamed in
place; a model whose workers' settings changed gets new workers first, and its old ones drain
once the new ones are ready. Other sections need a restart: the reload says which ones changed.

A file that fails ``config check`` changes nothing: the problems go to the log, to
``quicserve_config_reloads_total{result="failed"}`` and to ``/readyz`` (which stays 200: the old
configuration is still serving).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Callable, Coroutine
from typing import Any

from prometheus_client import Counter

from . import clock
from .app import App
from .routing.pool import ModelPool
from .settings import Settings, SettingsError
from .workers.config import ModelSettings
from .workers.supervisor import Worker, WorkerSupervisor

__all__ = ["Reloader"]

log = logging.getLogger("quicserve.reload")
_APPLIED = ("models", "routes", "rollouts")  # what a reload changes; any other section needs a restart


class Reloader:
    def __init__(self, load: Callable[[], Settings], path: str | None, settings: Settings, app: App,
                 pool: ModelPool, supervisor: WorkerSupervisor) -> None:
        self.load, self.path, self.settings = load, path, settings
        self.app, self.pool, self.supervisor = app, pool, supervisor
        self._mtime = self._stat()
        self._lock = asyncio.Lock()
        self._drains: set[asyncio.Task[None]] = set()
        self.results = Counter("quicserve_config_reloads", "Configuration reloads, by result", ["result"],
                               registry=app.metrics.registry)

    def _stat(self) -> float | None:
        try:
            return os.stat(self.path).st_mtime if self.path else None
        except OSError:
            return None

    async def watch(self, interval: float = 1.0) -> None:
        """Reload when the config file's modification time changes (as the key file does)."""
        while True:
            await asyncio.sleep(interval)
            mtime = self._stat()
            if mtime is not None and mtime != self._mtime:
                self._mtime = mtime
                await self.reload("the config file changed")

    async def reload(self, why: str) -> bool:
        """Load and apply the configuration; False (nothing changed) if it does not pass ``config check``."""
        async with self._lock:
            self._mtime = self._stat()  # this file's version is read now: the watcher need not read it again
            try:
                new = self.load()
            except SettingsError as e:
                text = "; ".join(e.problems)
                log.error("config reload (%s) refused, nothing changed: %s", why, text)
                self.app.config_problem = f"the last reload was refused: {text}"
                self.results.labels("failed").inc()
                return False
            self.app.config_problem = None
            await self._apply(new, why)
            self.results.labels("applied").inc()
            return True

    async def _apply(self, new: Settings, why: str) -> None:
        old, gens = self.settings, self.app.generations
        before = {m.name: m for m in old.served()}
        after = {m.name: m for m in new.served()}
        added = [after[n] for n in after.keys() - before.keys()]
        fresh = [w for m in added for w in self.supervisor.add_model(m.worker_settings())]
        for m in added:
            log.info("reload: model %s added (%d local worker(s))", m.name, m.local)
        await self._ready(fresh)  # the new rules may send traffic there: only once it can take it
        for m in added:
            self.pool.configure([(m.name, m.aliases)])
        gens.rules = new.rule_tree()
        rollouts = self.app.rollouts
        if rollouts is not None:
            rollouts.reconfigure(new.rollouts, clock.now())
            gens.rollouts = rollouts if rollouts else None
        for name in before.keys() - after.keys():
            self._drain(self.supervisor.of_model(name), f"model {name} removed")
            self.pool.unconfigure(name)
        for name, m in after.items():
            was = before.get(name)
            if was is None:
                continue
            if was.aliases != m.aliases:
                self.pool.unconfigure(name)
                self.pool.configure([(name, m.aliases)])
            if _workers_changed(was, m):
                olds = self.supervisor.of_model(name)
                self._spawn(self._replace(name, olds, self.supervisor.add_model(m.worker_settings())))
        restart = [f.name for f in dataclasses.fields(Settings)
                   if f.name not in _APPLIED and getattr(old, f.name) != getattr(new, f.name)]
        if restart:
            log.warning("reload: [%s] changed; a restart applies that", "], [".join(restart))
        log.info("config reloaded (%s): %d model(s), %d rule leaves, %d rollout(s)", why, len(after),
                 len(gens.rules.leaves) if gens.rules is not None else 0, len(new.rollouts))
        self.settings = new

    async def _ready(self, workers: list[Worker]) -> None:
        """Until every model of ``workers`` has one ready (or its ready_timeout passed)."""
        if not workers:
            return
        deadline = clock.now() + max(w.ws.ready_timeout for w in workers)
        models = {w.ws.served_name for w in workers}
        while clock.now() < deadline:
            if all(any(w.ready_once.is_set() for w in workers if w.ws.served_name == m) for m in models):
                return
            await asyncio.sleep(0.05)
        log.warning("reload: added model(s) %s not ready after their ready_timeout; applying anyway", sorted(models))

    async def _replace(self, name: str, olds: list[Worker], fresh: list[Worker]) -> None:
        """New workers first; the old ones drain once one new one is ready (no gap in service)."""
        await self._ready(fresh)
        await self.supervisor.retire(olds, self.settings.shutdown.drain_timeout)
        log.info("reload: model %s now runs on its new workers", name)

    def _drain(self, workers: list[Worker], what: str) -> None:
        log.info("reload: %s; %d worker(s) drain", what, len(workers))
        self._spawn(self.supervisor.retire(workers, self.settings.shutdown.drain_timeout))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)


def _workers_changed(a: ModelSettings, b: ModelSettings) -> bool:
    return a.worker_settings() != b.worker_settings()
