"""Which instruction set the native CPU kernels are built for, and the build itself.

Why named levels: built with ``-march=native`` every machine compiled a different instruction set
(and with ``-fassociative-math`` a different reduction order), so a result checked on one CPU said
nothing about another, and the cache held one binary per CPU model. Each level here is a fixed set
of compiler flags; the loader picks the best level the CPU reports (:func:`host_levels`), and
``QUICSERVE_CPU_ISA`` forces one. Tests build and run every level the host can execute, so one
AVX-512 machine checks the AVX2 and portable code paths too.

Levels, best first:

- ``avx512``: x86-64-v4 (AVX-512 F/BW/CD/DQ/VL), the compiler's own loops 512 bits wide.
- ``avx2``: x86-64-v3 (AVX2, FMA, F16C, BMI1/2): the hand-written 8-wide paths of the kernels.
- ``generic``: the compiler's default target (SSE2 on x86-64, any other architecture), the
  kernels' portable C++ paths.

The library goes into a cache directory (``$QUICSERVE_CACHE_DIR`` or ``~/.cache/quicserve``) under a
name keyed by a hash of the sources, the level and its flags and the jaxlib version: the binary no
longer depends on the CPU that built it, only on the level.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import jax

__all__ = ["Level", "LEVELS", "ENV_VAR", "level", "host_levels", "cpu_features", "library_path", "build"]

log = logging.getLogger(__name__)

ENV_VAR = "QUICSERVE_CPU_ISA"

_DIR = Path(__file__).parent
SOURCES = (_DIR / "cpu_decode.cc", _DIR / "cpu_prefill.cc", _DIR / "cpu_matmul.cc", _DIR / "cpu_rope.cc")
HEADERS = (_DIR / "cpu_parallel.h", _DIR / "cpu_simd.h")
# Flags every level shares. The relaxed-math ones let the compiler vectorize the softmax and
# reduction loops; the tests bound the kernels' error against float64 with that freedom allowed.
_COMMON = ("-O3", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-shared",
           "-fPIC", "-std=c++17", "-w")
_X86 = ("x86_64", "amd64")
# /proc/cpuinfo flag names of the x86-64 psABI levels (v2 under v3 under v4).
_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"})
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True, slots=True)
class Level:
    """One instruction-set level: its name, its compiler flags, and what the CPU must report to run it."""

    name: str
    flags: tuple[str, ...]
    x86_only: bool
    requires: frozenset[str]

    def runs_on(self, machine: str, features: frozenset[str]) -> bool:
        """Whether a CPU of this architecture (``platform.machine()``) and these feature flags executes it."""
        if self.x86_only and machine.lower() not in _X86:
            return False
        return self.requires <= features


LEVELS = (
    Level("avx512", ("-march=x86-64-v4", "-mtune=generic", "-mprefer-vector-width=512"), True, _V4),
    Level("avx2", ("-march=x86-64-v3", "-mtune=generic"), True, _V3),
    Level("generic", (), False, frozenset()),
)
_BY_NAME = {lv.name: lv for lv in LEVELS}


@functools.cache
def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_features(cpuinfo: str | None = None) -> frozenset[str]:
    """The feature flags the kernel reports for the first CPU (``/proc/cpuinfo``'s ``flags`` line);
    empty where there is none (not Linux, not x86), which leaves the ``generic`` level."""
    for line in (_cpuinfo() if cpuinfo is None else cpuinfo).splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def host_levels(machine: str | None = None, features: Iterable[str] | None = None) -> tuple[Level, ...]:
    """The levels this CPU executes, best first (``generic`` always last)."""
    machine = platform.machine() if machine is None else machine
    feats = cpu_features() if features is None else frozenset(features)
    return tuple(lv for lv in LEVELS if lv.runs_on(machine, feats))


def level(name: str | None = None) -> Level:
    """The level to build and load: ``name``, else ``$QUICSERVE_CPU_ISA``, else (unset or ``auto``) the
    best the CPU executes. A name that is not a level, or a level this CPU cannot execute, is a
    ValueError: forcing it must not end in an illegal instruction inside a model step."""
    name = name or os.environ.get(ENV_VAR, "").strip().lower() or "auto"
    runnable = host_levels()
    if name == "auto":
        return runnable[0]
    if name not in _BY_NAME:
        raise ValueError(f"{ENV_VAR}={name!r}: not a CPU kernel level; choose auto or one of {', '.join(_BY_NAME)}")
    chosen = _BY_NAME[name]
    if chosen not in runnable:
        missing = sorted(chosen.requires - cpu_features()) or [f"an x86-64 CPU (this is {platform.machine()})"]
        raise ValueError(f"{ENV_VAR}={name}: this CPU cannot execute it (lacks {', '.join(missing)}); "
                         f"it can run {', '.join(lv.name for lv in runnable)}")
    return chosen


def _cache_dir() -> Path:
    return Path(os.environ.get("QUICSERVE_CACHE_DIR") or Path.home() / ".cache" / "quicserve")


def library_path(lv: Level) -> Path:
    """Where this level's library is cached: named by the level and a hash of the sources, its flags
    and the jaxlib version (whose FFI headers it is built against)."""
    src = b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    ident = "\0".join((lv.name, *_COMMON, *lv.flags, importlib.metadata.version("jaxlib"))).encode()
    return _cache_dir() / f"cpu_kernels-{lv.name}-{hashlib.sha256(src + ident).hexdigest()[:16]}.so"


def build(lv: Level) -> Path:
    """The kernels' shared library for this level: from the cache, else compiled into it with ``$CXX``
    (default g++) against jaxlib's FFI headers. RuntimeError when there is no compiler or it fails."""
    flags = (*_COMMON, *lv.flags)
    lib = library_path(lv)
    if lib.exists():
        return lib
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:  # build aside, then rename: safe with concurrent builds
        out = Path(tmp) / lib.name
        # One compiler per source, all at once (a level took ~20-40 s serially here), then one link.
        objs = [Path(tmp) / f"{src.stem}.o" for src in SOURCES]
        procs = [subprocess.Popen([cxx, *flags, "-c", "-I", jax.ffi.include_dir(), "-I", str(_DIR), str(src), "-o",
                                   str(obj)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for src, obj in zip(SOURCES, objs, strict=True)]
        errors = [err for proc in procs for err in [proc.communicate(timeout=300)[1]] if proc.returncode]
        if not errors:
            res = subprocess.run([cxx, *flags, *map(str, objs), "-o", str(out), "-lpthread"], capture_output=True,
                                 text=True, timeout=300)
            errors = [res.stderr] if res.returncode else []
        if errors:
            raise RuntimeError(f"building the CPU kernels ({lv.name}) failed: {errors[0][-2000:]}")
        os.replace(out, lib)
    log.info("built the native CPU kernels for %s: %s", lv.name, lib)
    return lib
