"""The chunked online-softmax attention (``xla_attention``) and the native CPU kernels (``cpu_ffi``)
against float64 with derived bounds, and against the reference where codes are dequantized."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inference.kernels import cpu_ffi, reference, xla_attention
from inference.kernels.kernel_set import build_kernels
from inference.kernels.quant import quantize_blocks
from tests.inference.kernels import float64_bounds as f64

# The fewest keys either path folds into its online softmax per step (a block of 8 here; the jnp loops
# take whole blocks or 64-key chunks, the native kernels a block or 64 keys): the float64 bounds grow
# with the number of steps, so counting the finest steps keeps them valid for both.
_FEWEST_KEYS_PER_STEP = 8
IMPLS = {"native": (cpu_ffi.prefill_attention_cpu, cpu_ffi.paged_decode_cpu),
         "xla": (xla_attention.prefill_attention, xla_attention.paged_decode_attention)}


@pytest.fixture(params=list(IMPLS))
def impl(request: pytest.FixtureRequest) -> str:
    """Every float32 test runs on the native kernels (cpu_ffi) and on the jnp loops."""
    if request.param == "native":
        assert cpu_ffi.available(), "the native CPU kernels did not build (is g++ installed?)"
    return str(request.param)


def prefill_attention(impl: str, *args, scale: float):
    return IMPLS[impl][0](*args, scale=scale)


def paged_decode_attention(impl: str, *args, scale: float):
    return IMPLS[impl][1](*args, scale=scale)


@pytest.mark.parametrize("kv_quant", [None, "int8"])
def test_the_native_kernels_are_what_the_cpu_kernel_set_runs(kv_quant: str | None) -> None:
    """``native`` on CPU: a float32 cache's decode is the native call; a quantized cache's decode, and a
    bfloat16 model's, keep the jnp loop; ``xla`` never makes a native call."""
    rng = np.random.default_rng(7)
    q, kc, vc = randn(rng, 2, 4, 8), randn(rng, 6, 4, 2, 8), randn(rng, 6, 4, 2, 8)
    if kv_quant:
        kc, vc = quantize_blocks(kc, kv_quant), quantize_blocks(vc, kv_quant)
    tables, ctx = jnp.asarray([[0, 1, 2], [3, 4, 5]], jnp.int32), jnp.asarray([9, 3], jnp.int32)
    for name, dtype, native in (("native", jnp.float32, kv_quant is None), ("native", jnp.bfloat16, False),
                                ("xla", jnp.float32, False)):
        ks = build_kernels(name, dtype=dtype, kv_quant=kv_quant, platform="cpu")
        qq = q.astype(dtype)
        if not kv_quant:
            kc, vc = kc.astype(dtype), vc.astype(dtype)
        hlo = jax.jit(lambda *a, ks=ks: ks.decode(*a, scale=0.3)).lower(qq, kc, vc, tables, ctx).as_text()
        assert ("quicserve_paged_decode_f32" in hlo) == native, (name, dtype)


def test_the_native_prefill_kernel_is_what_the_cpu_kernel_set_runs() -> None:
    rng = np.random.default_rng(8)
    q, kc = randn(rng, 2, 5, 4, 8), randn(rng, 6, 4, 2, 8)
    tables = jnp.asarray([[0, 1, 2], [3, 4, 5]], jnp.int32)
    q_off, kv_len = jnp.asarray([0, 4], jnp.int32), jnp.asarray([5, 9], jnp.int32)
    for name, dtype, native in (("native", jnp.float32, True), ("native", jnp.bfloat16, False),
                                ("xla", jnp.float32, False)):
        ks = build_kernels(name, dtype=dtype, platform="cpu")
        args = (q.astype(dtype), kc.astype(dtype), kc.astype(dtype), tables, q_off, kv_len)
        hlo = jax.jit(lambda *a, ks=ks: ks.prefill(*a, scale=0.3)).lower(*args).as_text()
        assert ("quicserve_prefill_f32" in hlo) == native, (name, dtype)
        assert ("quicserve_gather_live_f32" in hlo) == native  # only the live blocks are copied


def randn(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32))


def test_prefill_matches_dense_with_offsets_gqa_and_padding(impl: str):
    rng = np.random.default_rng(0)
    b, t, s, h, kv, d = 3, 20, 600, 8, 2, 16  # s spans ten key chunks (64 keys each for 20 queries)
    q, k, v = randn(rng, b, t, h, d), randn(rng, b, s, kv, d), randn(rng, b, s, kv, d)
    q_off = jnp.asarray([0, 290, 570], jnp.int32)
    kv_len = jnp.asarray([13, 310, 590], jnp.int32)  # row 0 has only 13 real queries
    got = np.asarray(prefill_attention(impl, q, k, v, q_off, kv_len, scale=0.25))
    want, bound, real = f64.prefill(q, k, v, q_off, kv_len, 0.25, tile=_FEWEST_KEYS_PER_STEP)
    assert real[0].sum() == 13 and real[1:].all()
    f64.assert_within(got[real], want[real], bound[real], "prefill")


def test_first_query_sees_only_itself(impl: str):
    rng = np.random.default_rng(1)
    q, k, v = randn(rng, 1, 4, 2, 8), randn(rng, 1, 4, 1, 8), randn(rng, 1, 4, 1, 8)
    out = prefill_attention(impl, q, k, v, jnp.zeros(1, jnp.int32), jnp.full(1, 4, jnp.int32), scale=1.0)
    np.testing.assert_allclose(np.asarray(out)[0, 0, 0], np.asarray(v)[0, 0, 0], atol=1e-6)


