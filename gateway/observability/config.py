"""``[log]``: level, progress display, format, access log."""

from __future__ import annotations

from dataclasses import dataclass

from transport.common.logfmt import FORMATS as LOG_FORMATS

__all__ = ["LogSettings"]


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
