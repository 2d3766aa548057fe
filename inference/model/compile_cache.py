"""JAX's persistent compilation cache: where a worker keeps its compiled shapes across restarts.

Why every entry is kept: JAX caches only compilations that took at least a second and entries of
some size by default, and most of a small model's shapes compile faster than that -- yet a worker
compiles dozens of them before it is ready, so together they are most of a cold start (the tiny
model on CPU: a first start against a restart over its cache, tests/bench/bench_cold_start.py).
Replicas of one model share the directory (the ``compilation_cache`` option,
:func:`~transport.common.worker_options.compilation_cache_dir`): JAX keys an entry by the
computation, the compile options and the backend, so a second replica, or the first after a
restart, loads what another compiled; entries are written whole (a rename), so concurrent writers
are safe.
"""

from __future__ import annotations

from pathlib import Path

import jax

__all__ = ["enable"]


def enable(directory: Path) -> None:
    """Use ``directory`` (created if missing) as this process's persistent compilation cache, for
    every compilation from now on."""
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_enable_compilation_cache", True)
