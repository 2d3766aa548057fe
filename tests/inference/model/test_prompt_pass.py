"""The prompt pass (#31: embeddings, echo's prompt logprobs) against a numpy Llama written from the
HF definition, on the tiny model's own HF tensors: the final hidden states (after the final norm,
HF's ``last_hidden_state``) and every position's logprob and top alternatives."""

from __future__ import annotations

import numpy as np
import pytest

from inference.model.config import TINY_CONFIG
from inference.model.jax_runner import JaxRunner
from inference.model.llama import Llama, rope_inv_freq
from inference.tasks import pooled
from inference.weights import TINY_SEED
from transport.messages import Pooling

# float32 throughout; the pass and the reference differ only in summation order, and the values
# compared are O(1) (unit-norm-ish hidden states, logprobs of a 258-token vocabulary: |lp| < ~10),
# so a few hundred float32 ulps (eps 1.2e-7) of two layers' matmuls of width <= 128 is the bound
ATOL = 1e-4


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, inv: np.ndarray) -> np.ndarray:  # x [T, H, D], HF rotate_half
    t = np.arange(x.shape[0], dtype=np.float64)[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([t, t], -1))[:, None, :], np.sin(np.concatenate([t, t], -1))[:, None, :]
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


def reference(ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(final hidden [T, H], log-softmax of the logits [T, V]) of the tiny model, in float64."""
    cfg = TINY_CONFIG
    w = {k: v.astype(np.float64) for k, v in Llama(cfg).random_hf_weights(TINY_SEED).items()}
    hq, kv, d, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    inv = rope_inv_freq(cfg).astype(np.float64)
    t = len(ids)
    x = w["model.embed_tokens.weight"][ids]
    mask = np.triu(np.full((t, t), -np.inf), 1)
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        q = _rope((h @ w[p + "self_attn.q_proj.weight"].T).reshape(t, hq, d), inv)
        k = _rope((h @ w[p + "self_attn.k_proj.weight"].T).reshape(t, kv, d), inv)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(t, kv, d)
        k, v = np.repeat(k, hq // kv, axis=1), np.repeat(v, hq // kv, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) * d ** -0.5 + mask
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", a, v).reshape(t, hq * d)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        g, u = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "mlp.down_proj.weight"].T
    hidden = _rms(x, w["model.norm.weight"], eps)
    logits = hidden @ w["model.embed_tokens.weight"].T  # tied head
    z = logits - logits.max(-1, keepdims=True)
    return hidden, z - np.log(np.exp(z).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def runner() -> JaxRunner:
    return JaxRunner.load("tiny", max_batch=2, num_blocks=64, max_prefill_batch=1)


@pytest.mark.parametrize("ids", [[256, 72, 105], [256, *b"The quick brown fox jumps over the lazy dog.", 10, 7]],
                         ids=["3 tokens", "47 tokens"])
def test_hidden_states_and_prompt_logprobs_equal_the_reference(runner: JaxRunner, ids: list[int]) -> None:
    hidden, lsm = reference(ids)
    got = runner.prompt_pass(ids, True)
    np.testing.assert_allclose(got.hidden, hidden, atol=ATOL)
    assert got.logprobs is not None and got.top_ids is not None and got.top_logprobs is not None
    assert np.isnan(got.logprobs[0]) and np.isnan(got.top_logprobs[0]).all()
    want = [lsm[i - 1, ids[i]] for i in range(1, len(ids))]  # position i as predicted at i - 1
    np.testing.assert_allclose(got.logprobs[1:], want, atol=ATOL)
    for i in range(1, len(ids)):
        np.testing.assert_allclose(got.top_logprobs[i], np.sort(lsm[i - 1])[::-1][:20], atol=ATOL)
        np.testing.assert_allclose(lsm[i - 1, got.top_ids[i]], got.top_logprobs[i], atol=ATOL)


def test_embeddings_pool_the_reference(runner: JaxRunner) -> None:
    ids = [256, *b"embed me"]
    hidden, _ = reference(ids)
    got = runner.prompt_pass(ids, False)
    assert got.logprobs is None
    for pooling, want in ((Pooling.MEAN, hidden.mean(0)), (Pooling.LAST, hidden[-1])):
        np.testing.assert_allclose(pooled(got.hidden, pooling), want / np.linalg.norm(want), atol=ATOL)


def test_a_prompt_beyond_the_context_is_refused(runner: JaxRunner) -> None:
    with pytest.raises(ValueError):
        runner.prompt_pass([1] * (runner.max_model_len + 1), False)
    with pytest.raises(ValueError):
        runner.prompt_pass([], False)
