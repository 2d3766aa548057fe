"""TPU weight-only quantized matmul (Pallas, Mosaic lowering) against the XLA path on the same codes.

Runs under Pallas' TPU interpreter on CPU; lowering for TPU is checked with
``jax.export(..., platforms=["tpu"])``. Shapes are ragged on every axis so the
padding to (8, 128) tiles is exercised, and the contraction spans several
grid steps so the VMEM accumulator carries across them.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import export  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from inference.kernels.quant import quantize_weight, quantized_matmul  # noqa: E402
from inference.kernels.tpu_quant_matmul import TpuMatmulBlocks, tpu_quantized_matmul  # noqa: E402

INTERPRET = pltpu.InterpretParams()


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("m,k,n,groups", [(5, 300, 200, None), (33, 512, 136, None), (12, 512, 136, 2)])
def test_matches_xla_path(kind: str, m: int, k: int, n: int, groups: int | None) -> None:
    rng = np.random.default_rng(11)
    w = jnp.asarray(rng.standard_normal((k, n), np.float32) * np.linspace(0.1, 2.0, n, dtype=np.float32))
    x = jnp.asarray(rng.standard_normal((2, m, k), np.float32))
    qw = quantize_weight(w, kind, group_size=None if groups is None else k // groups)
    got = tpu_quantized_matmul(x, qw.codes, qw.scale, blocks=TpuMatmulBlocks(16, 128, 128), interpret=INTERPRET)
    want = quantized_matmul(x, qw)
    assert got.shape == (2, m, n) and got.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-4, rtol=1e-5)


def test_bfloat16_activations() -> None:
    rng = np.random.default_rng(12)
    w = jnp.asarray(rng.standard_normal((256, 128), np.float32))
    x = jnp.asarray(rng.standard_normal((8, 256), np.float32)).astype(jnp.bfloat16)
    qw = quantize_weight(w, "int8")
    got = tpu_quantized_matmul(x, qw.codes, qw.scale, interpret=INTERPRET)
    want = quantized_matmul(x.astype(jnp.float32), qw)
    assert got.dtype == jnp.bfloat16
    rel = float(jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want))
    assert rel < 1e-2


def test_rejects_bad_shapes_and_tiles() -> None:
    x = jnp.zeros((4, 256), jnp.float32)
    codes = jnp.zeros((256, 128), jnp.int8)
    with pytest.raises(ValueError, match="shape mismatch"):
        tpu_quantized_matmul(x, codes, jnp.ones((64,), jnp.float32))
    with pytest.raises(ValueError, match="multiple of 128"):
        tpu_quantized_matmul(x, codes, jnp.ones((4, 128), jnp.float32))  # groups of 64 rows
    with pytest.raises(ValueError, match="block_n"):
        TpuMatmulBlocks(8, 64, 128)
    with pytest.raises(ValueError, match="block_m"):
        TpuMatmulBlocks(4, 128, 128)


@pytest.mark.parametrize("code", [jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("groups", [None, 32])
def test_lowers_for_tpu(code, groups) -> None:
    sd = jax.ShapeDtypeStruct
    scale = sd((1024,) if groups is None else (groups, 1024), jnp.float32)
    exported = export.export(jax.jit(lambda x, c, s: tpu_quantized_matmul(x, c, s)), platforms=["tpu"])(
        sd((8, 4096), jnp.bfloat16), sd((4096, 1024), code), scale
    )
    assert "tpu_custom_call" in exported.mlir_module()


def test_pallas_weights_route_to_the_tpu_kernel_on_tpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The TPU family's matmul takes the Mosaic kernel for per-channel weights and groups of 128 rows
    (interpreted here); group-wise weights with groups under 128 rows take the XLA path."""
    import functools

    from inference.kernels import pallas
    from inference.kernels.kernel_set import build_kernels

    calls = []
    kernel = functools.partial(tpu_quantized_matmul, interpret=INTERPRET)
    monkeypatch.setattr(pallas, "tpu_quantized_matmul", lambda *a, **kw: calls.append(kw) or kernel(
        *a, **{k: v for k, v in kw.items() if k != "interpret"}))
    monkeypatch.setattr(pallas, "tuned_tpu_matmul_blocks", lambda tuner, x, codes, platform: TpuMatmulBlocks(8, 128, 128))
    matmul = build_kernels("pallas", interpret=True, target="tpu").matmul
    rng = np.random.default_rng(13)
    w = jnp.asarray(rng.standard_normal((256, 128), np.float32))
    x = jnp.asarray(rng.standard_normal((3, 256), np.float32))
    for group, routed in ((None, True), (128, True), (64, False)):
        calls.clear()
        qw = quantize_weight(w, "int8", group_size=group)
        np.testing.assert_allclose(np.asarray(matmul(x, qw)), np.asarray(quantized_matmul(x, qw)), atol=2e-4,
                                   rtol=1e-5)
        assert bool(calls) == routed, group
