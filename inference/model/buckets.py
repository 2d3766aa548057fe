"""Shape buckets: the bounded set of shapes the runner compiles.

Decode compiles once per batch bucket (powers of two up to ``max_batch``);
context length is not part of the shape because attention loops over the
actual context at run time. Prefill compiles once per (batch, tokens)
bucket with both powers of two and ``batch * tokens <= max_prefill_tokens``
(batch 1 is always allowed, so any prompt up to ``max_model_len`` fits).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["pow2_ceil", "pow2_range", "Buckets"]


def pow2_ceil(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def pow2_range(lo: int, hi: int) -> tuple[int, ...]:
    """Powers of two from pow2_ceil(lo) up to the first one >= hi."""
    out = [pow2_ceil(lo)]
    while out[-1] < hi:
        out.append(out[-1] * 2)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Buckets:
    max_batch: int
    max_model_len: int
    min_prefill_len: int = 16
    max_prefill_batch: int = 1
    max_prefill_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_model_len < 1:
            raise ValueError("max_batch and max_model_len must be >= 1")

    @property
    def decode_batches(self) -> tuple[int, ...]:
        return pow2_range(1, self.max_batch)

    @property
    def prefill_lengths(self) -> tuple[int, ...]:
        return pow2_range(min(self.min_prefill_len, self.max_model_len), self.max_model_len)

    @property
    def prefill_shapes(self) -> tuple[tuple[int, int], ...]:
        """Every (batch, tokens) prefill bucket."""
        out = []
        for t in self.prefill_lengths:
            for b in pow2_range(1, min(self.max_prefill_batch, self.max_batch)):
                if b == 1 or b * t <= self.max_prefill_tokens:
                    out.append((b, t))
        return tuple(out)

    @property
    def sample_batches(self) -> tuple[int, ...]:
        """Sampling shapes: logits are padded to 8 rows or to the largest batch (two compiles)."""
        top = self.decode_batches[-1]
        return tuple(sorted({min(8, top), top}))

    def sample_rows(self, n: int) -> int:
        """Rows the sampler runs for a batch bucket of ``n``."""
        return next(s for s in self.sample_batches if s >= n)

    @property
    def num_shapes(self) -> int:
        return len(self.decode_batches) + len(self.prefill_shapes) + len(self.sample_batches)

    def decode_batch(self, n: int) -> int:
        if not 1 <= n <= self.max_batch:
            raise ValueError(f"decode batch of {n} outside 1..{self.max_batch}")
        return pow2_ceil(n)

    def prefill_shape(self, n: int, longest: int) -> tuple[int, int]:
        """The bucket for ``n`` prefills whose longest new-token run is ``longest``."""
        if longest > self.max_model_len:
            raise ValueError(f"prefill of {longest} tokens exceeds max_model_len {self.max_model_len}")
        t = max(pow2_ceil(longest), self.prefill_lengths[0])
        b = pow2_ceil(n)
        if (b, t) not in self.prefill_shapes:
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
            t = max(pow2_ceil(lengths[i]), self.prefill_lengths[0])
            b = pow2_ceil(len(cand))
            fits = b <= min(self.max_prefill_batch, self.max_batch) and (b == 1 or b * t <= self.max_prefill_tokens)
            if cur and not fits:
                groups.append(cur)
                cand = [i]
            cur = cand
        if cur:
            groups.append(cur)
        return groups
