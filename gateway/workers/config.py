"""``[workers]``: how the gateway runs its workers, plus every ``quicserve worker`` option."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import PurePath

from transport.common.worker_options import URL_SCHEMES, WorkerOptions, option_problems
from transport.security import security_of
from transport.select import BadURL, parse_url

__all__ = ["WorkersSettings", "ModelSettings", "MODEL_KEYS", "PER_MODEL", "served_name_of"]


@dataclass(frozen=True, slots=True)
class WorkersSettings(WorkerOptions):
    """How the gateway runs its workers, plus every ``quicserve worker`` option (inherited from
    :class:`~transport.common.worker_options.WorkerOptions`, which holds their defaults and checks)."""

    local: int = 1  # local worker processes started by `quicserve serve`
    remote: list[str] = field(default_factory=list)  # URLs of workers started elsewhere
    ready_timeout: float = 900.0
    connect_timeout: float = 10.0
    restart_backoff_initial: float = 0.5
    restart_backoff_max: float = 30.0
    stop_timeout: float = 10.0
    heartbeat_interval: float = 1.0
    dead_after: float = 5.0
    # An elastic pool of local replicas (gateway/workers/elastic_pool.py), on with max_replicas > 0: it
    # starts `local` of them (within min..max) and scales between min_replicas and max_replicas.
    max_replicas: int = 0  # 0 = a fixed pool of `local` workers
    min_replicas: int = 1  # 0 = scale to zero when idle: the next request waits while one starts
    queue_budget: float = 0.5  # seconds a request should wait for a slot, at most (what scaling aims at)
    scale_in_after: float = 30.0  # seconds of unneeded capacity (of no request, to go to zero) before a drain
    waiting_room: int = 256  # requests that may wait while a pool with no replica starts one
    waiting_timeout: float = 60.0  # ...each for this long at most (503 + Retry-After when a start would take longer)

    @property
    def elastic(self) -> bool:
        return self.max_replicas > 0

    @property
    def initial_replicas(self) -> int:
        """Local workers started with the pool."""
        return min(self.max_replicas, max(self.min_replicas, self.local)) if self.elastic else self.local

    def _validate(self, p: list[str]) -> None:
        p += [f"workers.{key}: {why}" for key, why in option_problems(self)]
        if self.local < 0:
            p.append("workers.local: must be >= 0")
        tls = bool(self.transport_tls_cert)
        sec = security_of(self)
        for u in self.remote:
            if not u.startswith(URL_SCHEMES):
                p.append(f"workers.remote: {u!r} is not a tcp://, unix:// or rdma:// URL")
            elif tls and u.startswith("rdma://"):
                p.append(f"workers.remote: {u}: TLS does not run over rdma://; authenticate it with transport_psk_file")
            else:  # default deny, at start: a worker beyond loopback with no transport authentication
                try:
                    refusal = sec.refusal(parse_url(u), "gateway")
                except BadURL as exc:
                    refusal = str(exc)
                if refusal:
                    p.append(f"workers.remote: {refusal}")
        for name in ("ready_timeout", "connect_timeout", "restart_backoff_initial", "stop_timeout",
                     "heartbeat_interval", "dead_after"):
            if getattr(self, name) <= 0:
                p.append(f"workers.{name}: must be > 0")
        if self.restart_backoff_max < self.restart_backoff_initial:
            p.append("workers.restart_backoff_max: must be >= restart_backoff_initial")
        if self.max_replicas < 0 or self.min_replicas < 0 or self.min_replicas > max(self.max_replicas, 1):
            p.append("workers.min_replicas, max_replicas: need 0 <= min_replicas <= max_replicas (max_replicas 0: "
                     "no elastic pool)")
        for name in ("queue_budget", "scale_in_after", "waiting_timeout"):
            if not getattr(self, name) > 0:
                p.append(f"workers.{name}: must be > 0")
        if self.waiting_room < 0:
            p.append("workers.waiting_room: must be >= 0")


# Keys of a [[models]] entry's own (the rest of [workers] comes in its `workers` sub-table).
MODEL_KEYS = ("name", "aliases", "engine", "model", "local", "remote", "workers", "fallback")
# [workers] keys that a [[models]] entry sets for itself: with [[models]], [workers] must not.
PER_MODEL = ("model", "served_name", "local", "remote")


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """One ``[[models]]`` entry: a model served under ``name`` (and its ``aliases``) by ``local``
    worker processes of ``engine`` running ``model``, plus the workers at ``remote`` URLs; its
    ``workers`` table overrides ``[workers]`` options for it alone."""

    name: str
    aliases: list[str] = field(default_factory=list)
    engine: str = ""  # "" = [workers] engine
    model: str = ""  # checkpoint dir or "tiny"; "" = [workers] model
    local: int = 1
    remote: list[str] = field(default_factory=list)
    workers: WorkersSettings = field(default_factory=WorkersSettings)  # [workers] with this entry's overrides
    fallback: str = ""  # the model that takes this one's traffic while none of its replicas can

    def worker_settings(self) -> WorkersSettings:
        """The ``[workers]`` settings its own workers run with (served under its name)."""
        return replace(self.workers, engine=self.engine or self.workers.engine, model=self.model or self.workers.model,
                       served_name=self.name, local=self.local, remote=list(self.remote))


def served_name_of(ws: WorkersSettings) -> str:
    """The name a worker with these settings announces: the served name, else the model's ("tiny",
    or the checkpoint directory's name)."""
    return ws.served_name or (ws.model if ws.model == "tiny" else PurePath(ws.model.rstrip("/")).name)
