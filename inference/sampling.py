"""On-device token sampling: greedy, temperature, top-k, top-p, seeded.

Each row carries its own parameters. The random key of a row is
``fold_in(PRNGKey(seed), num_generated)`` (the high 32 bits of a 64-bit seed
are folded in first when non-zero), so a request with a given seed samples
the same tokens whatever else shares its batch. Temperature ``<= 0`` means
greedy. Logprobs are the log-softmax of the *unscaled* logits (what the model
thinks, as OpenAI reports them); the top-n alternatives are computed only
when some row asks for them.

Structured output (:mod:`inference.grammar`) samples through :func:`sample_masked`,
a separate executable that takes a packed bit mask per row (int32 words, bit
``t % 32`` of word ``t // 32`` allows token ``t``, llguidance's layout) and
puts ``-inf`` on every token it forbids before anything else: greedy, sampling
and the logprobs all see only what the grammar allows. A batch without a
constrained row never runs it.

Logit adjustments (#31: ``logit_bias``, ``min_tokens``, presence, frequency and repetition penalties;
the host side and the reasons for its sparse form are :mod:`inference.penalties`) go through
:func:`sample_adjusted` / :func:`sample_masked_adjusted`, again executables of their own: a row's
sparse table ``[B, W]`` (ids, generated counts, seen flags, biases) is scattered into ``[B, V]`` and
applied (:func:`adjust_logits`) after a grammar's mask and before anything else, so greedy, sampling
and the logprobs see the adjusted distribution, as with a mask. A batch without an adjusted row never
runs them: the plain sampler's executable and cost are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["MAX_TOP_LOGPROBS", "SamplingBatch", "SampleResult", "sample", "sample_masked", "apply_mask", "row_keys",
           "adjust_logits", "sample_adjusted", "sample_masked_adjusted", "ADJUST_DTYPES"]

Array = jax.Array
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """Per-row sampling parameters, as host arrays of length B."""

    temperature: np.ndarray  # float32
    top_k: np.ndarray  # int32, 0 = off
    top_p: np.ndarray  # float32, 1 = off
    seed_lo: np.ndarray  # uint32
    seed_hi: np.ndarray  # uint32
    step: np.ndarray  # int32 (num_generated)
    want_top: np.ndarray  # bool: row wants top-n logprobs

    @classmethod
    def build(cls, rows: list[tuple[float, int, float, int, int, int]], size: int) -> SamplingBatch:
        """rows: (temperature, top_k, top_p, seed, num_generated, top_logprobs); padded to ``size``."""
        n = len(rows)
        if n > size:
            raise ValueError(f"{n} rows do not fit a batch of {size}")
        temp = np.zeros(size, np.float32)
        top_k = np.zeros(size, np.int32)
        top_p = np.ones(size, np.float32)
        lo = np.zeros(size, np.uint32)
        hi = np.zeros(size, np.uint32)
        step = np.zeros(size, np.int32)
        want = np.zeros(size, np.bool_)
        for i, (t, k, p, seed, gen, ntop) in enumerate(rows):
            if not 0.0 < p <= 1.0:
                raise ValueError(f"top_p must be in (0, 1], got {p}")
            if k < 0 or t < 0:
                raise ValueError(f"top_k and temperature must be >= 0, got {k}, {t}")
            seed &= (1 << 64) - 1
            temp[i], top_k[i], top_p[i] = t, k, p
            lo[i], hi[i] = seed & 0xFFFFFFFF, seed >> 32
            step[i], want[i] = gen, ntop > 0
        return cls(temp, top_k, top_p, lo, hi, step, want)

    def arrays(self) -> tuple[np.ndarray, ...]:
        return (self.temperature, self.top_k, self.top_p, self.seed_lo, self.seed_hi, self.step,
                self.want_top)


class SampleResult(NamedTuple):
    tokens: Array  # [B] int32
    logprobs: Array  # [B] float32
    top_ids: Array  # [B, MAX_TOP_LOGPROBS] int32 (zeros unless some row wanted them)
    top_logprobs: Array  # [B, MAX_TOP_LOGPROBS] float32


def row_keys(seed_lo: Array, seed_hi: Array, step: Array) -> Array:
    """Per-row PRNG keys ``fold_in(PRNGKey(seed), step)``."""

    def one(lo: Array, hi: Array, n: Array) -> Array:
        key = jax.random.PRNGKey(lo)
        key = jnp.where(hi != 0, jax.random.fold_in(key, hi), key)
        return jax.random.fold_in(key, n)

    return jax.vmap(one)(seed_lo, seed_hi, step)


def _sample_stochastic(logits: Array, temperature: Array, top_k: Array, top_p: Array,
                       keys: Array) -> Array:
    b, v = logits.shape
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    iota = jnp.broadcast_to(jnp.arange(v, dtype=jnp.int32), (b, v))
    neg_sorted, order = jax.lax.sort((-scaled, iota), dimension=1, num_keys=1)
    sorted_logits = -neg_sorted
    rank = jnp.arange(v, dtype=jnp.int32)[None, :]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before this token
    keep = keep & ((before < top_p[:, None]) | (rank == 0))
    # Inverse-CDF draw: one uniform per row (cheap to compile and to run).
    kept = jnp.where(keep, probs, 0.0)
    cdf = jnp.cumsum(kept, axis=-1)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys) * cdf[:, -1]
    choice = jnp.minimum(jnp.sum(cdf <= u[:, None], axis=-1), v - 1)
    choice = jnp.where(jnp.take_along_axis(keep, choice[:, None], axis=1)[:, 0], choice, 0)
    return jnp.take_along_axis(order, choice[:, None], axis=1)[:, 0]


def sample(logits: Array, temperature: Array, top_k: Array, top_p: Array, seed_lo: Array,
           seed_hi: Array, step: Array, want_top: Array) -> SampleResult:
    """Sample one token per row of ``logits`` [B,V] (float32). Jit-friendly."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    keys = row_keys(seed_lo, seed_hi, step)
    tokens = jax.lax.cond(
        jnp.all(temperature <= 0),
        lambda: greedy,
        lambda: jnp.where(temperature <= 0, greedy,
                          _sample_stochastic(logits, temperature, top_k, top_p, keys).astype(jnp.int32)),
    )
    logprobs_all = jax.nn.log_softmax(logits, axis=-1)
    lp = jnp.take_along_axis(logprobs_all, tokens[:, None], axis=1)[:, 0]
    b = logits.shape[0]
    n_top = min(MAX_TOP_LOGPROBS, logits.shape[1])

    def top() -> tuple[Array, Array]:
        vals, ids = jax.lax.top_k(logprobs_all, n_top)
        return ids.astype(jnp.int32), vals

    def none() -> tuple[Array, Array]:
        return jnp.zeros((b, n_top), jnp.int32), jnp.zeros((b, n_top), jnp.float32)

    top_ids, top_lps = jax.lax.cond(jnp.any(want_top), top, none)
    return SampleResult(tokens, lp, top_ids, top_lps)


