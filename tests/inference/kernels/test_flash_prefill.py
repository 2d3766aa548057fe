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

from inference.kernels import reference  # noqa: E402
from inference.kernels.flash_prefill import PrefillBlocks, flash_prefill  # noqa: E402
from inference.model import attention as model_attention  # noqa: E402

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


def test_reference_agrees_with_model_attention() -> None:
    """Our reference and the model's (the contract's owner) agree on every valid row."""
    q, k, v, offs, lens = _inputs(8, 2, 64, seed=2)
    ours = reference.prefill_attention(q, k, v, offs, lens, scale=0.125)
    theirs = model_attention.dense_prefill_attention(q, k, v, offs, lens, scale=0.125)
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
