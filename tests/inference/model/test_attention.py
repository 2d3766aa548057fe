"""The chunked online-softmax attention against straightforward dense versions."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from inference.model.attention import (
    dense_paged_decode_attention,
    dense_prefill_attention,
    get_attention_backend,
    paged_decode_attention,
    prefill_attention,
    set_attention_backend,
)


def randn(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32))


def test_prefill_matches_dense_with_offsets_gqa_and_padding():
    rng = np.random.default_rng(0)
    b, t, s, h, kv, d = 3, 20, 600, 8, 2, 16  # s spans ten key chunks (64 keys each for 20 queries)
    q, k, v = randn(rng, b, t, h, d), randn(rng, b, s, kv, d), randn(rng, b, s, kv, d)
    q_off = jnp.asarray([0, 290, 570], jnp.int32)
    kv_len = jnp.asarray([13, 310, 590], jnp.int32)  # row 0 has only 13 real queries
    got = prefill_attention(q, k, v, q_off, kv_len, scale=0.25)
    ref = dense_prefill_attention(q, k, v, q_off, kv_len, scale=0.25)
    np.testing.assert_allclose(np.asarray(got)[0, :13], np.asarray(ref)[0, :13], atol=1e-5)
    np.testing.assert_allclose(np.asarray(got)[1:], np.asarray(ref)[1:], atol=1e-5)


def test_first_query_sees_only_itself():
    rng = np.random.default_rng(1)
    q, k, v = randn(rng, 1, 4, 2, 8), randn(rng, 1, 4, 1, 8), randn(rng, 1, 4, 1, 8)
    out = prefill_attention(q, k, v, jnp.zeros(1, jnp.int32), jnp.full(1, 4, jnp.int32), scale=1.0)
    np.testing.assert_allclose(np.asarray(out)[0, 0, 0], np.asarray(v)[0, 0, 0], atol=1e-6)


def test_paged_decode_matches_dense_and_padding_rows_are_zero():
    rng = np.random.default_rng(2)
    n, bs, kv, d, h = 64, 8, 2, 16, 4
    kc, vc = randn(rng, n, bs, kv, d), randn(rng, n, bs, kv, d)
    tables = jnp.asarray(np.stack([rng.permutation(n)[:40] for _ in range(4)]), jnp.int32)
    ctx = jnp.asarray([1, 129, 300, 0], jnp.int32)  # crosses several decode chunks; row 3 is padding
    q = randn(rng, 4, h, d)
    got = np.asarray(paged_decode_attention(q, kc, vc, tables, ctx, scale=0.3))
    ref = np.asarray(dense_paged_decode_attention(q, kc, vc, tables, ctx, scale=0.3))
    np.testing.assert_allclose(got[:3], ref[:3], atol=1e-5)
    assert np.all(got[3] == 0) and np.all(np.isfinite(got))


def test_backend_switch_validates_names():
    assert get_attention_backend("reference") == (prefill_attention, paged_decode_attention)
    with pytest.raises(ValueError, match="unknown attention backend"):
        set_attention_backend("nope")
    set_attention_backend("reference")
    assert get_attention_backend() == (prefill_attention, paged_decode_attention)
