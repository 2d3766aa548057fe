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

The paged kernel (keys read through the block table) is checked against the
reference on each row's gathered (dequantized) table. It runs under Pallas'
generic interpreter (``interpret=True``), as ``test_tpu_decode.py`` does: the
TPU interpreter cannot yet read through a reshaped ref, which the strided
per-head reads shared with the decode kernel use. What the TPU interpreter
would add (blocks left unfetched past the visible end, ids within the cache)
is checked on the index maps themselves.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import export  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from inference.kernels import reference  # noqa: E402
from inference.kernels.quant import gather_dequantized, quantize_blocks  # noqa: E402
from inference.kernels.tpu_prefill import TpuPrefillBlocks, tpu_flash_prefill, tpu_paged_flash_prefill  # noqa: E402

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
_TILES = {"q8k128": TpuPrefillBlocks(8, 128), "q16k256": TpuPrefillBlocks(16, 256), "q16k128": TpuPrefillBlocks(16, 128)}
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


# Paged: the same ragged batch (3 key tiles of 128 in row 1) over a shuffled cache of N_PAGES pages.
N_PAGES = 200


def _paged_inputs(h: int, kv: int, d: int, bs: int, dtype=jnp.float32, seed: int = 3):
    rng = np.random.default_rng(seed)
    b, m = len(Q_OFFSETS), -(-S // bs)
    q = jnp.asarray(rng.standard_normal((b, T, h, d), np.float32)).astype(dtype)
    kc = jnp.asarray(rng.standard_normal((N_PAGES, bs, kv, d), np.float32)).astype(dtype)
    vc = jnp.asarray(rng.standard_normal((N_PAGES, bs, kv, d), np.float32)).astype(dtype)
    tables = rng.permutation(N_PAGES)[: b * m].reshape(b, m).astype(np.int32)
    tables[4, :3] = [-1, N_PAGES, N_PAGES + 7]  # stray ids in the empty row,
    tables[3, -3:] = [N_PAGES + 7, -1, N_PAGES]  # past row 3's 17 keys,
    tables[1, 1] = N_PAGES  # and one row 1 reads: clamped to the last page
    return q, kc, vc, jnp.asarray(tables), jnp.asarray(Q_OFFSETS), jnp.asarray(KV_LENS)


def _gathered_reference(q, kc, vc, tables, offs, lens, scale: float, k_scale=None, v_scale=None):
    safe = jnp.clip(tables, 0, N_PAGES - 1)
    if k_scale is None:
        k, v = reference.gather_pages(kc, safe), reference.gather_pages(vc, safe)
    else:
        k, v = gather_dequantized(kc, k_scale, safe), gather_dequantized(vc, v_scale, safe)
    return reference.prefill_attention(q, k, v, offs, lens, scale=scale)


# GQA 1/4/8, head dims 64/128, pages of 8/16/32, key tiles of 128/256 (interpreting compiles the unrolled
# pages x heads of a tile: few of them keep it quick).
_PAGED_GRID = [(64, 2, 2, 16, "q16k128"), (128, 8, 2, 8, "q16k128"), (64, 8, 1, 32, "q16k256"),
               (128, 8, 1, 16, "q8k128")]  # fmt: skip


@pytest.mark.parametrize("d,h,kv,bs,tiles", _PAGED_GRID)
def test_paged_matches_reference_on_gathered_keys(d: int, h: int, kv: int, bs: int, tiles: str) -> None:
    q, kc, vc, tables, offs, lens = _paged_inputs(h, kv, d, bs)
    out = tpu_paged_flash_prefill(q, kc, vc, tables, offs, lens, scale=d**-0.5, blocks=_TILES[tiles], interpret=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    _assert_valid_rows_close(out, _gathered_reference(q, kc, vc, tables, offs, lens, d**-0.5), atol=2e-5)


@pytest.mark.parametrize("kind,dtype", [("int8", jnp.float32), ("fp8", jnp.bfloat16)])
def test_paged_quantized_cache_dequantized_in_the_kernel(kind: str, dtype) -> None:
    q, kc, vc, tables, offs, lens = _paged_inputs(8, 2, 64, 32, seed=4)
    (kq, ks), (vq, vs) = quantize_blocks(kc, kind), quantize_blocks(vc, kind)
    out = tpu_paged_flash_prefill(q.astype(dtype), kq, vq, tables, offs, lens, scale=0.125, k_scale=ks, v_scale=vs,
                                  blocks=TpuPrefillBlocks(16, 128), interpret=True)  # fmt: skip
    want = _gathered_reference(q.astype(dtype), kq, vq, tables, offs, lens, 0.125, ks, vs)
    assert out.dtype == dtype
    _assert_valid_rows_close(out, want, atol=2e-5 if dtype == jnp.float32 else 2e-2)


def test_paged_bfloat16_matches_reference() -> None:
    q, kc, vc, tables, offs, lens = _paged_inputs(8, 2, 128, 16, jnp.bfloat16, seed=5)
    out = tpu_paged_flash_prefill(q, kc, vc, tables, offs, lens, scale=0.088, blocks=TpuPrefillBlocks(16, 128),
                                  interpret=True)  # fmt: skip
    assert out.dtype == jnp.bfloat16
    _assert_valid_rows_close(out, _gathered_reference(q, kc, vc, tables, offs, lens, 0.088), atol=2e-2)


def test_paged_unread_cache_does_not_matter() -> None:
    """Pages no visible key lives in, and a page's slots past a row's keys, may hold anything (NaN too)."""
    q, kc, vc, tables, offs, lens = _paged_inputs(8, 2, 64, 16, seed=6)
    run = functools.partial(tpu_paged_flash_prefill, scale=0.125, blocks=TpuPrefillBlocks(16, 128), interpret=True)
    out = run(q, kc, vc, tables, offs, lens)
    read = np.zeros(N_PAGES, bool)
    safe = np.clip(np.asarray(tables), 0, N_PAGES - 1)
    for b, n in enumerate(KV_LENS):
        read[safe[b, : -(-int(n) // 16)]] = True
    poisoned = jnp.asarray(~read)[:, None, None, None] | (jnp.arange(16) >= 1)[None, :, None, None] & (
        jnp.asarray(safe[3, 1]) == jnp.arange(N_PAGES))[:, None, None, None]  # row 3's keys 17.. of page 1
    again = run(q, jnp.where(poisoned, jnp.nan, kc), jnp.where(poisoned, jnp.nan, vc), tables, offs, lens)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(out))


def test_paged_index_maps_clamp_ids_and_skip_unneeded_pages() -> None:
    """Each needed table column names its (clamped) block; past a query block's last needed page every
    page slot repeats the block it last named (Pallas copies a block only when its index changes)."""
    from inference.kernels.tpu_prefill import _paged_index_map

    pages, bs, block_q, m, n = 3, 8, 8, 10, 12
    tables = np.array([[5, 11, -1, 12, 40, 2, 3, 0, 7, 9], [4, 6, 8, 1, 0, 2, 3, 5, 7, 9]], np.int32)
    offs, lens = jnp.asarray([0, 30], jnp.int32), jnp.asarray([20, 75], jnp.int32)
    maps = [_paged_index_map(p, (0,), pages=pages, page_size=bs, block_q=block_q, table_width=m, num_blocks=n)
            for p in range(pages)]  # fmt: skip
    flat = jnp.asarray(tables.reshape(-1))
    for b in range(2):
        for i in range(3):
            end = min(int(lens[b]), m * bs, int(offs[b]) + (i + 1) * block_q)
            last = -(-end // bs) - 1
            prev = None
            for j in range(-(-m // pages)):
                got = [int(f(b, i, j, offs, lens, flat)[0]) for f in maps]
                assert all(0 <= g < n for g in got)
                for p, g in enumerate(got):
                    if j * pages + p <= last:
                        assert g == min(max(tables[b, j * pages + p], 0), n - 1), (b, i, j, p)
                if j * pages > last:  # a tile past the visible end: nothing changes
                    assert got == prev, (b, i, j)
                prev = got


def test_paged_tiles_shrink_to_fit_vmem() -> None:
    from inference.kernels.tpu_prefill import _paged_tiles, _paged_vmem_bytes

    bf16 = jnp.bfloat16
    # Llama-3-8B heads: the default tile fits 16 MiB; larger ones shrink, key tiles first.
    assert _paged_tiles(32, 8, 128, 512, 16, 64, TpuPrefillBlocks(), bf16, bf16, True, 15 << 20) == (128, 8)
    block_q, pages = _paged_tiles(32, 8, 128, 2048, 16, 64, TpuPrefillBlocks(512, 512), bf16, bf16, True, 15 << 20)
    assert (block_q, pages) == (128, 8)
    assert _paged_vmem_bytes(32, 8, 128, block_q, 16, pages, bf16, bf16, True) <= 15 << 20
    # 64 query heads: half the query rows; a short prompt or table: the tile is clamped to it.
    assert _paged_tiles(64, 8, 128, 512, 16, 64, TpuPrefillBlocks(), bf16, bf16, True, 15 << 20) == (64, 8)
    assert _paged_tiles(8, 2, 64, 20, 8, 5, TpuPrefillBlocks(), jnp.float32, jnp.float32, False, 15 << 20) == (24, 5)


def test_paged_rejects_bad_arguments() -> None:
    q, kc, vc, tables, offs, lens = _paged_inputs(8, 2, 64, 16)
    (kq, ks) = quantize_blocks(kc, "int8")
    with pytest.raises(ValueError, match="must match q dtype"):
        tpu_paged_flash_prefill(q, kc.astype(jnp.bfloat16), vc.astype(jnp.bfloat16), tables, offs, lens, scale=0.1)
    with pytest.raises(ValueError, match="both k_scale and v_scale"):
        tpu_paged_flash_prefill(q, kq, kq, tables, offs, lens, scale=0.1, k_scale=ks)
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn codes"):
        tpu_paged_flash_prefill(q, kc, vc, tables, offs, lens, scale=0.1, k_scale=ks, v_scale=ks)
    with pytest.raises(ValueError, match="block_tables must be"):
        tpu_paged_flash_prefill(q, kc, vc, tables[:2], offs, lens, scale=0.1)
    with pytest.raises(ValueError, match="kv_lens must have shape"):
        tpu_paged_flash_prefill(q, kc, vc, tables, offs, lens[:2], scale=0.1)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        tpu_paged_flash_prefill(q[:, :, :7], kc, vc, tables, offs, lens, scale=0.1)
    with pytest.raises(ValueError, match="multiple of 128"):
        wide = jnp.zeros((N_PAGES, 16, 2, 192), jnp.float32)
        tpu_paged_flash_prefill(jnp.zeros((5, T, 8, 192)), wide, wide, tables, offs, lens, scale=0.1)


@pytest.mark.parametrize("code", [None, jnp.int8, jnp.float8_e4m3fn])
def test_paged_lowers_for_tpu(code) -> None:
    """The Pallas -> Mosaic lowering accepts the paged kernel over a bf16 cache and int8/fp8 codes."""
    sd = jax.ShapeDtypeStruct
    b, t, h, kv, d, n, bs, m = 2, 256, 32, 8, 128, 512, 16, 64
    cache = sd((n, bs, kv, d), code or jnp.bfloat16)
    scales = [sd((n, kv), jnp.float32)] * 2 if code else []

    def fn(q, kc, vc, tables, offs, lens, *sc):
        ks, vs = sc if sc else (None, None)
        return tpu_paged_flash_prefill(q, kc, vc, tables, offs, lens, scale=0.088, k_scale=ks, v_scale=vs)

    exported = export.export(jax.jit(fn), platforms=["tpu"])(
        sd((b, t, h, d), jnp.bfloat16), cache, cache, sd((b, m), jnp.int32), sd((b,), jnp.int32),
        sd((b,), jnp.int32), *scales)  # fmt: skip
    text = exported.mlir_module()
    assert "tpu_custom_call" in text and "tpu_paged_flash_prefill" in text
    assert exported.platforms == ("tpu",)


def test_tpu_backend_prefill_reads_the_paged_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """The TPU family's ``paged_prefill`` runs this kernel with the dense kernel's tile; a head dim it cannot
    take (over 128 lanes, not a multiple) gathers the table for the dense kernel instead."""
    from inference.kernels import pallas, tpu_prefill
    from inference.kernels.autotune import Autotuner

    paged_prefill = pallas.tpu_kernels(interpret=True, tuner=Autotuner(enabled=False)).paged_prefill
    calls = []
    monkeypatch.setattr(pallas, "tpu_paged_flash_prefill", lambda *a, **kw: calls.append(kw["blocks"])
                        or tpu_prefill.tpu_paged_flash_prefill(*a, **kw))  # fmt: skip
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.standard_normal((2, 16, 8, 64), np.float32))
    (kq, ks), (vq, vs) = (quantize_blocks(jnp.asarray(rng.standard_normal((12, 16, 2, 64), np.float32)), "int8")
                          for _ in range(2))  # fmt: skip
    tables = jnp.asarray([[9, 2, 5], [7, 0, 11]], jnp.int32)
    offs, lens = jnp.asarray([16, 0], jnp.int32), jnp.asarray([32, 16], jnp.int32)
    got = jax.jit(lambda *a: paged_prefill(*a, scale=0.125, k_scale=ks, v_scale=vs))(q, kq, vq, tables, offs, lens)
    want = reference.prefill_attention(q, gather_dequantized(kq, ks, tables), gather_dequantized(vq, vs, tables), offs,
                                       lens, scale=0.125)  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
    assert calls == [pallas.tpu_prefill_candidates()[0]]  # tuning off: the default tile

    sd = jax.ShapeDtypeStruct
    wide = sd((12, 16, 2, 192), jnp.bfloat16)
    compiled = pallas.tpu_kernels(tuner=Autotuner(enabled=False)).paged_prefill
    exported = export.export(jax.jit(lambda *a: compiled(*a, scale=0.07)), platforms=["tpu"])(
        sd((2, 16, 8, 192), jnp.bfloat16), wide, wide, sd((2, 3), jnp.int32), sd((2,), jnp.int32), sd((2,), jnp.int32))
    text = exported.mlir_module()
    assert "tpu_flash_prefill" in text and "tpu_paged_flash_prefill" not in text
