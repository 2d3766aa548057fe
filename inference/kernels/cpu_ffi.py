"""A native CPU paged-decode kernel (``cpu_decode.cc``), built on first use and called through the XLA FFI.

Why: the plain ``jnp`` decode attention runs on CPU as small XLA ops in a
run-time loop that copy every gathered block before reading it and never use
a second core; at batch 32 on the bench model it was ~15-26 ms of a ~32-44
ms step on two threads (``tests/bench/bench_decode.py`` docstring). The
kernel reads each K/V row in place through the block table, once, and
splits the sequences over threads. It serves the float32 cache
only; quantized caches and other dtypes keep the reference.

How: the C++ source is compiled with the system ``g++`` against jaxlib's
FFI headers (``jax.ffi.include_dir()``) into a cache directory keyed by a
hash of the source, the flags, the jaxlib version and the CPU (``-march=native``)
(``$QUICSERVE_CACHE_DIR`` or ``~/.cache/quicserve``), loaded with ctypes and
registered as an FFI target for the CPU platform. Anything missing (no
compiler, a failed build) logs once and :func:`available` returns False, so
callers fall back. ``QUICSERVE_CPU_KERNELS=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

__all__ = ["available", "paged_decode_cpu", "THREADS"]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_decode.cc")
_TARGET = "quicserve_paged_decode_f32"
_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math", "-shared", "-fPIC", "-std=c++17", "-w")
THREADS = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def _cache_dir() -> Path:
    return Path(os.environ.get("QUICSERVE_CACHE_DIR") or Path.home() / ".cache" / "quicserve")


def _cpu_id() -> bytes:
    """The CPU's model and feature flags: ``-march=native`` code must not be reused on another CPU."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor().encode()
    return "".join(x for x in lines if x.startswith(("model name", "flags")))[:4096].encode()


def _build() -> Path:
    src = _SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join(_FLAGS).encode() + jaxlib.__version__.encode() + _cpu_id()).hexdigest()[:16]
    lib = _cache_dir() / f"cpu_decode-{key}.so"
    if lib.exists():
        return lib
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:  # build aside, then rename: safe with concurrent builds
        out = Path(tmp) / lib.name
        cmd = [cxx, *_FLAGS, "-I", jax.ffi.include_dir(), str(_SOURCE), "-o", str(out), "-lpthread"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if res.returncode:
            raise RuntimeError(f"building {_SOURCE.name} failed: {res.stderr[-2000:]}")
        os.replace(out, lib)
    log.info("built the CPU paged-decode kernel: %s", lib)
    return lib


@functools.cache
def _load_and_register() -> None:
    """Build (or find) the library and register its handler, once per process: XLA refuses a second
    registration of the same target from another address, and then fails to start its CPU backend."""
    lib = ctypes.cdll.LoadLibrary(str(_build()))
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.QuicservePagedDecodeF32), platform="cpu")


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered (False, logged once, if it cannot be)."""
    if os.environ.get("QUICSERVE_CPU_KERNELS", "1") == "0":
        return False
    try:
        _load_and_register()
    except Exception as exc:  # noqa: BLE001 -- any failure means "use the reference"
        log.warning("CPU paged-decode kernel unavailable, using the jnp reference: %s", exc)
        return False
    return True


def paged_decode_cpu(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                     context_lens: jax.Array, *, scale: float, threads: int = THREADS) -> jax.Array:
    """``inference.model.attention.paged_decode_attention`` for float32 caches, as one native call.

    Call only when :func:`available` is True. Context lengths past the block table are clamped to it.
    """
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q.astype(jnp.float32), k_cache, v_cache, block_tables.astype(jnp.int32),
                context_lens.astype(jnp.int32), scale=np.float32(scale), threads=np.int64(threads))
