"""A sequence's logit adjustments (#31): presence, frequency and repetition penalties, ``logit_bias``
and ``min_tokens``, kept on the host as a small sparse table per sequence (no JAX here: the synthetic
engine reads it too; the device side is :func:`inference.sampling.adjust_logits`).

What each one does, in the order the sampler applies them (vLLM's order):

1. ``logit_bias``: ``bias`` added to the logit of each listed token id; and ``min_tokens``: while fewer
   than that many tokens were generated, the end tokens (eos unless ``ignore_eos``, and
   ``stop_token_ids``) get ``-inf``. Stop *strings* still end a request (vLLM: "before EOS or
   stop_token_ids can be generated"). Should that leave a row nothing to sample (a grammar that
   allows only the end), its end tokens are allowed again: a finished grammar ends its request.
2. ``repetition_penalty`` r (the CTRL paper's, as Hugging Face applies it): every token that appears
   in the prompt or the output so far has its logit divided by r when positive, multiplied by r when
   negative (r = 1: off).
3. ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI's): ``logit -= f * c + p * (c > 0)`` with
   ``c`` the token's count among the *generated* tokens (the prompt does not count).

Why a sparse table kept incrementally on the host. The penalties need, per row, the counts of the
tokens seen so far. Three ways were weighed: (a) a dense ``[B, V]`` count array sent each step:
``B * V * 4`` bytes (32 rows of a 128k vocabulary: 16 MiB a step), too much to move; (b) the row's
whole context as a padded ``[B, L]`` id array bincounted on device (vLLM's way): each step copies
``L`` ids per row, a Python list -> array conversion of the whole context; (c) what is here: each
sequence folds every new token into a table of *distinct* tokens (id, generated count, seen) in
O(1) as it is accepted (amortised: numpy arrays that double), so a step copies slices of ``U <= L``
entries per row (no Python loop over the context) and the device scatters them into ``[B, V]`` only
in the sampling executable of a batch that has such a row. A batch without one runs the unchanged
sampler (:class:`~inference.runner.SeqWork.adjust` is None for every row), so it pays nothing.
The table's width is padded to a power of four (at least 64: few shapes to compile, each on first
use per row count, at most 4x the entries a row needs). Like a grammar's rows, an adjusted decode row
takes the model's logits out of its step and samples in the second executable, so the first such
request at each decode batch bucket also compiles that bucket's logits step (once per worker; the
persistent compilation cache keeps it across restarts).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np

from transport.messages import SamplingParams

__all__ = ["LogitAdjust", "AdjustBatch", "MIN_WIDTH", "needs_adjust"]

MIN_WIDTH = 64
_EMPTY_I = np.zeros(0, np.int32)
_EMPTY_F = np.zeros(0, np.float32)


def needs_adjust(p: SamplingParams) -> bool:
    """Whether a request sets any of the adjustments (most do not: then no state at all)."""
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 or p.logit_bias
                or p.min_tokens)


class LogitAdjust:
    """One sequence's adjustment state. The engine's :class:`~inference.sequence.Sequence` folds in each
    token it accepts (:meth:`fold`); a runner reads :meth:`entries` for the step's row."""

    __slots__ = ("presence", "frequency", "repetition", "min_tokens", "_bias_ids", "_bias", "_stop_ids",
                 "_ids", "_count", "_seen", "_slot", "_n", "_folded", "_prompt_len", "_track")

    def __init__(self, params: SamplingParams, prompt_len: int, stop_ids: Seq[int]) -> None:
        self.presence = float(params.presence_penalty)
        self.frequency = float(params.frequency_penalty)
        self.repetition = float(params.repetition_penalty)
        self.min_tokens = int(params.min_tokens)
        bias = dict(params.logit_bias)  # a repeated id: the last value, as a JSON object would
        self._bias_ids = np.fromiter(bias.keys(), np.int32, len(bias))
        self._bias = np.fromiter(bias.values(), np.float32, len(bias))
        self._stop_ids = np.asarray(sorted(stop_ids), np.int32) if self.min_tokens else _EMPTY_I
        # The distinct tokens seen: id, count among the generated ones, 1.0 if the repetition penalty
        # applies to it (it appeared in the prompt or the output). Only kept when a penalty is on, and
        # the prompt's only for the repetition penalty.
        self._track = bool(self.presence or self.frequency or self.repetition != 1.0)
        self._ids = np.zeros(MIN_WIDTH, np.int32)
        self._count = np.zeros(MIN_WIDTH, np.float32)
        self._seen = np.zeros(MIN_WIDTH, np.float32)
        self._slot: dict[int, int] = {}
        self._n = 0
        self._folded = 0  # tokens of the sequence folded in so far
        self._prompt_len = prompt_len

    def fold(self, tokens: Seq[int]) -> None:
        """Take in ``tokens[already folded:]`` (the sequence's prompt, then each token as it is accepted)."""
        start = self._folded
        self._folded = len(tokens)
        if not self._track:
            return
        repetition = self.repetition != 1.0
        for pos in range(start, len(tokens)):
            generated = pos >= self._prompt_len
            if not generated and not repetition:
                continue
            tok = tokens[pos]
            i = self._slot.get(tok)
            if i is None:
                i = self._n
                if i == len(self._ids):
                    self._grow()
                self._slot[tok] = i
                self._n = i + 1
                self._ids[i] = tok
                self._seen[i] = 1.0 if repetition else 0.0
            if generated:
                self._count[i] += 1.0

    def _grow(self) -> None:
        n = len(self._ids)
        self._ids = np.concatenate([self._ids, np.zeros(n, np.int32)])
        self._count = np.concatenate([self._count, np.zeros(n, np.float32)])
        self._seen = np.concatenate([self._seen, np.zeros(n, np.float32)])

    def ending_banned(self, num_generated: int) -> bool:
        """Whether the end tokens are still forbidden (``min_tokens`` not reached)."""
        return num_generated < self.min_tokens and len(self._stop_ids) > 0

    def entries(self, num_generated: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """This step's sparse entries: token ids, generated counts, seen flags, biases (``-inf``: an end
        token before ``min_tokens``). An id may repeat: counts and biases add, flags take the maximum."""
        n = self._n
        ids, count, seen = self._ids[:n], self._count[:n], self._seen[:n]
        k = len(self._bias_ids)
        stops = self._stop_ids if self.ending_banned(num_generated) else _EMPTY_I
        if not k and not len(stops):
            return ids, count, seen, np.zeros(n, np.float32)
        extra = k + len(stops)
        zeros = np.zeros(extra, np.float32)
        bias = np.concatenate([np.zeros(n, np.float32), self._bias, np.full(len(stops), -np.inf, np.float32)])
        return np.concatenate([ids, self._bias_ids, stops]), np.concatenate([count, zeros]), \
            np.concatenate([seen, zeros]), bias

    def decided(self, num_generated: int) -> tuple[int | None, frozenset[int]]:
        """What a runner without logits honours (:mod:`inference.synthetic`): the token a bias of +100
        forces (the smallest such id), and the ids it must not sample (a bias of -100; the end tokens
        before ``min_tokens``)."""
        forced = [int(t) for t, b in zip(self._bias_ids, self._bias, strict=True) if b >= 100]
        banned = {int(t) for t, b in zip(self._bias_ids, self._bias, strict=True) if b <= -100}
        if self.ending_banned(num_generated):
            banned.update(int(t) for t in self._stop_ids)
        return (min(forced) if forced else None), frozenset(banned)


class AdjustBatch:
    """The sampler's adjustment arrays for ``rows`` rows (host numpy; rows without adjustments stay
    neutral: no entries, repetition 1)."""

    __slots__ = ("ids", "count", "seen", "bias", "presence", "frequency", "repetition")

    def __init__(self, rows: Seq[tuple[LogitAdjust | None, int]], size: int) -> None:
        """``rows``: (the row's adjustments or None, its num_generated), padded to ``size`` rows."""
        parts = [None if a is None else a.entries(n) for a, n in rows]
        longest = max((len(p[0]) for p in parts if p is not None), default=0)
        width = MIN_WIDTH
        while width < longest:
            width *= 4
        self.ids = np.zeros((size, width), np.int32)
        self.count = np.zeros((size, width), np.float32)
        self.seen = np.zeros((size, width), np.float32)
        self.bias = np.zeros((size, width), np.float32)
        self.presence = np.zeros(size, np.float32)
        self.frequency = np.zeros(size, np.float32)
        self.repetition = np.ones(size, np.float32)
        for r, ((a, _), p) in enumerate(zip(rows, parts, strict=True)):
            if a is None or p is None:
                continue
            m = len(p[0])
            self.ids[r, :m], self.count[r, :m], self.seen[r, :m], self.bias[r, :m] = p
            self.presence[r], self.frequency[r], self.repetition[r] = a.presence, a.frequency, a.repetition

    @property
    def width(self) -> int:
        return int(self.ids.shape[1])

    def arrays(self) -> tuple[np.ndarray, ...]:
        return (self.ids, self.count, self.seen, self.bias, self.presence, self.frequency, self.repetition)
