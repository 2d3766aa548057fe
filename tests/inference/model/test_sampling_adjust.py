"""Logit adjustments (penalties, logit_bias, min_tokens) against a numpy reference written from the
definitions (inference/penalties.py's docstring), through the host tables and the jitted sampler."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from inference.penalties import AdjustBatch, LogitAdjust
from inference.sampling import SamplingBatch, adjust_logits, sample, sample_adjusted, sample_masked_adjusted
from transport.messages import SamplingParams

V = 40
EOS = 3
_adjust = jax.jit(adjust_logits)
_sample_adjusted = jax.jit(sample_adjusted)
_sample = jax.jit(sample)


def reference(logits: np.ndarray, prompt: list[int], generated: list[int], p: SamplingParams,
              stop_ids: set[int]) -> np.ndarray:
    """One row, straight from the definitions: bias and min_tokens, repetition (prompt + output),
    frequency and presence (output only)."""
    out = logits.astype(np.float64).copy()
    for tok, b in p.logit_bias:
        out[tok] += b
    if len(generated) < p.min_tokens:
        banned = out.copy()
        banned[sorted(stop_ids)] = -np.inf
        if np.isfinite(banned).any():
            out = banned
    for tok in set(prompt) | set(generated):
        r = p.repetition_penalty
        out[tok] = out[tok] / r if out[tok] > 0 else out[tok] * r
    counts = np.bincount(np.asarray(generated, np.int64), minlength=V).astype(np.float64) if generated else np.zeros(V)
    out -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return out


def table(prompt: list[int], generated: list[int], p: SamplingParams, stop_ids: set[int]) -> LogitAdjust:
    a = LogitAdjust(p, len(prompt), stop_ids)
    tokens = list(prompt)
    a.fold(tokens)
    for t in generated:  # one at a time, as a sequence accepts them
        tokens.append(t)
        a.fold(tokens)
    return a


CASES = [
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=0.7),
    SamplingParams(frequency_penalty=-0.5, presence_penalty=-1.0),
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(repetition_penalty=0.6),
    SamplingParams(logit_bias=((5, 100.0), (7, -100.0), (9, 3.5))),
    SamplingParams(max_tokens=64, min_tokens=30),
    SamplingParams(max_tokens=64, presence_penalty=0.4, frequency_penalty=1.1, repetition_penalty=1.3,
                   logit_bias=((2, -4.0), (EOS, 2.0)), min_tokens=30),
]


@pytest.mark.parametrize("p", CASES)
def test_adjusted_logits_match_the_reference(p: SamplingParams) -> None:
    rng = np.random.default_rng(0)
    rows, works, refs = [], [], []
    for r in range(5):
        logits = (3 * rng.standard_normal(V)).astype(np.float32)
        prompt = rng.integers(0, V, 12).tolist()
        generated = rng.integers(0, V, 5 * r).tolist()  # 0..20 tokens, repeats among them
        stops = {EOS, 11}
        rows.append(logits)
        works.append((table(prompt, generated, p, stops), len(generated)))
        refs.append(reference(logits, prompt, generated, p, stops))
    works.append((None, 0))  # a row without adjustments in the same batch stays as it was
    plain = (3 * rng.standard_normal(V)).astype(np.float32)
    rows.append(plain)
    refs.append(plain.astype(np.float64))
    batch = AdjustBatch(works, 8)
    logits = np.zeros((8, V), np.float32)
    logits[:6] = np.stack(rows)
    got = np.asarray(_adjust(logits, *batch.arrays()))[:6]
    np.testing.assert_allclose(got, np.stack(refs), rtol=1e-6, atol=1e-5)


def test_min_tokens_keeps_an_end_a_grammar_leaves_alone() -> None:
    """A row where only the end tokens are finite (a finished grammar) keeps them."""
    p = SamplingParams(max_tokens=10, min_tokens=5)
    logits = np.full((1, V), -np.inf, np.float32)
    logits[0, EOS] = 0.5
    got = np.asarray(_adjust(logits, *AdjustBatch([(table([1, 2], [], p, {EOS}), 0)], 1).arrays()))
    assert got[0, EOS] == 0.5


def test_min_tokens_lifts_once_reached() -> None:
    p = SamplingParams(max_tokens=10, min_tokens=3)
    a = table([1], [4, 5], p, {EOS})
    assert a.ending_banned(2) and not a.ending_banned(3)
    assert EOS in a.entries(2)[0] and EOS not in a.entries(3)[0]


def test_tables_grow_past_their_first_width_and_stay_sparse() -> None:
    p = SamplingParams(max_tokens=200, frequency_penalty=1.0)
    gen = [i % 97 for i in range(300)]
    a = table(list(range(30)), gen, p, {EOS})
    ids, count, _, _ = a.entries(len(gen))
    assert len(ids) == 97  # distinct generated tokens only: the prompt counts for repetition alone
    assert dict(zip(ids.tolist(), count.tolist(), strict=True)) == {t: float(gen.count(t)) for t in set(gen)}
    assert AdjustBatch([(a, len(gen))], 2).width == 256


def test_greedy_with_penalties_samples_the_reference_argmax() -> None:
    rng = np.random.default_rng(5)
    p = SamplingParams(frequency_penalty=2.0, presence_penalty=2.0, repetition_penalty=2.0)
    logits = rng.standard_normal((4, V)).astype(np.float32)
    works, want = [], []
    for r in range(4):
        gen = rng.integers(0, V, 8).tolist()
        works.append((table([0, 1], gen, p, {EOS}), len(gen)))
        want.append(int(np.argmax(reference(logits[r], [0, 1], gen, p, {EOS}))))
    s = SamplingBatch.build([(0.0, 0, 1.0, r, 8, 0) for r in range(4)], 4)
    tokens, *_ = _sample_adjusted(logits, *AdjustBatch(works, 4).arrays(), *s.arrays())
    assert np.asarray(tokens).tolist() == want


def test_logit_bias_plus_100_forces_a_token_when_sampling_hot() -> None:
    p = SamplingParams(temperature=1.0, logit_bias=((17, 100.0),))
    logits = np.random.default_rng(6).standard_normal((16, V)).astype(np.float32)
    works = [(table([0], [], p, {EOS}), 0) for _ in range(16)]
    s = SamplingBatch.build([(1.0, 0, 1.0, r, 0, 0) for r in range(16)], 16)
    tokens, *_ = _sample_adjusted(logits, *AdjustBatch(works, 16).arrays(), *s.arrays())
    assert set(np.asarray(tokens).tolist()) == {17}


def test_neutral_adjustments_sample_exactly_as_the_plain_sampler() -> None:
    """Same seeds, no entries: the adjusted executable draws the plain one's tokens and logprobs."""
    logits = np.random.default_rng(7).standard_normal((8, V)).astype(np.float32)
    s = SamplingBatch.build([(0.9, 0, 0.95, 100 + r, r, 3) for r in range(8)], 8)
    plain = [np.asarray(x) for x in _sample(logits, *s.arrays())]
    adj = [np.asarray(x) for x in _sample_adjusted(logits, *AdjustBatch([(None, 0)] * 8, 8).arrays(), *s.arrays())]
    for a, b in zip(plain, adj, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_grammar_mask_wins_over_a_positive_bias() -> None:
    """Composition with structured output: +100 on a token the mask forbids cannot bring it back."""
    p = SamplingParams(logit_bias=((3, 100.0),))
    logits = np.zeros((1, V), np.float32)
    mask = np.zeros((1, (V + 31) // 32), np.int32)
    mask[0, 0] = 1 << 6  # only token 6 allowed
    s = SamplingBatch.build([(0.0, 0, 1.0, 0, 0, 0)], 1)
    tokens, *_ = jax.jit(sample_masked_adjusted)(logits, mask, *AdjustBatch([(table([0], [], p, set()), 0)], 1).arrays(),
                                                 *s.arrays())
    assert int(np.asarray(tokens)[0]) == 6
