"""Remote workers found through DNS: ``--worker-dns NAME:PORT`` (a Kubernetes headless Service).

How it works: a headless Service's name resolves to one A/AAAA record per ready
worker pod, so the set of worker URLs is "whatever NAME resolves to now".
:class:`DnsWatch` is the sans-I/O core: it is told when a resolution succeeded
or failed (with ``now``), keeps the current set of ``tcp://ADDR:PORT`` URLs and
returns what was added and removed. A failure that may be transient (timeout,
SERVFAIL, no network) keeps the set as it was -- a DNS hiccup must not take
every worker out of the pool -- while "no such name" (the Service has no ready
pod) empties it. :func:`watch_workers` is the asyncio adapter: resolve, feed,
call back, sleep until the core's next deadline; resolver and sleep are
arguments so tests drive it with a stub and a fake clock.

Hooks (the lead wires them): mount :class:`DiscoverySettings` as ``[discovery]``, the CLI's
``--worker-dns NAME:PORT`` (repeatable) filling ``discovery.worker_dns``, and let
``workers.local = 0`` with only ``worker_dns`` pass validation; in serve, one task per entry:
``watch_workers(spec, supervisor.add_remote, supervisor.remove_remote,
interval=settings.discovery.interval)``, cancelled at drain -- the supervisor gains
``add_remote(url)`` (a :class:`RemoteWorker` started like the configured ones) and
``remove_remote(url)`` (stop it and take it out of the pool).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

__all__ = ["DiscoverySettings", "DnsChange", "DnsWatch", "NameNotFound", "Resolver", "getaddrinfo_resolver",
           "parse_worker_dns", "watch_workers", "worker_url"]

log = logging.getLogger("quicserve.discovery")

DEFAULT_INTERVAL = 5.0  # seconds between resolutions (cluster DNS TTLs are 5-30 s)

Resolver = Callable[[str, int], Awaitable[list[str]]]
"""``(host, port) -> addresses``; raises :class:`NameNotFound` when the name has no records."""


@dataclass(frozen=True, slots=True)
class DiscoverySettings:
    """The ``[discovery]`` settings section (to be mounted in :mod:`gateway.settings`)."""

    worker_dns: list[str] = field(default_factory=list)  # "NAME:PORT" entries, e.g. from --worker-dns
    interval: float = DEFAULT_INTERVAL

    def _validate(self, p: list[str]) -> None:
        for spec in self.worker_dns:
            try:
                parse_worker_dns(spec)
            except ValueError as e:
                p.append(f"discovery.worker_dns: {e}")
        if self.interval <= 0:
            p.append("discovery.interval: must be > 0")


class NameNotFound(LookupError):
    """The name exists nowhere (NXDOMAIN / EAI_NONAME): no worker is up."""


@dataclass(frozen=True, slots=True)
class DnsChange:
    added: tuple[str, ...]
    removed: tuple[str, ...]


def parse_worker_dns(spec: str) -> tuple[str, int]:
    """``"quicserve-worker.ns.svc.cluster.local:7000"`` -> (host, port)."""
    host, sep, port = spec.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{spec!r} is not NAME:PORT")
    return host, int(port)


def worker_url(address: str, port: int) -> str:
    """The transport URL of one resolved address (IPv6 in brackets)."""
    ip = ipaddress.ip_address(address)
    return f"tcp://[{ip}]:{port}" if ip.version == 6 else f"tcp://{ip}:{port}"


class DnsWatch:
    """The current worker URLs behind one name; feed it results, get changes. Sans-I/O."""

    def __init__(self, spec: str, interval: float) -> None:
        self.host, self.port = parse_worker_dns(spec)
        self.interval = interval
        self.urls: frozenset[str] = frozenset()
        self.next_at = 0.0  # resolve at once
        self.failures = 0

    def resolved(self, addresses: Iterable[str], now: float) -> DnsChange:
        self.failures = 0
        self.next_at = now + self.interval
        return self._set(frozenset(worker_url(a, self.port) for a in addresses))

    def not_found(self, now: float) -> DnsChange:
        self.failures = 0
        self.next_at = now + self.interval
        return self._set(frozenset())

    def failed(self, now: float) -> DnsChange:
        """A transient failure: keep the workers we have, try again after the usual interval."""
        self.failures += 1
        self.next_at = now + self.interval
        return DnsChange((), ())

    def _set(self, urls: frozenset[str]) -> DnsChange:
        added, removed = tuple(sorted(urls - self.urls)), tuple(sorted(self.urls - urls))
        self.urls = urls
        return DnsChange(added, removed)


async def getaddrinfo_resolver(host: str, port: int) -> list[str]:
    """The system resolver (cluster DNS inside a pod), through the loop's executor."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        if e.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            raise NameNotFound(host) from e
        raise
    return sorted({str(info[4][0]) for info in infos})


async def watch_workers(spec: str, on_added: Callable[[str], object], on_removed: Callable[[str], object], *,
                        interval: float = DEFAULT_INTERVAL,
                        resolver: Resolver = getaddrinfo_resolver,
                        clock: Callable[[], float] | None = None,
                        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep) -> None:
    """Resolve ``spec`` every ``interval`` s until cancelled; report each worker URL that comes or goes."""
    watch = DnsWatch(spec, interval)
    now = clock if clock is not None else asyncio.get_running_loop().time
    while True:
        try:
            change = watch.resolved(await resolver(watch.host, watch.port), now())
        except NameNotFound:
            change = watch.not_found(now())
        except (OSError, TimeoutError) as e:
            change = watch.failed(now())
            log.warning("resolving %s failed (%s); keeping %d worker(s)", spec, e, len(watch.urls))
        for url in change.added:
            log.info("worker %s appeared behind %s", url, spec)
            on_added(url)
        for url in change.removed:
            log.info("worker %s left %s", url, spec)
            on_removed(url)
        await sleep(max(0.0, watch.next_at - now()))