def test_paged_decode_matches_dense_and_padding_rows_are_zero(impl: str):
    rng = np.random.default_rng(2)
    n, bs, kv, d, h = 64, 8, 2, 16, 4
    kc, vc = randn(rng, n, bs, kv, d), randn(rng, n, bs, kv, d)
    tables = jnp.asarray(np.stack([rng.permutation(n)[:40] for _ in range(4)]), jnp.int32)
    ctx = jnp.asarray([1, 129, 300, 0], jnp.int32)  # crosses several decode chunks; row 3 is padding
    q = randn(rng, 4, h, d)
    got = np.asarray(paged_decode_attention(impl, q, kc, vc, tables, ctx, scale=0.3))
    f64.assert_within(got, *f64.paged_decode(q, kc, vc, tables, ctx, 0.3, tile=_FEWEST_KEYS_PER_STEP), "decode")
    assert np.all(got[3] == 0) and np.all(np.isfinite(got))


def _paged_inputs(seed: int, b: int, h: int, kv: int, d: int = 16, bs: int = 16, m: int = 12, n: int = 512):
    rng = np.random.default_rng(seed)
    kc, vc = randn(rng, n, bs, kv, d), randn(rng, n, bs, kv, d)
    tables = jnp.asarray(rng.permutation(n)[: b * m].reshape(b, m), jnp.int32)  # scattered blocks
    return randn(rng, b, h, d), kc, vc, tables


# Context lengths at the edges of the decode loop's steps: one token, one block, exactly one step,
# one past a step, the whole table. At batch 1 and 8 a step is 64 tokens (4 blocks), at 32 it is 16.
EDGE_LENS = [1, 16, 63, 64, 65, 128, 129, 192]


@pytest.mark.parametrize("b", [1, 8, 32])
@pytest.mark.parametrize("h,kv", [(8, 4), (8, 2), (16, 8)])  # 16/8: more KV heads than the GEMM path takes
def test_paged_decode_chunk_edges_match_dense(impl: str, b: int, h: int, kv: int):
    q, kc, vc, tables = _paged_inputs(3, b, h, kv)
    ctx = jnp.asarray([EDGE_LENS[i % len(EDGE_LENS)] for i in range(b)], jnp.int32)
    got = np.asarray(paged_decode_attention(impl, q, kc, vc, tables, ctx, scale=0.25))
    f64.assert_within(got, *f64.paged_decode(q, kc, vc, tables, ctx, 0.25, tile=_FEWEST_KEYS_PER_STEP), "decode")


def test_paged_decode_chunk_size_follows_batch():
    assert xla_attention._decode_chunk_tokens(1, 16, 32) == 4  # blocks per loop step
    assert xla_attention._decode_chunk_tokens(8, 16, 32) == 4
    assert xla_attention._decode_chunk_tokens(32, 16, 32) == 1
    assert xla_attention._decode_chunk_tokens(1, 16, 3) == 3  # never wider than the table
    assert xla_attention._decode_chunk_tokens(256, 16, 32) == 1


def test_paged_decode_ignores_keys_past_the_context(impl: str):
    """Poisoned blocks past each row's context (and the tail of its last block) change nothing."""
    b, h, kv, bs = 8, 8, 4, 16
    q, kc, vc, tables = _paged_inputs(4, b, h, kv)
    ctx = jnp.asarray([1, 16, 63, 64, 65, 100, 129, 5], jnp.int32)
    clean = np.asarray(paged_decode_attention(impl, q, kc, vc, tables, ctx, scale=0.25))
    for row, n in enumerate(np.asarray(ctx)):
        last = tables[row, (n - 1) // bs]
        kc = kc.at[last, (n - 1) % bs + 1:].set(1e4)
        vc = vc.at[last, (n - 1) % bs + 1:].set(-1e4)
        for j in range(-(-int(n) // bs), tables.shape[1]):
            kc, vc = kc.at[tables[row, j]].set(1e4), vc.at[tables[row, j]].set(-1e4)
    poisoned = np.asarray(paged_decode_attention(impl, q, kc, vc, tables, ctx, scale=0.25))
    np.testing.assert_allclose(poisoned, clean, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("b,kv", [(1, 4), (32, 4), (8, 8)])
def test_paged_decode_quantized_cache_matches_dequantized_dense(kind: str, b: int, kv: int):
    q, kc, vc, tables = _paged_inputs(5, b, 2 * kv, kv)
    kq, ks = quantize_blocks(kc, kind)
    vq, vs = quantize_blocks(vc, kind)
    k_deq = kq.astype(jnp.float32) * ks[:, None, :, None]
    v_deq = vq.astype(jnp.float32) * vs[:, None, :, None]
    ctx = jnp.asarray([EDGE_LENS[(i + 3) % len(EDGE_LENS)] for i in range(b)], jnp.int32)
    got = np.asarray(xla_attention.paged_decode_attention(q, kq, vq, tables, ctx, scale=0.25, k_scale=ks, v_scale=vs))
    ref = np.asarray(reference.paged_decode_attention(q, k_deq, v_deq, tables, ctx, scale=0.25))
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=0)


def test_paged_decode_compiles_once_for_any_context(impl: str):
    """Context length is data, not shape: one trace serves short and long batches."""
    q, kc, vc, tables = _paged_inputs(6, 8, 8, 4)
    traces = []

    def f(*args):
        traces.append(1)
        return paged_decode_attention(impl, *args, scale=0.25)

    fn = jax.jit(f)
    for ctx in ([1] * 8, [192] * 8, [17, 64, 65, 3, 100, 150, 2, 191]):
        lens = jnp.asarray(ctx, jnp.int32)
        f64.assert_within(fn(q, kc, vc, tables, lens),
                          *f64.paged_decode(q, kc, vc, tables, lens, 0.25, tile=_FEWEST_KEYS_PER_STEP), f"ctx {ctx}")
    assert len(traces) == 1
