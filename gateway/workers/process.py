"""One local worker process, the parts that need no supervisor: its command line, what runs in
the child before exec, its termination, and the restart backoff. Sans-I/O but for ``terminate``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import sys

from transport.common.worker_options import compilation_cache_dir, to_flags

from .config import WorkersSettings, served_name_of

__all__ = ["Backoff", "WorkerUnusable", "worker_command", "child_setup", "terminate", "STABLE_AFTER"]

STABLE_AFTER = 30.0  # seconds up before a worker's backoff resets


class Backoff:
    """Restart delays: initial, 2x, 4x ... capped; reset after a stable run. Sans-I/O."""

    def __init__(self, initial: float, maximum: float) -> None:
        self.initial, self.maximum = initial, maximum
        self.failures = 0

    def next_delay(self, ran_for: float) -> float:
        if ran_for >= STABLE_AFTER:
            self.failures = 0
        delay = min(self.maximum, self.initial * float(2**self.failures))
        self.failures += 1
        return delay


class WorkerUnusable(RuntimeError):
    """A worker exited before ready with a status that a restart cannot fix (bad options)."""


def worker_command(ws: WorkersSettings, index: int, state_dir: str | None = None) -> list[str]:
    """argv of local worker ``index`` (runs this interpreter, so venvs just work): the typed
    ``[workers]`` options as ``quicserve worker`` flags; ``compilation_cache = "auto"`` is the model's
    directory in the gateway's ``state_dir`` (when given), which its replicas share."""
    listen = ws.listen
    if listen.startswith("unix://") and index:
        listen = f"{listen}-{index}"
    cache = ws.compilation_cache
    if cache == "auto" and state_dir is not None:
        cache = str(compilation_cache_dir(cache, served_name_of(ws), state_dir))
    opts = dataclasses.replace(ws, listen=listen, compilation_cache=cache)
    return [sys.executable, "-m", "gateway.cli", "worker", *to_flags(opts)]


def child_setup() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: die with the gateway


async def terminate(proc: asyncio.subprocess.Process, timeout: float) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