def apply_mask(logits: Array, mask: Array) -> Array:
    """``logits`` [B,V] with ``-inf`` where the packed bit mask [B, ceil(V/32)] (int32) has a 0 bit."""
    v = logits.shape[1]
    idx = jnp.arange(v, dtype=jnp.int32)
    words = jnp.take(mask, idx // 32, axis=1)  # [B, V]
    allowed = (jax.lax.shift_right_logical(words, jnp.broadcast_to(idx % 32, words.shape)) & 1) != 0
    return jnp.where(allowed, logits, -jnp.inf)


def sample_masked(logits: Array, mask: Array, temperature: Array, top_k: Array, top_p: Array, seed_lo: Array,
                  seed_hi: Array, step: Array, want_top: Array) -> SampleResult:
    """:func:`sample` over only the tokens each row's mask allows. Jit-friendly."""
    return sample(apply_mask(logits.astype(jnp.float32), mask), temperature, top_k, top_p, seed_lo, seed_hi, step,
                  want_top)


# The dtypes of inference.penalties.AdjustBatch.arrays(): ids, count, seen, bias [B, W]; presence,
# frequency, repetition [B].
ADJUST_DTYPES = (jnp.int32, jnp.float32, jnp.float32, jnp.float32, jnp.float32, jnp.float32, jnp.float32)


def adjust_logits(logits: Array, ids: Array, count: Array, seen: Array, bias: Array, presence: Array,
                  frequency: Array, repetition: Array) -> Array:
    """``logits`` [B,V] float32 with each row's bias, ``min_tokens`` ban, repetition, frequency and
    presence penalties applied (in that order; :mod:`inference.penalties`). A row whose ``-inf`` biases
    (the end tokens before ``min_tokens``) would leave nothing finite keeps those tokens."""
    b, v = logits.shape
    rows = jnp.arange(b, dtype=jnp.int32)[:, None]
    zeros = jnp.zeros((b, v), jnp.float32)
    hard = jnp.isneginf(bias)
    counts = zeros.at[rows, ids].add(count)
    seen_v = zeros.at[rows, ids].max(seen)
    soft = logits + zeros.at[rows, ids].add(jnp.where(hard, 0.0, bias))
    banned = soft + zeros.at[rows, ids].add(jnp.where(hard, -jnp.inf, 0.0))
    out = jnp.where(jnp.any(banned > -jnp.inf, axis=-1, keepdims=True), banned, soft)
    rep = repetition[:, None]
    out = jnp.where(seen_v > 0, jnp.where(out > 0, out / rep, out * rep), out)
    return out - frequency[:, None] * counts - presence[:, None] * (counts > 0).astype(jnp.float32)


def sample_adjusted(logits: Array, ids: Array, count: Array, seen: Array, bias: Array, presence: Array,
                    frequency: Array, repetition: Array, temperature: Array, top_k: Array, top_p: Array,
                    seed_lo: Array, seed_hi: Array, step: Array, want_top: Array) -> SampleResult:
    """:func:`sample` of the adjusted logits (:func:`adjust_logits`). Jit-friendly."""
    adjusted = adjust_logits(logits.astype(jnp.float32), ids, count, seen, bias, presence, frequency, repetition)
    return sample(adjusted, temperature, top_k, top_p, seed_lo, seed_hi, step, want_top)


def sample_masked_adjusted(logits: Array, mask: Array, ids: Array, count: Array, seen: Array, bias: Array,
                           presence: Array, frequency: Array, repetition: Array, temperature: Array, top_k: Array,
                           top_p: Array, seed_lo: Array, seed_hi: Array, step: Array,
                           want_top: Array) -> SampleResult:
    """A grammar's mask, then the adjustments, then :func:`sample`. Jit-friendly."""
    masked = apply_mask(logits.astype(jnp.float32), mask)
    return sample_adjusted(masked, ids, count, seen, bias, presence, frequency, repetition, temperature, top_k,
                           top_p, seed_lo, seed_hi, step, want_top)
