"""TPU (Mosaic) paged-attention decode kernel: interpret mode on CPU against the jnp reference, and TPU lowering.

Tolerances: float32 within 2e-5 absolute (only summation order differs).
bfloat16 within 2e-2 (the kernel computes in float32 and rounds once, the
reference rounds its bf16 output the same way; the bound is bf16's step near
the output values). Quantized caches: kernel and reference read the same
int8/fp8 codes and scales; the kernel folds the per-(page, head) scale into
the dots instead of scaling the codes, so they agree within 2e-5 too.

A row with ``context_lens == 0`` must come back as zeros (the contract of the
GPU kernel and the model's decode attention); the reference's value there is
an average over the whole table, a don't-care, so those rows are checked
against zero and left out of the comparison.

Lowering: ``jax.export`` with ``platforms=["tpu"]`` runs the Pallas-to-Mosaic
lowering on this CPU host and embeds a ``tpu_custom_call``; Mosaic's own
compiler (libtpu, compile-only TPUs) sees these cases in ``test_mosaic_compile.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import export  # noqa: E402

from inference.kernels import reference  # noqa: E402
from inference.kernels.quant import quantize_blocks  # noqa: E402
from inference.kernels.tpu_decode import tpu_paged_decode  # noqa: E402
from tests.inference.kernels import mosaic_compile  # noqa: E402

M, N = 4, 24  # table width, pages in the cache


def _lens(bs: int) -> np.ndarray:
    """Ragged: empty, one token, exactly one page, a partial third page, the whole table."""
    return np.array([0, 1, bs, 2 * bs + 3, M * bs], np.int32)


def _tables(rng: np.random.Generator, lens: np.ndarray, bs: int) -> np.ndarray:
    """Shuffled distinct pages; entries past each row's last live page are stray ids (some out of range)."""
    tables = rng.permutation(N)[: len(lens) * M].reshape(len(lens), M).astype(np.int32)
    for row, n in enumerate(lens):
        live = -(-int(n) // bs)
        stray = rng.choice([-1, N, N + 17, int(rng.integers(N))], size=M - live)
        tables[row, live:] = stray
    return tables


def _inputs(h: int, kv: int, d: int, bs: int, dtype=jnp.float32, seed: int = 0):
    rng = np.random.default_rng(seed)
    lens = _lens(bs)
    q = jnp.asarray(rng.standard_normal((len(lens), h, d), np.float32)).astype(dtype)
    kc = jnp.asarray(rng.standard_normal((N, bs, kv, d), np.float32)).astype(dtype)
    vc = jnp.asarray(rng.standard_normal((N, bs, kv, d), np.float32)).astype(dtype)
    return q, kc, vc, jnp.asarray(_tables(rng, lens, bs)), jnp.asarray(lens)


def _check(out, q, kc, vc, tables, lens, atol: float, **scales) -> None:
    """Rows with a context match the reference; empty rows are zeros."""
    d = q.shape[-1]
    assert out.shape == q.shape and out.dtype == q.dtype
    safe_tables = jnp.clip(tables, 0, kc.shape[0] - 1)  # the reference gathers every entry, stray ones too
    want = reference.paged_decode_attention(q, kc, vc, safe_tables, lens, scale=d**-0.5, **scales)
    out, want = np.asarray(out, np.float32), np.asarray(want, np.float32)
    live = np.asarray(lens) > 0
    assert np.all(out[~live] == 0.0)
    np.testing.assert_allclose(out[live], want[live], atol=atol, rtol=0)


# Head dim x GQA ratio (H / KV = 1, 4, 8) x page size x pages per step, rotated
# so that each head dim meets every ratio and every page size, and each page
# size runs with one and with several pages per step (3 does not divide M).
# Then KV = 3 (not a whole tile: read through a padded float32 scratch page)
# and D = 256 (two 128-lane chunks per page).
_GRID = [
    (64, 4, 4, 8, 1),
    (64, 8, 2, 16, 2),
    (64, 8, 1, 32, 1),
    (128, 2, 2, 16, 1),
    (128, 8, 2, 32, 3),
    (128, 16, 2, 8, 2),
    (64, 12, 3, 8, 2),
    (256, 8, 2, 8, 1),
]


@pytest.mark.parametrize("d,h,kv,bs,pps", _GRID)
def test_matches_reference(d: int, h: int, kv: int, bs: int, pps: int) -> None:
    q, kc, vc, tables, lens = _inputs(h, kv, d, bs)
    out = tpu_paged_decode(q, kc, vc, tables, lens, scale=d**-0.5, pages_per_step=pps, interpret=True)
    _check(out, q, kc, vc, tables, lens, atol=2e-5)


@pytest.mark.parametrize("d,h,kv,bs", [(64, 8, 2, 16), (128, 8, 1, 8)])
def test_bfloat16_matches_reference(d: int, h: int, kv: int, bs: int) -> None:
    q, kc, vc, tables, lens = _inputs(h, kv, d, bs, jnp.bfloat16, seed=1)
    out = tpu_paged_decode(q, kc, vc, tables, lens, scale=d**-0.5, pages_per_step=2, interpret=True)
    _check(out, q, kc, vc, tables, lens, atol=2e-2)


@pytest.mark.parametrize("kind,d,h,kv,bs,pps", [
    ("int8", 64, 8, 2, 16, 1),
    ("int8", 128, 8, 1, 8, 2),
    ("fp8", 64, 8, 2, 16, 2),
    ("fp8", 128, 4, 4, 8, 1),
])  # fmt: skip
def test_quantized_cache_matches_reference(kind: str, d: int, h: int, kv: int, bs: int, pps: int) -> None:
    q, kc, vc, tables, lens = _inputs(h, kv, d, bs, seed=2)
    kq, ks = quantize_blocks(kc, kind)
    vq, vs = quantize_blocks(vc, kind)
    out = tpu_paged_decode(q, kq, vq, tables, lens, scale=d**-0.5, k_scale=ks, v_scale=vs, pages_per_step=pps,
                           interpret=True)
    _check(out, q, kq, vq, tables, lens, atol=2e-5, k_scale=ks, v_scale=vs)


def test_quantized_cache_close_to_float() -> None:
    """The quantized result stays near the float one (relative L2 error: int8 < 2%, fp8 < 6%)."""
    q, kc, vc, tables, lens = _inputs(8, 2, 64, 16, seed=3)
    exact = reference.paged_decode_attention(q, kc, vc, jnp.clip(tables, 0, N - 1), lens, scale=0.125)
    exact = exact * (lens > 0)[:, None, None]  # the empty row is zeros in both
    for kind, bound in (("int8", 0.02), ("fp8", 0.06)):
        kq, ks = quantize_blocks(kc, kind)
        vq, vs = quantize_blocks(vc, kind)
        out = tpu_paged_decode(q, kq, vq, tables, lens, scale=0.125, k_scale=ks, v_scale=vs, interpret=True)
        rel = float(jnp.linalg.norm(out - exact) / jnp.linalg.norm(exact))
        assert 0 < rel < bound, (kind, rel)


def test_slots_outside_the_context_are_never_read() -> None:
    """Non-finite garbage in dead pages and in the tail of a partial page does not change the output."""
    bs = 8
    q, kc, vc, tables, lens = _inputs(8, 2, 64, bs, seed=4)
    clean = tpu_paged_decode(q, kc, vc, tables, lens, scale=0.125, pages_per_step=2, interpret=True)
    used = {int(tables[row, j]) for row, n in enumerate(np.asarray(lens)) for j in range(-(-int(n) // bs))}
    dead = np.array(sorted(set(range(N)) - used), np.int32)
    poisoned_k = kc.at[dead].set(jnp.inf)
    poisoned_v = vc.at[dead].set(jnp.nan)
    last = tables[3, 2]  # row 3 holds 2 * bs + 3 tokens: 3 live slots in its third page
    poisoned_k = poisoned_k.at[last, 3:].set(jnp.nan)
    poisoned_v = poisoned_v.at[last, 3:].set(-jnp.inf)
    out = tpu_paged_decode(q, poisoned_k, poisoned_v, tables, lens, scale=0.125, pages_per_step=2, interpret=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(clean))


def test_bad_arguments_are_rejected() -> None:
    q, kc, vc, tables, lens = _inputs(8, 2, 64, 8)
    kq, ks = quantize_blocks(kc, "int8")
    with pytest.raises(ValueError, match="both k_scale and v_scale"):
        tpu_paged_decode(q, kq, kq, tables, lens, scale=1.0, k_scale=ks, interpret=True)
    with pytest.raises(ValueError, match="must match q dtype"):
        tpu_paged_decode(q, kq, kq, tables, lens, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn codes"):
        tpu_paged_decode(q, kc, vc, tables, lens, scale=1.0, k_scale=ks, v_scale=ks, interpret=True)
    with pytest.raises(ValueError, match="scales must have shape"):
        tpu_paged_decode(q, kq, kq, tables, lens, scale=1.0, k_scale=ks[:3], v_scale=ks[:3], interpret=True)
    with pytest.raises(ValueError, match="block_tables"):
        tpu_paged_decode(q, kc, vc, tables[:2], lens, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        tpu_paged_decode(q[:, :3], kc, vc, tables, lens, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="shape mismatch"):
        tpu_paged_decode(q, kc, vc[..., :32], tables, lens, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="pages_per_step"):
        tpu_paged_decode(q, kc, vc, tables, lens, scale=1.0, pages_per_step=0, interpret=True)
    with pytest.raises(ValueError, match="multiple of 128"):
        tpu_paged_decode(q[..., :40].repeat(4, -1), kc[..., :40].repeat(4, -1), vc[..., :40].repeat(4, -1),
                         tables, lens, scale=1.0, interpret=True)


@pytest.mark.parametrize("case", list(mosaic_compile.decode_cases()), ids=lambda c: c[0])
def test_lowers_for_tpu_through_mosaic(case) -> None:
    """float32 / bf16 / int8 / fp8 caches lower to a Mosaic ``tpu_custom_call`` (no TPU needed to lower)."""
    name, fn, shapes = case
    exported = export.export(fn, platforms=["tpu"])(*(jax.ShapeDtypeStruct(s, dt) for s, dt in shapes))
    assert "tpu_custom_call" in exported.mlir_module()
