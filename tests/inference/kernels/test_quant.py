"""KV-cache quantization (written incrementally, per block+head scales) and weight-only quantization."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from inference.kernels.kernel_set import build_kernels  # noqa: E402
from inference.kernels.quant import (  # noqa: E402
    QMAX,
    QuantizedWeight,
    dequantize_blocks,
    init_quantized_cache,
    kv_read_bytes,
    kv_scale,
    quantize_blocks,
    quantize_weight,
    quantized_matmul,
    write_quantized_kv,
)

N, BS, KV, D = 6, 8, 2, 16


def _tokens(t: int, seed: int, scale: float = 1.0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal((t, KV, D), np.float32) * scale)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantize_blocks_roundtrip_error(kind: str) -> None:
    x = jnp.asarray(np.random.default_rng(0).standard_normal((N, BS, KV, D), np.float32))
    codes, scales = quantize_blocks(x, kind)
    assert scales.shape == (N, KV)
    ideal = np.abs(np.asarray(x)).max(axis=(1, 3)) / QMAX[kind]
    if kind == "int8":
        np.testing.assert_allclose(np.asarray(scales), ideal, rtol=1e-6)
    else:  # the power of two at or above amax / 448
        got = np.asarray(scales)
        assert (got >= ideal).all() and (got < 2 * ideal).all()
        np.testing.assert_array_equal(np.exp2(np.round(np.log2(got))), got)
    err = np.abs(np.asarray(dequantize_blocks(codes, scales) - x))
    s = np.asarray(scales)[:, None, :, None]
    if kind == "int8":
        assert (err <= 0.5 * s + 1e-6).all()  # half a step
    else:  # e4m3: 3 mantissa bits -> relative half-ulp 1/16; subnormals near 0: absolute
        assert (err <= np.abs(np.asarray(x)) / 16 + s * 2.0**-9 + 1e-6).all()


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_prefill_write_of_fresh_blocks_equals_block_quantization(kind: str) -> None:
    """Writing 2 full blocks in one call gives exactly the codes/scales of quantizing them whole."""
    x = _tokens(2 * BS, seed=1)
    codes, scales = init_quantized_cache(N, BS, KV, D, kind)
    blocks = jnp.asarray([3] * BS + [1] * BS)
    slots = jnp.asarray(list(range(BS)) * 2)
    codes, scales = write_quantized_kv(codes, scales, x, blocks, slots)
    want_codes, want_scales = quantize_blocks(x.reshape(2, BS, KV, D), kind)
    np.testing.assert_array_equal(np.asarray(scales[jnp.asarray([3, 1])]), np.asarray(want_scales))
    np.testing.assert_array_equal(
        np.asarray(codes[jnp.asarray([3, 1])], np.float32), np.asarray(want_codes, np.float32)
    )
    assert float(jnp.abs(scales[0]).max()) == 0.0  # untouched blocks stay empty


@pytest.mark.parametrize("kind,bound", [("int8", 0.02), ("fp8", 0.06)])
def test_token_by_token_writes_with_growing_values(kind: str, bound: float) -> None:
    """Decode-style writes whose magnitude grows: the scale follows the block max, error stays small."""
    x = _tokens(BS, seed=2) * jnp.linspace(0.1, 3.0, BS)[:, None, None]
    codes, scales = init_quantized_cache(N, BS, KV, D, kind)
    for t in range(BS):
        codes, scales = write_quantized_kv(codes, scales, x[t : t + 1], jnp.asarray([4]), jnp.asarray([t]))
    want_scale = np.asarray(kv_scale(jnp.abs(x).max(axis=(0, 2)), kind))
    np.testing.assert_allclose(np.asarray(scales[4]), want_scale, rtol=1e-6)
    got = dequantize_blocks(codes, scales)[4]
    rel = float(jnp.linalg.norm(got - x) / jnp.linalg.norm(x))
    assert rel < bound


def test_kv_scale_worked_by_hand() -> None:
    """int8: amax / 127. fp8: amax / 448 rounded up to a power of two (exact powers stay)."""
    amax = jnp.asarray([0.0, 127.0, 448.0, 449.0, 300.0, 0.5])
    np.testing.assert_allclose(np.asarray(kv_scale(amax, "int8")), np.asarray(amax) / 127, rtol=1e-7)
    np.testing.assert_array_equal(np.asarray(kv_scale(amax, "fp8")), [0.0, 0.5, 1.0, 2.0, 1.0, 2.0**-9])


def test_fp8_token_by_token_writes_equal_whole_block_quantization() -> None:
    """Scale growth by powers of two re-encodes fp8 codes exactly: no double rounding.

    Tokens grow 30x over the block, so the scale grows several times; the codes
    end up as if the finished block had been quantized in one go. (Codes that
    drop into e4m3's subnormal range, below 2**-6, may differ; none do here.)
    """
    x = _tokens(BS, seed=11) * jnp.linspace(0.1, 3.0, BS)[:, None, None]
    codes, scales = init_quantized_cache(N, BS, KV, D, "fp8")
    grew = 0
    for t in range(BS):
        before = scales[4]
        codes, scales = write_quantized_kv(codes, scales, x[t : t + 1], jnp.asarray([4]), jnp.asarray([t]))
        grew += int(t > 0 and bool((scales[4] > before).any()))
    want_codes, want_scales = quantize_blocks(x[None], "fp8")
    assert grew >= 2
    np.testing.assert_array_equal(np.asarray(scales[4]), np.asarray(want_scales[0]))
    np.testing.assert_array_equal(np.asarray(codes[4], np.float32), np.asarray(want_codes[0], np.float32))


def test_codes_do_not_drift_when_the_scale_is_unchanged() -> None:
    big, small = _tokens(1, seed=3, scale=5.0), _tokens(3, seed=4, scale=0.5)
    codes, scales = init_quantized_cache(N, BS, KV, D, "int8")
    codes, scales = write_quantized_kv(codes, scales, big, jnp.asarray([2]), jnp.asarray([0]))
    first = np.asarray(codes[2, 0])
    for t in range(3):
        codes, scales = write_quantized_kv(codes, scales, small[t : t + 1], jnp.asarray([2]), jnp.asarray([t + 1]))
    np.testing.assert_array_equal(np.asarray(codes[2, 0]), first)


def test_slot_zero_starts_a_fresh_block() -> None:
    """A reused block does not keep its previous owner's (large) scale."""
    codes, scales = init_quantized_cache(N, BS, KV, D, "int8")
    codes, scales = write_quantized_kv(codes, scales, _tokens(1, 5, scale=100.0), jnp.asarray([0]), jnp.asarray([0]))
    small = _tokens(1, 6, scale=0.01)
    codes, scales = write_quantized_kv(codes, scales, small, jnp.asarray([0]), jnp.asarray([0]))
    np.testing.assert_allclose(np.asarray(scales[0]), np.abs(np.asarray(small[0])).max(axis=-1) / 127, rtol=1e-6)


def test_invalid_tokens_are_dropped() -> None:
    codes, scales = init_quantized_cache(N, BS, KV, D, "fp8")
    x = _tokens(2, seed=7)
    codes2, scales2 = write_quantized_kv(
        codes, scales, x, jnp.asarray([1, 5]), jnp.asarray([0, 0]), valid=jnp.asarray([True, False])
    )
    assert float(jnp.abs(scales2[5]).max()) == 0.0
    assert float(jnp.abs(codes2[5].astype(jnp.float32)).max()) == 0.0
    assert float(jnp.abs(scales2[1]).min()) > 0.0


def test_bad_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown quantization kind"):
        init_quantized_cache(N, BS, KV, D, "int4")
    with pytest.raises(ValueError, match="not a quantized KV dtype"):
        write_quantized_kv(jnp.zeros((N, BS, KV, D)), jnp.zeros((N, KV)), _tokens(1, 0), jnp.asarray([0]),
                           jnp.asarray([0]))
    codes, scales = init_quantized_cache(N, BS, KV, D, "int8")
    with pytest.raises(ValueError, match="do not match"):
        write_quantized_kv(codes, scales, jnp.zeros((1, KV, D + 1)), jnp.asarray([0]), jnp.asarray([0]))
    with pytest.raises(ValueError, match="2-D weight"):
        quantize_weight(jnp.zeros((2, 3, 4)), "int8")


def test_kv_read_bytes_worked_by_hand() -> None:
    """lens 1, 16, 17 with 16-token pages read 1 + 1 + 2 = 4 pages of K and of V.

    bf16: 2 (K,V) * 4 pages * 16 tokens * 2 heads * 64 dims * 2 bytes = 32768.
    int8: half of that, plus 2 * 4 pages * 2 heads * 4-byte scales = 16384 + 64.
    """
    kw = dict(block_size=16, kv_heads=2, head_dim=64)
    assert kv_read_bytes([1, 16, 17], dtype="bfloat16", **kw) == 32768
    assert kv_read_bytes([1, 16, 17], dtype="int8", quantized=True, **kw) == 16448


@pytest.mark.parametrize("kind,bound", [("int8", 0.01), ("fp8", 0.04)])
def test_weight_only_matmul(kind: str, bound: float) -> None:
    rng = np.random.default_rng(8)
    w = jnp.asarray(rng.standard_normal((64, 48), np.float32) * np.linspace(0.1, 2.0, 48, dtype=np.float32))
    x = jnp.asarray(rng.standard_normal((5, 64), np.float32))
    qw = quantize_weight(w, kind)
    assert isinstance(qw, QuantizedWeight) and qw.shape == (64, 48) and qw.scale.shape == (48,)
    assert qw.codes.dtype == (jnp.int8 if kind == "int8" else jnp.float8_e4m3fn)
    np.testing.assert_allclose(np.abs(np.asarray(qw.codes, np.float32)).max(axis=0), QMAX[kind])
    exact = x @ w
    for got in (quantized_matmul(x, qw), x @ qw, jax.jit(lambda a, b: a @ b)(x, qw)):
        rel = float(jnp.linalg.norm(got - exact) / jnp.linalg.norm(exact))
        assert 0 < rel < bound
    np.testing.assert_array_equal(np.asarray(quantized_matmul(x, w)), np.asarray(exact))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("m,k,n,blocks", [(5, 64, 48, (16, 16, 16)), (33, 96, 80, (32, 64, 32))])
def test_pallas_weight_matmul_matches_xla(kind: str, m: int, k: int, n: int, blocks) -> None:
    """The Pallas kernel (interpreted) equals the XLA path on the same codes, ragged shapes padded."""
    from inference.kernels.quant_matmul import MatmulBlocks, pallas_quantized_matmul

    rng = np.random.default_rng(9)
    w = jnp.asarray(rng.standard_normal((k, n), np.float32))
    x = jnp.asarray(rng.standard_normal((2, m, k), np.float32))
    qw = quantize_weight(w, kind)
    got = pallas_quantized_matmul(x, qw.codes, qw.scale, blocks=MatmulBlocks(*blocks), interpret=True)
    want = quantized_matmul(x, qw)
    assert got.shape == (2, m, n)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-5)
    pallas_matmul = build_kernels("pallas", interpret=True, target="gpu").matmul  # the kernel set's route to it
    np.testing.assert_allclose(np.asarray(pallas_matmul(x, qw)), np.asarray(want), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_group_wise_weight_quantization(kind: str) -> None:
    """Scales per (group of 16 input rows, output channel); each group's amax maps to qmax.

    The rows' magnitudes vary 100x, so one scale per column wastes the small
    rows' resolution: group-wise int8 is more accurate there (0.0054 vs 0.0081
    relative error of ``x @ w`` when written).
    """
    rng = np.random.default_rng(12)
    rows = np.geomspace(0.01, 1.0, 64, dtype=np.float32)[:, None]
    w = jnp.asarray(rng.standard_normal((64, 48), np.float32) * rows)
    x = jnp.asarray(rng.standard_normal((5, 64), np.float32))
    qw = quantize_weight(w, kind, group_size=16)
    assert qw.scale.shape == (4, 48) and qw.group_size == 16 and quantize_weight(w, kind).group_size is None
    np.testing.assert_allclose(np.abs(np.asarray(qw.codes, np.float32)).reshape(4, 16, 48).max(axis=1), QMAX[kind])
    exact = x @ w
    rel = {g: float(jnp.linalg.norm(x @ quantize_weight(w, kind, group_size=g) - exact) / jnp.linalg.norm(exact))
           for g in (None, 16)}
    assert 0 < rel[16] < rel[None]
    if kind == "int8":
        assert rel[16] < 0.8 * rel[None]
    np.testing.assert_allclose(np.asarray(jax.jit(lambda a, b: a @ b)(x, qw)), np.asarray(x @ qw), rtol=1e-5, atol=1e-5)
    for bad in (0, 24, 128):
        with pytest.raises(ValueError, match="group_size"):
            quantize_weight(w, kind, group_size=bad)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("m,k,n,group,block_k", [(5, 64, 48, 16, 32), (33, 128, 80, 64, 16), (3, 96, 40, 32, 32)])
def test_pallas_group_wise_matmul_matches_xla(kind: str, m: int, k: int, n: int, group: int, block_k: int) -> None:
    """Group-wise scales in the kernel (tile capped at the group, or several tiles per group) equal XLA."""
    from inference.kernels.quant_matmul import MatmulBlocks, pallas_quantized_matmul

    rng = np.random.default_rng(13)
    w = jnp.asarray(rng.standard_normal((k, n), np.float32) * rng.uniform(0.1, 2.0, (k, 1)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((2, m, k), np.float32))
    qw = quantize_weight(w, kind, group_size=group)
    got = pallas_quantized_matmul(x, qw.codes, qw.scale, blocks=MatmulBlocks(16, 16, block_k), interpret=True)
    want = quantized_matmul(x, qw)
    assert got.shape == (2, m, n)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-5)
    pallas_matmul = build_kernels("pallas", interpret=True, target="gpu").matmul
    np.testing.assert_allclose(np.asarray(pallas_matmul(x, qw)), np.asarray(want), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("code", [jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("groups", [None, 32])
def test_pallas_weight_matmul_lowers_for_cuda(code, groups) -> None:
    from jax import export

    from inference.kernels.quant_matmul import pallas_quantized_matmul

    sd = jax.ShapeDtypeStruct
    fn = jax.jit(lambda x, c, s: pallas_quantized_matmul(x, c, s, platform="gpu"))
    exported = export.export(
        fn, platforms=["cuda"], disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    )(sd((8, 4096), jnp.bfloat16), sd((4096, 1024), code), sd((1024,) if groups is None else (groups, 1024), jnp.float32))
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()


def test_flat_slot_write_and_dequantizing_gather() -> None:
    """The model's flat-slot addressing (padding = out of range) and the prefill-side gather."""
    from inference.kernels.quant import gather_dequantized, write_quantized_kv_flat

    x = _tokens(4, seed=10).reshape(2, 2, KV, D)  # [B=2, T=2, KV, D]
    codes, scales = init_quantized_cache(N, BS, KV, D, "int8")
    slots = jnp.asarray([[2 * BS, 2 * BS + 1], [5 * BS, N * BS]])  # last token is padding
    codes, scales = write_quantized_kv_flat(codes, scales, x, slots)
    vals = gather_dequantized(codes, scales, jnp.asarray([[2], [5]]))  # [2, BS, KV, D]
    np.testing.assert_allclose(np.asarray(vals[0, :2]), np.asarray(x[0]), atol=float(scales[2].max()))
    np.testing.assert_allclose(np.asarray(vals[1, :1]), np.asarray(x[1, :1]), atol=float(scales[5].max()))
    assert float(jnp.abs(vals[1, 1:]).max()) == 0.0  # the padding token was dropped
