"""The GPU benchmark script runs end to end on CPU (``--smoke``: tiny shapes, interpreted kernels)."""

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
