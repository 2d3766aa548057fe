"""``[log]``: level, progress display, format, access log; ``[observability]``: where /metrics is served."""

from __future__ import annotations

from dataclasses import dataclass

from transport.common.logfmt import FORMATS as LOG_FORMATS

__all__ = ["LogSettings", "ObservabilitySettings", "parse_listen"]


@dataclass(frozen=True, slots=True)
class LogSettings:
    level: str = "info"
    progress: str = "auto"  # "auto" (bar on a TTY, lines otherwise) | "bar" | "lines" | "off"
    format: str = "text"  # "text" | "json" (one object a line); workers get the same
    access_log: bool = False  # one line per finished request on the quicserve.access logger

    def _validate(self, p: list[str]) -> None:
        if self.format not in LOG_FORMATS:
            p.append(f"log.format: {self.format!r} is not one of {', '.join(LOG_FORMATS)}")
        if self.level.lower() not in ("debug", "info", "warning", "error", "critical"):
            p.append(f"log.level: {self.level!r} is not a log level")
        if self.progress not in ("auto", "bar", "lines", "off"):
            p.append(f"log.progress: {self.progress!r} is not one of auto, bar, lines, off")


def parse_listen(value: str) -> tuple[str, int]:
    """``"127.0.0.1:9464"`` or ``"[::1]:9464"`` -> (host, port); ``ValueError`` saying what is wrong."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{value!r} is not HOST:PORT (e.g. 127.0.0.1:9464; port 0: any free port)")
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError(f"{value!r}: an IPv6 address goes in brackets, e.g. [::1]:9464")
        host = host[1:-1]
    return host, int(port)


@dataclass(frozen=True, slots=True)
class ObservabilitySettings:
    # "HOST:PORT": /metrics is served on a listener of its own there, and no longer on the public
    # ones (404 there); "": on the public listeners, open like /healthz (see README, "Metrics")
    metrics_listen: str = ""

    def _validate(self, p: list[str]) -> None:
        if self.metrics_listen:
            try:
                parse_listen(self.metrics_listen)
            except ValueError as e:
                p.append(f"observability.metrics_listen: {e}")
