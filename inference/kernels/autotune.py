"""A small autotuner: block sizes tuned once per shape, cached in a JSON file.

How it works: a kernel asks :meth:`Autotuner.pick` for the block sizes of a
shape key (e.g. ``prefill/gpu/B4-T4096-S4096-H32-KV8-D128-bfloat16``) with a
list of candidates and a ``measure(candidate) -> seconds`` callable. A cached
answer is returned at once; otherwise, when tuning is enabled (the kernel
set enables it for kernels compiled on their accelerator), every candidate is
timed, failures (a tile that does not compile, out of shared memory) are
skipped, the fastest is written to the cache file and logged. With tuning
disabled (interpreted kernels, lowering for another platform) the first
candidate, the default, is returned and nothing is written.

The cache file is ``$QUICSERVE_AUTOTUNE_CACHE`` or
``~/.cache/quicserve/autotune.json``; entries map a shape key to the chosen
candidate's fields and its measured time.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import jax

__all__ = ["Autotuner", "default_cache_path", "time_call"]

log = logging.getLogger(__name__)
C = TypeVar("C")


def default_cache_path() -> Path:
    env = os.environ.get("QUICSERVE_AUTOTUNE_CACHE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "quicserve" / "autotune.json"


def time_call(fn: Callable[[], Any], *, iters: int = 10, clock: Callable[[], float] = time.perf_counter) -> float:
    """Median seconds of ``fn()`` after one warm-up (compile) call."""
    jax.block_until_ready(fn())
    samples = []
    for _ in range(iters):
        start = clock()
        jax.block_until_ready(fn())
        samples.append(clock() - start)
    samples.sort()
    return samples[len(samples) // 2]


class Autotuner:
    """Chooses block sizes per shape key; thread-safe; persists to JSON."""

    def __init__(self, path: Path | None = None, *, enabled: bool) -> None:
        self.path = path if path is not None else default_cache_path()
        self.enabled = enabled
        self._lock = threading.Lock()
        self._entries: dict[str, dict[str, Any]] = self._load()

    def _load(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("autotune cache %s unreadable (%s); starting empty", self.path, exc)
            return {}
        return data if isinstance(data, dict) else {}

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._entries, indent=1, sort_keys=True))
        tmp.replace(self.path)

    def cached(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            return self._entries.get(key)

    def pick(self, key: str, candidates: Sequence[C], measure: Callable[[C], float]) -> C:
        """Best candidate (a dataclass) for ``key``; tunes on first use when enabled."""
        if not candidates:
            raise ValueError("no candidates to choose from")
        kind = type(candidates[0])
        with self._lock:
            entry = self._entries.get(key)
        if entry is not None:
            try:
                return kind(**entry["params"])
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("autotune entry %s invalid (%s); retuning", key, exc)
        if not self.enabled:
            return candidates[0]
        best: tuple[float, C] | None = None
        for cand in candidates:
            try:
                seconds = _isolated(measure, cand)
            except Exception as exc:  # a tile that does not compile is skipped, not fatal
                log.info("autotune %s: %s failed: %s", key, cand, str(exc).splitlines()[0][:200])
                continue
            log.info("autotune %s: %s %.1f us", key, cand, seconds * 1e6)
            if best is None or seconds < best[0]:
                best = (seconds, cand)
        if best is None:
            log.warning("autotune %s: every candidate failed; using the default", key)
            return candidates[0]
        seconds, choice = best
        log.info("autotune %s: chose %s (%.1f us)", key, choice, seconds * 1e6)
        with self._lock:
            self._entries[key] = {"params": dataclasses.asdict(choice), "seconds": seconds}  # type: ignore[call-overload]
            try:
                self._save()
            except OSError as exc:
                log.warning("autotune cache %s not written: %s", self.path, exc)
        return choice


def _isolated(measure: Callable[[C], float], cand: C) -> float:
    """Run ``measure`` on a fresh thread.

    Tuning is triggered while the caller's ``jit`` is tracing; JAX's trace
    state is per thread, so on a new thread the candidate compiles and runs
    as a normal computation instead of being staged into the caller's graph.
    """
    result: list[float] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(measure(cand))
        except BaseException as exc:  # re-raised on the calling thread
            error.append(exc)

    worker = threading.Thread(target=run, name="autotune", daemon=True)
    worker.start()
    worker.join()
    if error:
        raise error[0]
    return result[0]

