"""The kernel seam: which family ``attention`` names on each platform, the choices it refuses, and the
worker's option values it accepts. (What each family computes is checked per kernel and, through the
whole runner, in ``tests/inference/model/test_runner.py``.)"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from inference.kernels import cpu_ffi, projections, rope
from inference.kernels.autotune import Autotuner
from inference.kernels.kernel_set import ATTENTION, build_kernels, current_platform
from transport.common.worker_options import ATTENTION_BACKENDS, WorkerOptions

OFF = Autotuner(enabled=False)  # lowering for an accelerator this host lacks: nothing to time


@pytest.mark.parametrize("platform,family", [("gpu", "pallas"), ("tpu", "pallas"), ("cpu", "native")])
def test_auto_is_pallas_on_accelerators_and_native_on_cpu(platform: str, family: str) -> None:
    assert cpu_ffi.available(), "the native CPU kernels did not build (is g++ installed?)"
    ks = build_kernels("auto", platform=platform, tuner=OFF)
    assert (ks.platform, ks.attention) == (platform, family)
    assert (ks.pack is projections.pack_weight) == (platform == "cpu")  # projections packed for the native matmul


def test_every_worker_option_value_is_a_kernel_family() -> None:
    """The worker's --attention choices (transport.common.worker_options) are names the seam knows."""
    assert set(ATTENTION_BACKENDS) <= set(ATTENTION)
    assert WorkerOptions().attention in ATTENTION


def test_the_native_kernels_serve_float32_models_only() -> None:
    f32, bf16 = build_kernels("native", platform="cpu"), build_kernels("native", dtype=jnp.bfloat16, platform="cpu")
    assert (f32.attention, f32.rope_write) == ("native", rope.rope_write_native)
    assert (bf16.attention, bf16.pack) == ("xla", None)
    quantized = build_kernels("native", kv_quant="int8", platform="cpu")  # native prefill, XLA decode and RoPE
    assert quantized.attention == "native" and quantized.rope_write is not rope.rope_write_native


@pytest.mark.parametrize("attention,platform,interpret,target,error", [
    ("cuda", "cpu", False, None, "unknown attention kernels 'cuda'"),
    ("native", "gpu", False, None, "native kernels are CPU kernels"),
    ("pallas", "cpu", False, None, "compile for GPU and TPU"),
    ("pallas", "gpu", False, "tpu", "the tpu Pallas kernels compile on tpu only"),
    ("pallas", "cpu", True, "rocm", "unknown Pallas family 'rocm'"),
])
def test_choices_that_cannot_run_are_refused(attention: str, platform: str, interpret: bool, target: str | None,
                                             error: str) -> None:
    with pytest.raises(ValueError, match=error):
        build_kernels(attention, platform=platform, interpret=interpret, target=target, tuner=OFF)


def test_interpreted_pallas_runs_either_family_anywhere() -> None:
    for target in ("gpu", "tpu"):
        ks = build_kernels("pallas", platform="cpu", interpret=True, target=target)
        assert (ks.attention, ks.pack) == ("pallas", None)


def test_xla_and_reference_run_anywhere_and_only_cpu_takes_the_multiply_reduce() -> None:
    for platform in ("cpu", "gpu", "tpu"):
        for name in ("xla", "reference"):
            ks = build_kernels(name, platform=platform)
            assert ks.attention == name and ks.linear.keywords == {"mulreduce": platform == "cpu"}
    assert current_platform() in ("cpu", "gpu", "tpu")
