"""On-device sampling: greedy, temperature, top-k, top-p, seeds, logprobs."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from inference.sampling import MAX_TOP_LOGPROBS, SamplingBatch, sample

PROBS = np.array([0.5, 0.3, 0.15, 0.05], np.float32)
_sample = jax.jit(sample)


def run(logits: np.ndarray, rows: list[tuple]) -> tuple[np.ndarray, ...]:
    batch = SamplingBatch.build(rows, len(rows))
    return tuple(np.asarray(x) for x in _sample(logits, *batch.arrays()))


def tile(n: int) -> np.ndarray:
    return np.tile(np.log(PROBS), (n, 1))


def test_temperature_zero_is_argmax():
    logits = np.random.default_rng(0).standard_normal((6, 50)).astype(np.float32)
    tokens, *_ = run(logits, [(0.0, 0, 1.0, i, 0, 0) for i in range(6)])
    assert tokens.tolist() == np.argmax(logits, -1).tolist()


def test_top_k_1_and_tiny_top_p_are_greedy_even_when_hot():
    logits = np.random.default_rng(1).standard_normal((8, 50)).astype(np.float32)
    t1, *_ = run(logits, [(5.0, 1, 1.0, i, 0, 0) for i in range(8)])
    t2, *_ = run(logits, [(5.0, 0, 1e-6, i, 0, 0) for i in range(8)])
    assert t1.tolist() == t2.tolist() == np.argmax(logits, -1).tolist()


def test_frequencies_follow_softmax():
    n = 4000
    tokens, *_ = run(tile(n), [(1.0, 0, 1.0, 7, step, 0) for step in range(n)])
    freq = np.bincount(tokens, minlength=4) / n
    np.testing.assert_allclose(freq, PROBS, atol=0.03)


def test_top_k_and_top_p_truncate_and_renormalise():
    n = 3000
    tk, *_ = run(tile(n), [(1.0, 2, 1.0, 3, step, 0) for step in range(n)])
    assert set(tk.tolist()) == {0, 1}
    np.testing.assert_allclose(np.bincount(tk, minlength=2)[:2] / n, [0.625, 0.375], atol=0.03)
    # top_p=0.7: token 1 has 0.5 of mass before it (kept), token 2 has 0.8 (dropped).
    tp, *_ = run(tile(n), [(1.0, 0, 0.7, 4, step, 0) for step in range(n)])
    assert set(tp.tolist()) == {0, 1}


def test_seed_gives_same_token_whatever_the_batch():
    rng = np.random.default_rng(2)
    mine = rng.standard_normal(50).astype(np.float32)
    for step in range(5):
        alone, *_ = run(mine[None], [(1.0, 0, 1.0, 42, step, 0)])
        others = rng.standard_normal((5, 50)).astype(np.float32)
        batch = np.concatenate([others[:3], mine[None], others[3:]])
        rows = [(0.8, 5, 0.9, 1000 + i, i, 0) for i in range(6)]
        rows[3] = (1.0, 0, 1.0, 42, step, 0)
        mixed, *_ = run(batch, rows)
        assert alone[0] == mixed[3]


def test_different_seeds_and_64_bit_seeds_differ():
    n = 64
    logits = np.zeros((n, 200), np.float32)
    a, *_ = run(logits, [(1.0, 0, 1.0, 1, s, 0) for s in range(n)])
    b, *_ = run(logits, [(1.0, 0, 1.0, 2, s, 0) for s in range(n)])
    c, *_ = run(logits, [(1.0, 0, 1.0, 1 + (1 << 40), s, 0) for s in range(n)])
    assert (a != b).sum() > n // 2 and (a != c).sum() > n // 2


def test_logprobs_and_top_logprobs():
    logits = np.random.default_rng(3).standard_normal((3, 40)).astype(np.float32)
    tokens, lps, top_ids, top_lps = run(logits, [(1.0, 0, 1.0, i, 0, 3) for i in range(3)])
    ref = np.asarray(jax.nn.log_softmax(logits, -1))
    np.testing.assert_allclose(lps, ref[np.arange(3), tokens], atol=1e-6)
    assert top_ids.shape == (3, MAX_TOP_LOGPROBS)
    np.testing.assert_array_equal(top_ids[:, :3], np.argsort(-ref, -1)[:, :3])
    np.testing.assert_allclose(top_lps[:, :3], -np.sort(-ref, -1)[:, :3], atol=1e-6)


def test_bad_parameters_are_rejected():
    with pytest.raises(ValueError, match="top_p"):
        SamplingBatch.build([(1.0, 0, 0.0, 0, 0, 0)], 1)
    with pytest.raises(ValueError, match="temperature"):
        SamplingBatch.build([(-1.0, 0, 1.0, 0, 0, 0)], 1)
    with pytest.raises(ValueError, match="fit"):
        SamplingBatch.build([(1.0, 0, 1.0, 0, 0, 0)] * 3, 2)
