"""Shape buckets: the bounded set of shapes the runner compiles.

Every call is padded up to a bucket, so the grid trades padded work against
compiles (warmup compiles every bucket). Sizes follow a geometric grid
(:func:`geometric_sizes`): powers of two up to a base, then
``steps_per_octave`` evenly spaced sizes per octave, each a multiple of
``ROW_ALIGN`` (8). With 2 per octave from 16: 16, 24, 32, 48, 64, 96, ...;
with 4 per octave from 8: 8, 16, 24, 32, 40, 48, 56, 64, 80, ... Where an
octave's step ``p / steps_per_octave`` is at least 8, a bucket is under
``1 + 1/steps_per_octave`` times what it holds (powers of two: under 2x).
The grid stops at the maximum, which is always a bucket itself (a
``max_model_len`` of 1000 has a 1000 bucket, not a 1024 one).

Why multiples of 8: on XLA:CPU the projections of a decode step or a short
prefill (the multiply-reduce of ``llama._matmul_t``) run slower at other row
counts than at the next multiple of 8. Bench model
(``tests/bench/bench_decode.py``), quiet machine, a whole decode step: 9-15
rows 15.2-16.9 ms against 13.1-14.5 ms at 16, 26-30 rows 24-26 ms against
21.8-22.5 at 32; a 28-token prefill 18.8 ms against 15.6 at 32. So no decode
bucket lies between 8 and 16.

Decode compiles once per batch bucket: powers of two up to 8, then
``decode_steps_per_octave``; context length is not part of the shape because
attention loops over the actual context at run time. Prefill compiles once
per (batch, tokens) bucket: tokens on the grid from ``min_prefill_len`` with
``prefill_steps_per_octave``, batch a power of two up to
``max_prefill_batch``, and ``batch * tokens <= max_prefill_tokens`` (batch 1
is always allowed, so any prompt up to ``max_model_len`` fits).

The defaults, on the decode bench's batch-32 run (prompts of 16-128 tokens,
the batch shrinking from 32 as requests finish; best of 3): powers of two
3.24 s, 2 prefill sizes per octave 3.17 s (prompt tokens padded 24% -> 15%;
steps of 17-24 rows run at 24) for 20 shapes instead of 14, warmup 11.6 ->
15.9 s. Decode at 10, 12, 14, 20 and 28 as well (no alignment): 3.25 s for
25. Since the projections run the native packed matmul (prefill is ~35% of
that run and compute-bound), 4 prefill sizes per octave: prefill 0.96 ->
0.91 s, the run 2.75-2.76 -> 2.65-2.69 s, for 46 shapes instead of 30 with
the worker's prefill pairs; the worker's tiny model at --max-batch 8
compiles 51 (31 at 2 per octave) and still answers its first request in
~24 s (tests/inference/test_worker.py).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

__all__ = ["DECODE_GRID_BASE", "ROW_ALIGN", "pow2_ceil", "geometric_sizes", "Buckets"]

DECODE_GRID_BASE = 8  # decode batches are powers of two up to here, then the finer grid
ROW_ALIGN = 8  # grid sizes (batches, prompt lengths) are multiples of this: see the module docstring


def pow2_ceil(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def geometric_sizes(lo: int, hi: int, steps_per_octave: int, base: int, align: int = 1) -> tuple[int, ...]:
    """Sizes from ``pow2_ceil(lo)`` up to exactly ``hi`` (``hi`` alone if that is smaller).

    Powers of two below ``base``; from there each octave ``[p, 2p)`` in steps of
    ``max(p // steps_per_octave, align)``. ``steps_per_octave`` and ``align`` are powers of
    two, so from ``max(base, align)`` on every size but ``hi`` is a multiple of ``align``.
    """
    if not 1 <= lo <= hi:
        raise ValueError(f"need 1 <= lo <= hi, got {lo}, {hi}")
    if pow2_ceil(steps_per_octave) != steps_per_octave or pow2_ceil(align) != align:
        raise ValueError(f"steps_per_octave and align must be powers of two, got {steps_per_octave}, {align}")
    out: list[int] = []
    p = pow2_ceil(lo)
    while p < hi:
        out += range(p, min(2 * p, hi), p if p < base else max(p // steps_per_octave, align))
        p *= 2
    return (*out, hi)


def _bucket(sizes: tuple[int, ...], n: int) -> int:
    """The smallest size >= n (n must be at most the last)."""
    return sizes[bisect_left(sizes, n)]


@dataclass(frozen=True, slots=True)
class Buckets:
    """The shapes a runner compiles for its limits, and the bucket each call is padded to."""

    max_batch: int
    max_model_len: int
    min_prefill_len: int = 16
    max_prefill_batch: int = 1
    max_prefill_tokens: int = 2048
    max_chunk: int = 0  # the engine's step_tokens: prefill groups up to this many tokens a row also run mixed
    # the defaults' measurements: the module docstring
    prefill_steps_per_octave: int = 4
    decode_steps_per_octave: int = 4

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_model_len < 1:
            raise ValueError("max_batch and max_model_len must be >= 1")
        for s in (self.prefill_steps_per_octave, self.decode_steps_per_octave):
            if s < 1 or pow2_ceil(s) != s:
                raise ValueError(f"steps per octave must be a power of two, got {s}")

    @property
    def decode_batches(self) -> tuple[int, ...]:
        return geometric_sizes(1, self.max_batch, self.decode_steps_per_octave, DECODE_GRID_BASE, ROW_ALIGN)

    @property
    def prefill_lengths(self) -> tuple[int, ...]:
        lo = min(self.min_prefill_len, self.max_model_len)
        return geometric_sizes(lo, self.max_model_len, self.prefill_steps_per_octave, lo, ROW_ALIGN)

    @property
    def prefill_batches(self) -> tuple[int, ...]:
        """Powers of two up to ``min(max_prefill_batch, max_batch)`` (a call never carries more)."""
        cap = min(self.max_prefill_batch, self.max_batch)
        return tuple(1 << i for i in range(cap.bit_length()))

    @property
    def prefill_shapes(self) -> tuple[tuple[int, int], ...]:
        """Every (batch, tokens) prefill bucket."""
        return tuple((b, t) for t in self.prefill_lengths for b in self.prefill_batches
                     if b == 1 or b * t <= self.max_prefill_tokens)

    @property
    def mixed_lengths(self) -> tuple[int, ...]:
        """Chunk lengths a mixed pass compiles for: powers of two (and the top) up to the bucket of
        ``max_chunk`` (none when chunking is off). Coarser than the prefill grid: each length is a
        shape per prefill batch, and the chunks of a long prompt, the ones that matter, are ``max_chunk``
        less a few decodes, which the top bucket holds with little padding."""
        top = self._chunk_bucket
        return tuple(sorted({min(pow2_ceil(t), top) for t in self.prefill_lengths if t <= top}))

    @property
    def mixed_shapes(self) -> tuple[tuple[int, int], ...]:
        """The (batch, tokens) shapes of the mixed pass: the decodes (padded to the largest decode bucket,
        which the native matmul and attention skip and an accelerator reads the weights once for)
        with a step's first prefill group of chunks."""
        return tuple((b, t) for t in self.mixed_lengths for b in self.prefill_batches
                     if b == 1 or b * t <= self.max_prefill_tokens)

    @property
    def _chunk_bucket(self) -> int:
        """The prefill length bucket a chunk of ``max_chunk`` tokens is padded to (0: chunking off)."""
        return _bucket(self.prefill_lengths, min(self.max_chunk, self.max_model_len)) if self.max_chunk > 0 else 0

    def mixed_shape(self, decodes: int, b: int, t: int) -> tuple[int, int] | None:
        """The mixed pass for ``decodes`` decode rows and a ``(b, t)`` prefill group, or None (not mixed)."""
        if decodes > self.max_batch or t > self._chunk_bucket:
            return None
        shape = (b, _bucket(self.mixed_lengths, t))
        return shape if shape in self.mixed_shapes else None

    @property
    def sample_batches(self) -> tuple[int, ...]:
        """The sampler's one shape: a prefill group's logits padded to the largest prefill batch.

        (A decode group samples inside its own step, so it needs no sampler shape of its own.)
        """
        return self.prefill_batches[-1:]

    def sample_rows(self, n: int) -> int:
        """Rows the sampler runs for a prefill group of ``n``."""
        return _bucket(self.sample_batches, n)

    @property
    def num_shapes(self) -> int:
        return len(self.decode_batches) + len(self.prefill_shapes) + len(self.mixed_shapes) + len(self.sample_batches)

    def decode_batch(self, n: int) -> int:
        """The decode bucket for ``n`` sequences: the smallest batch bucket >= n."""
        if not 1 <= n <= self.max_batch:
            raise ValueError(f"decode batch of {n} outside 1..{self.max_batch}")
        return _bucket(self.decode_batches, n)

    def prefill_shape(self, n: int, longest: int) -> tuple[int, int]:
        """The bucket for ``n`` prefills whose longest new-token run is ``longest``."""
        if longest > self.max_model_len:
            raise ValueError(f"prefill of {longest} tokens exceeds max_model_len {self.max_model_len}")
        if not 1 <= n <= self.prefill_batches[-1]:
            raise ValueError(f"no prefill bucket for {n} sequences of up to {longest} tokens")
        b, t = pow2_ceil(n), _bucket(self.prefill_lengths, longest)
        if b > 1 and b * t > self.max_prefill_tokens:
            raise ValueError(f"no prefill bucket for {n} sequences of up to {longest} tokens")
        return b, t

    def group_prefills(self, lengths: list[int]) -> list[list[int]]:
        """Split prefills (by new-token count) into groups that each fit one bucket.

        Shorter prompts are grouped together so padding stays small; returns
        lists of indices into ``lengths``.
        """
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        groups: list[list[int]] = []
        cur: list[int] = []
        for i in order:
            cand = cur + [i]
            # a prompt past max_model_len groups like one at it; prefill_shape rejects the group
            t = _bucket(self.prefill_lengths, min(lengths[i], self.max_model_len))
            b = pow2_ceil(len(cand))
            fits = b <= self.prefill_batches[-1] and (b == 1 or b * t <= self.max_prefill_tokens)
            if cur and not fits:
                groups.append(cur)
                cand = [i]
            cur = cand
        if cur:
            groups.append(cur)
        return groups
