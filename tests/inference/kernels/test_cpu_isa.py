"""Choosing the native kernels' instruction-set level: from what the CPU reports, or forced by
``QUICSERVE_CPU_ISA``, with a clear error for a level that does not exist or cannot run here; and
the build cache keyed by the level. No compiler runs here (test_cpu_ffi builds every level)."""

from __future__ import annotations

import platform

import pytest

pytest.importorskip("jax")

from inference.kernels import cpu_isa  # noqa: E402

# /proc/cpuinfo flags of real CPUs (abridged to what the levels ask about, plus some noise).
_ZEN4 = ("fpu sse2 ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt xsave avx f16c lahf_lm abm bmi1 avx2 bmi2 "
         "avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512_bf16 avx512vbmi avx512_vnni")
_HASWELL = "fpu sse2 ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt xsave avx f16c lahf_lm abm bmi1 avx2 bmi2"
_KNL = _HASWELL + " avx512f avx512cd avx512er avx512pf"  # Xeon Phi: AVX-512 F/CD but no BW/DQ/VL
_NEHALEM = "fpu sse2 ssse3 cx16 sse4_1 sse4_2 popcnt lahf_lm"


def _names(levels: tuple[cpu_isa.Level, ...]) -> list[str]:
    return [lv.name for lv in levels]


@pytest.mark.parametrize("machine,flags,want", [
    ("x86_64", _ZEN4, ["avx512", "avx2", "generic"]),
    ("x86_64", _HASWELL, ["avx2", "generic"]),
    ("x86_64", _KNL, ["avx2", "generic"]),  # x86-64-v4 needs BW, DQ and VL too
    ("x86_64", _NEHALEM, ["generic"]),
    ("x86_64", _HASWELL.replace(" fma", ""), ["generic"]),  # AVX2 without FMA is not v3
    ("aarch64", _ZEN4, ["generic"]),  # x86 levels never on another architecture
    ("x86_64", "", ["generic"]),  # no flags line (not Linux)
])
def test_host_levels_follow_the_cpu_flags(machine: str, flags: str, want: list[str]) -> None:
    assert _names(cpu_isa.host_levels(machine, flags.split())) == want


def test_cpu_features_reads_the_flags_line() -> None:
    cpuinfo = f"processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: {_HASWELL}\nbugs\t\t: sysret_ss_attrs\n"
    assert cpu_isa.cpu_features(cpuinfo) == frozenset(_HASWELL.split())
    assert cpu_isa.cpu_features("processor\t: 0\n") == frozenset()


@pytest.fixture
def zen4(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(cpu_isa, "_cpuinfo", lambda: f"flags\t: {_ZEN4}\n")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.delenv(cpu_isa.ENV_VAR, raising=False)
    return monkeypatch


def test_the_best_level_by_default_and_the_environment_forces_one(zen4: pytest.MonkeyPatch) -> None:
    assert cpu_isa.level().name == "avx512"
    for forced in ("avx2", "generic", "AVX2 ", "avx512"):
        zen4.setenv(cpu_isa.ENV_VAR, forced)
        assert cpu_isa.level().name == forced.strip().lower()
    zen4.setenv(cpu_isa.ENV_VAR, "auto")
    assert cpu_isa.level().name == "avx512"
    assert cpu_isa.level("generic").name == "generic"  # an explicit name beats the environment


def test_an_unknown_level_is_a_clear_error(zen4: pytest.MonkeyPatch) -> None:
    zen4.setenv(cpu_isa.ENV_VAR, "avx10")
    with pytest.raises(ValueError, match=r"QUICSERVE_CPU_ISA='avx10'.*auto or one of avx512, avx2, generic"):
        cpu_isa.level()


def test_a_level_the_cpu_cannot_run_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_isa, "_cpuinfo", lambda: f"flags\t: {_HASWELL}\n")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    with pytest.raises(ValueError, match=r"cannot execute it \(lacks avx512bw, avx512cd, avx512dq, avx512f, "
                                         r"avx512vl\); it can run avx2, generic"):
        cpu_isa.level("avx512")
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    with pytest.raises(ValueError, match="an x86-64 CPU"):
        cpu_isa.level("avx2")


def test_each_level_has_its_own_cached_library(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The cache name carries the level and a hash of its flags, so levels never share a binary and the
    name no longer depends on the CPU that built it."""
    monkeypatch.setenv("QUICSERVE_CACHE_DIR", str(tmp_path))
    paths = {lv.name: cpu_isa.library_path(lv) for lv in cpu_isa.LEVELS}
    assert len(set(paths.values())) == len(cpu_isa.LEVELS)
    for name, path in paths.items():
        assert path.parent == tmp_path and path.name.startswith(f"cpu_kernels-{name}-")
    tweaked = cpu_isa.Level("avx2", (*cpu_isa.LEVELS[1].flags, "-mno-fma"), True, cpu_isa.LEVELS[1].requires)
    assert cpu_isa.library_path(tweaked) != paths["avx2"]
    monkeypatch.setattr(cpu_isa, "_cpuinfo", lambda: f"flags\t: {_NEHALEM}\n")
    assert cpu_isa.library_path(cpu_isa.LEVELS[1]) == paths["avx2"]
