"""URL -> channel choice: ``tcp://``, ``unix://``, ``rdma://`` with a fallback chain.

For ``rdma://host:port`` the order is: a hardware RDMA device, else a
soft-RoCE (rxe) device, else plain TCP on the same host and port. The choice
is logged once, with the reason. With ``rdma_required=True`` the fallback is
an :class:`~transport.errors.RdmaUnavailable` error instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from .errors import RdmaUnavailable, TransportError

__all__ = ["Target", "Choice", "parse_url", "choose", "BadURL"]

log = logging.getLogger("transport.select")


class BadURL(TransportError, ValueError):
    """The transport URL cannot be used."""


@dataclass(frozen=True, slots=True)
class Target:
    scheme: str  # "tcp" | "unix" | "rdma"
    host: str
    port: int
    path: str  # unix socket path


@dataclass(frozen=True, slots=True)
class Choice:
    kind: str  # "rdma" | "tcp" | "unix"
    target: Target
    device: str | None
    reason: str


def parse_url(url: str) -> Target:
    """Parse ``tcp://host:port``, ``unix:///abs/path`` or ``rdma://host:port``."""
    try:
        parts = urlsplit(url)
        scheme = parts.scheme
        if scheme == "unix":
            path = parts.path
            if parts.netloc or not path.startswith("/"):
                raise BadURL(f"{url!r}: a unix URL needs an absolute path, e.g. unix:///run/qs.sock")
            return Target("unix", "", 0, path)
        if scheme not in ("tcp", "rdma"):
            raise BadURL(f"{url!r}: scheme must be tcp://, unix:// or rdma://")
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        if isinstance(exc, BadURL):
            raise
        raise BadURL(f"{url!r}: {exc}") from None
    if not host or port is None or parts.path not in ("", "/"):
        raise BadURL(f"{url!r}: expected {scheme}://host:port")
    return Target(scheme, host, port, "")


def _probe_rdma() -> tuple[str | None, str]:
    """(device to use or None, why)."""
    from . import rdma  # the module is light; pyverbs itself is imported lazily below

    devices = rdma.list_devices()
    if not devices:
        return None, "no RDMA device (/sys/class/infiniband is empty or missing)"
    hard = [d for d in devices if not d.soft and d.active]
    soft = [d for d in devices if d.soft and d.active]
    if not hard and not soft:
        return None, f"RDMA devices {[d.name for d in devices]} have no ACTIVE port"
    try:
        rdma.import_pyverbs()
    except RdmaUnavailable as exc:
        return None, str(exc)
    if hard:
        return hard[0].name, f"hardware RDMA device {hard[0].name}"
    return soft[0].name, f"no hardware RDMA device; soft-RoCE device {soft[0].name}"


def choose(
    url: str, *, rdma_required: bool = False, probe: Callable[[], tuple[str | None, str]] = _probe_rdma
) -> Choice:
    """Decide how to carry ``url``; logs one line for ``rdma://``."""
    target = parse_url(url)
    if target.scheme != "rdma":
        return Choice(target.scheme, target, None, "requested")
    device, why = probe()
    if device is not None:
        log.info("transport %s: using RDMA (%s)", url, why)
        return Choice("rdma", target, device, why)
    if rdma_required:
        raise RdmaUnavailable(f"{url}: RDMA is required but unavailable: {why}")
    fallback = Target("tcp", target.host, target.port, "")
    log.warning("transport %s: falling back to tcp://%s:%d (%s)", url, target.host, target.port, why)
    return Choice("tcp", fallback, None, why)
