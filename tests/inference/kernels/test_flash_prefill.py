"""Flash-attention prefill kernel (Pallas, interpret mode on CPU) against the jnp reference.

Tolerance: float32 inputs agree within 2e-5 absolute (only summation order
differs); bfloat16 within 2e-2 (probabilities are rounded to bf16 before the
PV matmul, as on the GPU). Rows past a sequence's length are don't-care and
are not compared, but must be finite.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import export  # noqa: E402

from inference.kernels import reference, xla_attention  # noqa: E402
from inference.kernels.flash_prefill import PrefillBlocks, flash_prefill  # noqa: E402

# Ragged batch: a fresh 24-token prompt, the second chunk (offset 24) of a
# chunked prefill over 48 keys, a 10-token tail after a 10-token cached
# prefix, and an empty padding row.
Q_OFFSETS = np.array([0, 24, 10, 0], np.int32)
KV_LENS = np.array([24, 48, 20, 0], np.int32)
T, S = 24, 48


def _inputs(h: int, kv: int, d: int, dtype=jnp.float32, seed: int = 0):
    rng = np.random.default_rng(seed)
    b = len(Q_OFFSETS)
    q = jnp.asarray(rng.standard_normal((b, T, h, d), np.float32)).astype(dtype)
    k = jnp.asarray(rng.standard_normal((b, S, kv, d), np.float32)).astype(dtype)
    v = jnp.asarray(rng.standard_normal((b, S, kv, d), np.float32)).astype(dtype)
    return q, k, v, jnp.asarray(Q_OFFSETS), jnp.asarray(KV_LENS)


def _assert_valid_rows_close(out, want, atol: float) -> None:
    out, want = np.asarray(out, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(out).all()
    for b in range(len(Q_OFFSETS)):
        n = max(0, min(T, int(KV_LENS[b] - Q_OFFSETS[b])))
        np.testing.assert_allclose(out[b, :n], want[b, :n], atol=atol, rtol=0, err_msg=f"sequence {b}")


# Each (head dim, GQA ratio) pair runs with one tile setting, alternated so
# that every head dim and every ratio meets both (interpretation is slow).
_TILES = {"b16x16": PrefillBlocks(16, 16), "b32x64": PrefillBlocks(32, 64)}
_GRID = [
    (d, h, kv, ("b16x16", "b32x64")[(i + d // 64) % 2])
    for d in (64, 128)
    for i, (h, kv) in enumerate([(4, 4), (8, 2), (8, 1)])
]


@pytest.mark.parametrize("d,h,kv,tiles", _GRID)
def test_matches_reference(d: int, h: int, kv: int, tiles: str) -> None:
    blocks = _TILES[tiles]
    q, k, v, offs, lens = _inputs(h, kv, d)
    out = flash_prefill(q, k, v, offs, lens, scale=d**-0.5, blocks=blocks, interpret=True)
    want = reference.prefill_attention(q, k, v, offs, lens, scale=d**-0.5)
    assert out.shape == q.shape and out.dtype == q.dtype
    _assert_valid_rows_close(out, want, atol=2e-5)


def test_bfloat16_matches_reference() -> None:
    q, k, v, offs, lens = _inputs(8, 2, 64, jnp.bfloat16, seed=1)
    out = flash_prefill(q, k, v, offs, lens, scale=0.125, blocks=PrefillBlocks(16, 32), interpret=True)
    want = reference.prefill_attention(q, k, v, offs, lens, scale=0.125)
    assert out.dtype == jnp.bfloat16
    _assert_valid_rows_close(out, want, atol=2e-2)


def test_reference_agrees_with_xla_attention() -> None:
    """The reference and the XLA kernels' online softmax agree on every valid row."""
    q, k, v, offs, lens = _inputs(8, 2, 64, seed=2)
    ours = reference.prefill_attention(q, k, v, offs, lens, scale=0.125)
    theirs = xla_attention.prefill_attention(q, k, v, offs, lens, scale=0.125)
    _assert_valid_rows_close(ours, theirs, atol=2e-5)


