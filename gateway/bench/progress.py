"""A progress bar (rich) while a run goes, on a terminal only; nothing otherwise."""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import TracebackType

__all__ = ["Progress", "want_progress"]


def want_progress(mode: str) -> bool:
    return mode == "on" or (mode == "auto" and sys.stderr.isatty())


class Progress(AbstractContextManager["Progress"]):
    """``with Progress(on, "rate 10/s", total) as p: ... p.advance(1)``; ``total`` None: unknown."""

    def __init__(self, on: bool, title: str, total: int | None) -> None:
        self._bar = None
        self._task = None
        if on:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            self._task = self._bar.add_task(title, total=total)

    def __enter__(self) -> Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.stop()

    @property
    def advance(self) -> Callable[[int], None] | None:
        """The callback for each finished request, or None when there is no bar."""
        bar, task = self._bar, self._task
        if bar is None or task is None:
            return None
        return lambda n: bar.advance(task, n)
