"""TPU flash-attention prefill (Pallas, Mosaic lowering) against the jnp reference.

On this CPU box the kernel runs under Pallas' TPU interpreter
(``pltpu.InterpretParams``: grid, scalar prefetch, VMEM scratch and block
fetches simulated as on a TPU core), and its lowering for TPU is checked with
``jax.export(..., platforms=["tpu"])``, which runs the Pallas -> Mosaic
lowering on any host. What only a TPU can check (Mosaic's layout passes in
libtpu, speed) is not covered here.

Tolerance: float32 within 2e-5 absolute (summation order differs); bfloat16
within 2e-2 (probabilities are rounded to bf16 before the PV matmul). Rows
with no visible key are don't-care (the reference averages every value, the
kernel writes zeros) and are not compared.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import export  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from inference.kernels import reference  # noqa: E402
from inference.kernels.tpu_prefill import TpuPrefillBlocks, tpu_flash_prefill  # noqa: E402

# Ragged batch over 3 key tiles of 128: a fresh 40-token prompt; the last
# chunk (offset 260) of a chunked prefill over 300 keys; a 40-token tail after
# a 10-token cached prefix; a 17-token prompt padded to 40; an empty row.
Q_OFFSETS = np.array([0, 260, 10, 0, 0], np.int32)
KV_LENS = np.array([40, 300, 50, 17, 0], np.int32)
T, S = 40, 300
INTERPRET = pltpu.InterpretParams()


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
    assert not out[len(Q_OFFSETS) - 1].any()  # the empty row: no visible key, zeros


# Every head dim meets every GQA ratio; the tiles alternate so each pair of
# (head dim, ratio) values also meets both tile shapes somewhere.
_TILES = {"q8k128": TpuPrefillBlocks(8, 128), "q16k256": TpuPrefillBlocks(16, 256)}
_GRID = [
    (d, h, kv, ("q8k128", "q16k256")[(i + d // 64) % 2])
    for d in (64, 128)
    for i, (h, kv) in enumerate([(4, 4), (8, 2), (8, 1)])
]


@pytest.mark.parametrize("d,h,kv,tiles", _GRID)
def test_matches_reference(d: int, h: int, kv: int, tiles: str) -> None:
    q, k, v, offs, lens = _inputs(h, kv, d)
    out = tpu_flash_prefill(q, k, v, offs, lens, scale=d**-0.5, blocks=_TILES[tiles], interpret=INTERPRET)
    want = reference.prefill_attention(q, k, v, offs, lens, scale=d**-0.5)
    assert out.shape == q.shape and out.dtype == q.dtype
    _assert_valid_rows_close(out, want, atol=2e-5)


def test_bfloat16_matches_reference() -> None:
    q, k, v, offs, lens = _inputs(8, 2, 64, jnp.bfloat16, seed=1)
    out = tpu_flash_prefill(q, k, v, offs, lens, scale=0.125, blocks=TpuPrefillBlocks(8, 128), interpret=INTERPRET)
    want = reference.prefill_attention(q, k, v, offs, lens, scale=0.125)
    assert out.dtype == jnp.bfloat16
    _assert_valid_rows_close(out, want, atol=2e-2)


def test_keys_past_the_visible_end_do_not_matter() -> None:
    """Key tiles a query block cannot see are neither computed nor read: garbage there changes nothing."""
    q, k, v, offs, lens = _inputs(8, 2, 64, seed=2)
    out = tpu_flash_prefill(q, k, v, offs, lens, scale=0.125, blocks=TpuPrefillBlocks(8, 128), interpret=INTERPRET)
    # Sequence 0 sees keys < 40 only: every tile from 128 on is past its end.
    poisoned_k = k.at[0, 128:].set(jnp.nan)
    poisoned_v = v.at[0, 128:].set(jnp.nan)
    again = tpu_flash_prefill(q, poisoned_k, poisoned_v, offs, lens, scale=0.125, blocks=TpuPrefillBlocks(8, 128),
                              interpret=INTERPRET)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(again), np.asarray(out))


def test_rejects_bad_shapes() -> None:
    q, k, v, offs, lens = _inputs(8, 2, 64)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        tpu_flash_prefill(q[:, :, :7], k, v, offs, lens, scale=0.1)
    with pytest.raises(ValueError, match="shape mismatch"):
        tpu_flash_prefill(q, k, v[:, :10], offs, lens, scale=0.1)
    with pytest.raises(ValueError, match="must match q dtype"):
        tpu_flash_prefill(q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), offs, lens, scale=0.1)
    with pytest.raises(ValueError, match="block_k"):
        TpuPrefillBlocks(8, 64)
    with pytest.raises(ValueError, match="block_q"):
        TpuPrefillBlocks(12, 128)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_for_tpu(dtype) -> None:
    """The Pallas -> Mosaic lowering accepts the kernel: the exported module calls it as a TPU custom call."""
    q, k, v, offs, lens = _inputs(8, 2, 128, dtype)
    exported = export.export(jax.jit(lambda *a: tpu_flash_prefill(*a, scale=0.088)), platforms=["tpu"])(
        q, k, v, offs, lens
    )
    text = exported.mlir_module()
    assert "tpu_custom_call" in text and "tpu_flash_prefill" in text
    assert exported.platforms == ("tpu",)