def test_causality_future_keys_do_not_leak() -> None:
    """Changing keys after a query's position leaves that query's output unchanged."""
    q, k, v, offs, lens = _inputs(4, 2, 64, seed=3)
    out1 = flash_prefill(q, k, v, offs, lens, scale=0.125, blocks=PrefillBlocks(16, 16), interpret=True)
    k2 = k.at[:, 30:].set(100.0)
    v2 = v.at[:, 30:].set(-100.0)
    out2 = flash_prefill(q, k2, v2, offs, lens, scale=0.125, blocks=PrefillBlocks(16, 16), interpret=True)
    # sequence 1 (offset 24): queries t <= 5 sit at positions <= 29.
    np.testing.assert_allclose(np.asarray(out1[1, :6]), np.asarray(out2[1, :6]), atol=1e-6)
    assert not np.allclose(np.asarray(out1[1, 6:]), np.asarray(out2[1, 6:]), atol=1e-3)


def test_bad_shapes_are_rejected() -> None:
    q, k, v, offs, lens = _inputs(6, 4, 64)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        flash_prefill(q, k, v, offs, lens, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        PrefillBlocks(48, 16)


@pytest.mark.parametrize(
    "dtype,b,t,s,h,kv,d",
    [(jnp.bfloat16, 2, 256, 512, 32, 8, 128), (jnp.float16, 2, 256, 512, 32, 8, 128),
     (jnp.float32, 3, 5, 32, 4, 2, 16)],  # the last: a 5-token chunk of the tiny model (16-wide tiles)
    ids=["bf16", "fp16", "tiny-f32"],
)
def test_lowers_for_cuda_through_triton(dtype, b, t, s, h, kv, d) -> None:
    """The kernel lowers to a Triton custom call for CUDA (no GPU needed to lower).

    This checks every op has a Triton lowering; it cannot check the PTX
    compilation or the speed, which need a GPU (tests/bench/gpu_kernels.py).
    """
    sd = jax.ShapeDtypeStruct

    def fn(q, k, v, offs, lens):
        return flash_prefill(q, k, v, offs, lens, scale=0.088, blocks=PrefillBlocks(128, 64), platform="gpu")

    exported = export.export(
        jax.jit(fn),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(sd((b, t, h, d), dtype), sd((b, s, kv, d), dtype), sd((b, s, kv, d), dtype),
      sd((b,), jnp.int32), sd((b,), jnp.int32))
    text = exported.mlir_module()
    assert "__gpu$xla.gpu.triton" in text and 'name = "flash_prefill"' in text


# Paged variant: keys and values read through the block table. The reference
# runs on each row's table gathered into contiguous keys (what the model did
# before: that copy is what the paged kernel saves).
PAGED_OFFSETS = np.array([0, 24, 10, 0], np.int32)
PAGED_LENS = np.array([24, 48, 20, 0], np.int32)
N_PAGES = 64


def _paged_inputs(h: int, kv: int, d: int, bs: int, dtype=jnp.float32, seed: int = 5):
    rng = np.random.default_rng(seed)
    b, m = len(PAGED_OFFSETS), -(-S // bs)
    q = jnp.asarray(rng.standard_normal((b, T, h, d), np.float32)).astype(dtype)
    kc = jnp.asarray(rng.standard_normal((N_PAGES, bs, kv, d), np.float32)).astype(dtype)
    vc = jnp.asarray(rng.standard_normal((N_PAGES, bs, kv, d), np.float32)).astype(dtype)
    tables = rng.permutation(N_PAGES)[: b * m].reshape(b, m).astype(np.int32)
    tables[3] = [-1, N_PAGES, N_PAGES + 7, 0][:m] + [0] * max(0, m - 4)  # stray ids in the empty row
    return q, kc, vc, jnp.asarray(tables), jnp.asarray(PAGED_OFFSETS), jnp.asarray(PAGED_LENS)


def _assert_paged_rows_close(out, want, atol: float) -> None:
    out, want = np.asarray(out, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(out).all()
    for b in range(len(PAGED_OFFSETS)):
        n = max(0, min(T, int(PAGED_LENS[b] - PAGED_OFFSETS[b])))
        np.testing.assert_allclose(out[b, :n], want[b, :n], atol=atol, rtol=0, err_msg=f"sequence {b}")


@pytest.mark.parametrize("d,h,kv,bs,tiles", [(64, 4, 4, 4, "b16x16"), (64, 8, 2, 8, "b32x64"),
                                             (128, 8, 1, 16, "b16x16"), (128, 8, 2, 16, "b32x64")])
def test_paged_matches_reference_on_gathered_keys(d: int, h: int, kv: int, bs: int, tiles: str) -> None:
    from inference.kernels.flash_prefill import paged_flash_prefill

    q, kc, vc, tables, offs, lens = _paged_inputs(h, kv, d, bs)
    out = paged_flash_prefill(q, kc, vc, tables, offs, lens, scale=d**-0.5, blocks=_TILES[tiles], interpret=True)
    safe = jnp.clip(tables, 0, N_PAGES - 1)
    want = reference.prefill_attention(q, reference.gather_pages(kc, safe), reference.gather_pages(vc, safe),
                                       offs, lens, scale=d**-0.5)  # fmt: skip
    assert out.shape == q.shape
    _assert_paged_rows_close(out, want, atol=2e-5)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_paged_quantized_cache_dequantized_in_the_kernel(kind: str) -> None:
    from inference.kernels.flash_prefill import paged_flash_prefill
    from inference.kernels.quant import gather_dequantized, quantize_blocks

    q, kc, vc, tables, offs, lens = _paged_inputs(8, 2, 64, 8, seed=6)
    (kq, ks), (vq, vs) = quantize_blocks(kc, kind), quantize_blocks(vc, kind)
    out = paged_flash_prefill(q, kq, vq, tables, offs, lens, scale=0.125, k_scale=ks, v_scale=vs,
                              blocks=PrefillBlocks(16, 16), interpret=True)  # fmt: skip
    safe = jnp.clip(tables, 0, N_PAGES - 1)
    want = reference.prefill_attention(q, gather_dequantized(kq, ks, safe), gather_dequantized(vq, vs, safe), offs,
                                       lens, scale=0.125)  # fmt: skip
    _assert_paged_rows_close(out, want, atol=2e-5)


def test_paged_bfloat16_and_bad_arguments() -> None:
    from inference.kernels.flash_prefill import paged_flash_prefill

    q, kc, vc, tables, offs, lens = _paged_inputs(8, 2, 64, 16, jnp.bfloat16, seed=7)
    out = paged_flash_prefill(q, kc, vc, tables, offs, lens, scale=0.125, blocks=PrefillBlocks(16, 32), interpret=True)
    safe = jnp.clip(tables, 0, N_PAGES - 1)
    want = reference.prefill_attention(q, reference.gather_pages(kc, safe), reference.gather_pages(vc, safe), offs,
                                       lens, scale=0.125)  # fmt: skip
    assert out.dtype == jnp.bfloat16
    _assert_paged_rows_close(out, want, atol=2e-2)
    with pytest.raises(ValueError, match="must match q dtype"):
        paged_flash_prefill(q, kc.astype(jnp.float32), vc.astype(jnp.float32), tables, offs, lens, scale=0.1)
    with pytest.raises(ValueError, match="both k_scale and v_scale"):
        paged_flash_prefill(q, kc, vc, tables, offs, lens, scale=0.1, k_scale=jnp.ones((N_PAGES, 2)))
    with pytest.raises(ValueError, match="block_tables must be"):
        paged_flash_prefill(q, kc, vc, tables[:2], offs, lens, scale=0.1)


@pytest.mark.parametrize("code", [None, jnp.int8])
def test_paged_lowers_for_cuda_through_triton(code) -> None:
    from inference.kernels.flash_prefill import paged_flash_prefill

    sd = jax.ShapeDtypeStruct
    b, t, h, kv, d, n, bs, m = 2, 256, 32, 8, 128, 512, 16, 64
    cache = sd((n, bs, kv, d), code or jnp.bfloat16)
    scales = [sd((n, kv), jnp.float32)] * 2 if code else []

    def fn(q, kc, vc, tables, offs, lens, *sc):
        ks, vs = sc if sc else (None, None)
        return paged_flash_prefill(q, kc, vc, tables, offs, lens, scale=0.088, k_scale=ks, v_scale=vs,
                                   blocks=PrefillBlocks(128, 64), platform="gpu")  # fmt: skip

    exported = export.export(
        jax.jit(fn), platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(sd((b, t, h, d), jnp.bfloat16), cache, cache, sd((b, m), jnp.int32), sd((b,), jnp.int32), sd((b,), jnp.int32),
      *scales)  # fmt: skip
    assert 'name = "paged_flash_prefill"' in exported.mlir_module()
