"""Paged-attention decode kernel (Pallas, interpret mode on CPU) against the jnp reference.

Tolerance: float32 within 2e-5 absolute. Quantized caches: the kernel and the
reference read the same int8/fp8 codes and scales, so they agree within 2e-5
too (both dequantize exactly; only summation order differs). How far the
quantized result is from the float one is a separate, looser bound
(``test_quantized_cache_close_to_float``).
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import export  # noqa: E402

from inference.kernels import reference, xla_attention  # noqa: E402
from inference.kernels.paged_decode import DecodeBlocks, paged_decode  # noqa: E402
from inference.kernels.quant import quantize_blocks  # noqa: E402

BS, M, N = 8, 6, 40  # page size, table width, pages in the cache
# Ragged: one token, exactly two pages, partial last page, the full table.
LENS = np.array([1, 16, 29, 48], np.int32)


def _inputs(h: int, kv: int, d: int, dtype=jnp.float32, seed: int = 0):
    rng = np.random.default_rng(seed)
    b = len(LENS)
    q = jnp.asarray(rng.standard_normal((b, h, d), np.float32)).astype(dtype)
    kc = jnp.asarray(rng.standard_normal((N, BS, kv, d), np.float32)).astype(dtype)
    vc = jnp.asarray(rng.standard_normal((N, BS, kv, d), np.float32)).astype(dtype)
    tables = jnp.asarray(rng.permutation(N)[: b * M].reshape(b, M).astype(np.int32))  # scattered pages
    return q, kc, vc, tables, jnp.asarray(LENS)


# Each (head dim, GQA ratio) pair runs with one of the three chunk/split
# settings (pages per chunk p, sequence splits s), rotated so that every head
# dim meets all three and every ratio two of them (interpretation is slow).
_BLOCKS = {"p2s1": DecodeBlocks(2, 1), "p4s2": DecodeBlocks(4, 2), "p1s4": DecodeBlocks(1, 4)}
_GRID = [
    (d, h, kv, ("p2s1", "p4s2", "p1s4")[(i + d // 64) % 3])
    for d in (64, 128)
    for i, (h, kv) in enumerate([(4, 4), (8, 2), (16, 2)])
]


@pytest.mark.parametrize("d,h,kv,blocks_name", _GRID)
def test_matches_reference(d: int, h: int, kv: int, blocks_name: str) -> None:
    blocks = _BLOCKS[blocks_name]
    q, kc, vc, tables, lens = _inputs(h, kv, d)
    out = paged_decode(q, kc, vc, tables, lens, scale=d**-0.5, blocks=blocks, interpret=True)
    want = reference.paged_decode_attention(q, kc, vc, tables, lens, scale=d**-0.5)
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5, rtol=0)


def test_reference_agrees_with_xla_attention() -> None:
    q, kc, vc, tables, lens = _inputs(8, 2, 64, seed=1)
    ours = reference.paged_decode_attention(q, kc, vc, tables, lens, scale=0.125)
    theirs = xla_attention.paged_decode_attention(q, kc, vc, tables, lens, scale=0.125)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=2e-5, rtol=0)


def test_bfloat16_matches_reference() -> None:
    q, kc, vc, tables, lens = _inputs(8, 2, 64, jnp.bfloat16, seed=2)
    out = paged_decode(q, kc, vc, tables, lens, scale=0.125, blocks=DecodeBlocks(2, 2), interpret=True)
    want = reference.paged_decode_attention(q, kc, vc, tables, lens, scale=0.125)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=0)


def test_pages_outside_the_context_are_ignored() -> None:
    q, kc, vc, tables, lens = _inputs(4, 2, 64, seed=3)
    out1 = paged_decode(q, kc, vc, tables, lens, scale=0.125, blocks=DecodeBlocks(2, 2), interpret=True)
    # Poison every page beyond each sequence's last page, and the tail of sequence 2's last page.
    poisoned_k, poisoned_v = kc, vc
    for b, n in enumerate(LENS):
        for j in range(-(-int(n) // BS), M):
            poisoned_k = poisoned_k.at[tables[b, j]].set(1e4)
            poisoned_v = poisoned_v.at[tables[b, j]].set(-1e4)
    poisoned_k = poisoned_k.at[tables[2, 3], 5:].set(1e4)
    out2 = paged_decode(q, poisoned_k, poisoned_v, tables, lens, scale=0.125, blocks=DecodeBlocks(2, 2),
                        interpret=True)
    np.testing.assert_allclose(np.asarray(out1), np.asarray(out2), atol=1e-6)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("h,kv,d", [(8, 2, 64), (16, 2, 128)])
def test_quantized_cache_matches_reference(kind: str, h: int, kv: int, d: int) -> None:
    q, kc, vc, tables, lens = _inputs(h, kv, d, seed=4)
    kq, ks = quantize_blocks(kc, kind)
    vq, vs = quantize_blocks(vc, kind)
    out = paged_decode(q, kq, vq, tables, lens, scale=d**-0.5, k_scale=ks, v_scale=vs,
                       blocks=DecodeBlocks(2, 2), interpret=True)
    want = reference.paged_decode_attention(q, kq, vq, tables, lens, scale=d**-0.5, k_scale=ks, v_scale=vs)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5, rtol=0)


@pytest.mark.parametrize("kind,bound", [("int8", 0.02), ("fp8", 0.06)])
def test_quantized_cache_close_to_float(kind: str, bound: float) -> None:
    """Relative L2 error of the attention output from int8 (<2%) / fp8 (<6%) codes."""
    q, kc, vc, tables, lens = _inputs(8, 2, 64, seed=5)
    kq, ks = quantize_blocks(kc, kind)
    vq, vs = quantize_blocks(vc, kind)
    out = paged_decode(q, kq, vq, tables, lens, scale=0.125, k_scale=ks, v_scale=vs, interpret=True)
    exact = reference.paged_decode_attention(q, kc, vc, tables, lens, scale=0.125)
    rel = float(jnp.linalg.norm(out - exact) / jnp.linalg.norm(exact))
    assert 0 < rel < bound


def test_bad_arguments_are_rejected() -> None:
    q, kc, vc, tables, lens = _inputs(8, 2, 64)
    kq, ks = quantize_blocks(kc, "int8")
    with pytest.raises(ValueError, match="both k_scale and v_scale"):
        paged_decode(q, kq, kq, tables, lens, scale=1.0, k_scale=ks, interpret=True)
    with pytest.raises(ValueError, match="must match q dtype"):
        paged_decode(q, kq, kq, tables, lens, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode(q, kc, vc, tables[:2], lens, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="k_splits"):
        DecodeBlocks(4, 0)


@pytest.mark.parametrize("cache_dtype", [jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn])
def test_lowers_for_cuda_through_triton(cache_dtype) -> None:
    """bf16 / int8 / fp8 caches lower to a Triton custom call for CUDA (no GPU needed to lower)."""
    sd = jax.ShapeDtypeStruct
    b, h, kv, d, n, bs, m = 8, 32, 8, 128, 1024, 16, 64
    quantized = cache_dtype != jnp.bfloat16

    def fn(q, kc, vc, tables, lens, ks=None, vs=None):
        return paged_decode(q, kc, vc, tables, lens, scale=0.088, k_scale=ks, v_scale=vs,
                            blocks=DecodeBlocks(8, 2), platform="gpu")

    args = [sd((b, h, d), jnp.bfloat16), sd((n, bs, kv, d), cache_dtype), sd((n, bs, kv, d), cache_dtype),
            sd((b, m), jnp.int32), sd((b,), jnp.int32)]
    if quantized:
        args += [sd((n, kv), jnp.float32)] * 2
    exported = export.export(
        jax.jit(fn), platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*args)
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()


def test_tiny_model_shapes_lower_for_cuda() -> None:
    """Tiny model (D=16, 4/2 heads, one-page tables): chunks are widened to Triton's 16-token minimum."""
    sd = jax.ShapeDtypeStruct

    def fn(q, kc, vc, tables, lens):
        return paged_decode(q, kc, vc, tables, lens, scale=0.25, blocks=DecodeBlocks(1, 1), platform="gpu")

    exported = export.export(
        jax.jit(fn), platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(sd((2, 4, 16), jnp.float32), sd((64, 8, 2, 16), jnp.float32), sd((64, 8, 2, 16), jnp.float32),
      sd((2, 1), jnp.int32), sd((2,), jnp.int32))
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()


def test_query_group_wider_than_one_tile() -> None:
    """32 query heads on one KV head: the group fills a 32-row tile (no padding rows)."""
    q, kc, vc, tables, lens = _inputs(32, 1, 64, seed=6)
    out = paged_decode(q, kc, vc, tables, lens, scale=0.125, blocks=DecodeBlocks(2, 2), interpret=True)
    want = reference.paged_decode_attention(q, kc, vc, tables, lens, scale=0.125)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5, rtol=0)
