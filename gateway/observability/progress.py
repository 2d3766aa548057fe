"""Worker start-up progress (load / compile) for humans.

Workers print ``{"event": "progress", "stage", "done", "total", "message"}``
lines; the supervisor feeds them here. On a TTY (mode "bar") one line per
worker is redrawn in place; otherwise (mode "lines") a line is logged when a
stage starts, every 25 % and when it completes, so logs stay short.
"""

from __future__ import annotations

import sys
from typing import TextIO

__all__ = ["ProgressDisplay"]

_WIDTH = 24


class ProgressDisplay:
    def __init__(self, mode: str = "auto", out: TextIO | None = None) -> None:
        self.out = out if out is not None else sys.stderr
        if mode == "auto":
            mode = "bar" if self.out.isatty() else "lines"
        self.mode = mode
        self._last: dict[tuple[str, str], int] = {}  # (worker, stage) -> last quartile shown
        self._bar_open = False

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def _end_bar(self) -> None:
        if self._bar_open:
            self._write("\n")
            self._bar_open = False

    def progress(self, worker: str, stage: str, done: int, total: int, message: str = "") -> None:
        if self.mode == "off":
            return
        total = max(total, 0)
        frac = min(1.0, done / total) if total else 0.0
        if self.mode == "bar":
            filled = int(frac * _WIDTH)
            bar = "#" * filled + "-" * (_WIDTH - filled)
            count = f"{done}/{total}" if total else f"{done}"
            self._write(f"\r\x1b[2K{worker}: {stage:<8} [{bar}] {count} {message}"[:200])
            self._bar_open = True
            return
        quartile = 4 if total and done >= total else int(frac * 4)
        key = (worker, stage)
        if self._last.get(key, -1) >= quartile:
            return
        self._last[key] = quartile
        count = f"{done}/{total}" if total else str(done)
        self._write(f"{worker}: {stage} {count} {message}".rstrip() + "\n")

    def note(self, worker: str, text: str) -> None:
        """A one-off line (ready, crashed, restarting)."""
        if self.mode == "off":
            return
        self._end_bar()
        self._write(f"{worker}: {text}\n")
