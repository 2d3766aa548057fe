"""The ``[out, in]`` weight layout the runner uses computes what the loaded ``[in, out]`` one does."""

from __future__ import annotations

import tempfile

import jax.numpy as jnp
import numpy as np
import pytest

from inference.kernels.kernel_set import build_kernels
from inference.kernels.paged_cache import init_kv_cache
from inference.weights import load_model, write_hf_checkpoint

UNTIED = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)


def _prefill_then_decode(model, params) -> tuple[np.ndarray, np.ndarray]:
    kernels, cfg = build_kernels("reference"), model.config
    cache = init_kv_cache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 4, 8, jnp.float32)
    n = 11
    tokens = jnp.asarray([[(7 * i + 3) % cfg.vocab_size for i in range(n)]], jnp.int32)
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    tables = jnp.asarray([[2, 0, 3, 1]], jnp.int32)
    slots = tables[0][pos // 8] * 8 + pos % 8
    one = jnp.ones(1, jnp.int32)
    logits, cache = model.prefill(params, cache, tokens, pos, slots, tables, 0 * one, n * one, (n - 1) * one,
                                  kernels=kernels)
    step, _ = model.decode(params, cache, jnp.asarray([5], jnp.int32), n * one, tables[0][n // 8] * 8 + n % 8,
                           tables, (n + 1) * one, kernels=kernels)
    return np.asarray(logits), np.asarray(step)


@pytest.mark.parametrize("tied", [True, False])
def test_transposed_weights_give_the_same_logits(tied):
    if tied:
        loaded = load_model("tiny")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            write_hf_checkpoint(tmp, UNTIED, seed=3)
            loaded = load_model(tmp)
    assert ("lm_head" in loaded.params) == (not tied)
    moved = loaded.model.serving_params(loaded.params)
    assert "wqkv" not in moved["layers"][0] and moved["layers"][0]["wqkv_t"].shape == loaded.params["layers"][0]["wqkv"].shape[::-1]
    assert ("lm_head_t" in moved) == (not tied)
    want = _prefill_then_decode(loaded.model, loaded.params)
    got = _prefill_then_decode(loaded.model, moved)
    for g, w in zip(got, want, strict=True):
        assert np.abs(w).max() > 0
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)
