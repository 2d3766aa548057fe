"""The benchmark scripts run end to end on CPU: the GPU one with ``--smoke`` (tiny shapes, interpreted
kernels), the CPU levels one with one call per case."""

from __future__ import annotations

import pytest

pytest.importorskip("jax")

from tests.bench import gpu_kernels  # noqa: E402


def test_gpu_benchmark_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_kernels.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "check prefill: relative L2 error" in out and "MISMATCH" not in out
    for label in ("float32", "int8", "fp8"):
        assert f"page16 {label}" in out
    assert "TFLOP/s" in out and "TB/s" in out and "targets met" in out
    # the whole-model checks (tests/bench/gpu_model_steps.py): chunked prefill's mixed pass, a sharded step
    assert "check mixed pass: the decodes' logits" in out and "check chunked prompt" in out
    assert "check TP=1 prefill logits" in out and "check TP=1 decode logits" in out


def test_cpu_levels_benchmark_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """bench_cpu_levels runs every kernel case and prints one row each (one call, the default level)."""
    from inference.kernels import cpu_ffi, cpu_isa
    from tests.bench import bench_cpu_levels

    level = cpu_isa.level().name
    assert cpu_ffi.available(level), "the native CPU kernels did not build (is g++ installed?)"
    assert bench_cpu_levels.main(["--levels", level, "--rounds", "1", "--calls", "1", "--threads", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.endswith(" 1.00")]
    assert len(rows) == 6, rows
