"""``SyntheticRunner``: a named test/benchmark double for the model runner.

It does no model compute but behaves like a paged-KV model where it matters
to the scheduler: every step it *writes* the new tokens into its own paged
"KV cache" (an int array ``[num_blocks, block_size]`` of token ids) through the
plan's block tables, then *reads the whole context back through the block
table* and derives the next token from a checksum of what it read, the
request's seed and ``num_generated``. So outputs are deterministic printable
bytes (32..126, for the byte-level tokenizer), the same seed and prompt give
the same text whatever the batch, and a scheduler or prefix-cache bug that
hands a sequence the wrong blocks changes the output (tests rely on this).
An optional per-step sleep imitates model latency. No JAX import.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from .runner import SeqOutput, SeqWork, StepPlan

__all__ = ["SyntheticRunner", "expected_token"]

_MASK = (1 << 64) - 1


def _mix(*vals: int) -> int:
    """splitmix64 over the values (stable across runs and processes)."""
    x = 0x9E3779B97F4A7C15
    for v in vals:
        x = (x ^ (v & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        x ^= x >> 31
        x = x * 0x94D049BB133111EB & _MASK
        x ^= x >> 29
    return x


def _weights(n: int) -> np.ndarray:
    return np.random.default_rng(12345).integers(1, 1 << 20, size=n, dtype=np.int64)


def expected_token(context: list[int], seed: int, num_generated: int, temperature: float = 1.0) -> int:
    """The token a SyntheticRunner samples after ``context`` (for tests)."""
    digest = int(np.dot(np.asarray(context, dtype=np.int64), _weights(len(context))))
    return _token(digest, seed, num_generated, temperature)


def _token(digest: int, seed: int, num_generated: int, temperature: float) -> int:
    s = 0 if temperature == 0 else seed  # greedy ignores the seed
    return 32 + _mix(digest, s, num_generated) % 95


class SyntheticRunner:
    """Implements :class:`inference.runner.ModelRunner` without a model."""

    def __init__(
        self,
        *,
        block_size: int = 16,
        num_blocks: int = 1024,
        max_model_len: int = 4096,
        step_s: float = 0.0,
        eos_token_ids: tuple[int, ...] = (257,),
        sleep: Callable[[float], None] = time.sleep,
        verify: bool = True,
    ) -> None:
        """``verify`` re-reads every sequence's whole context through its block
        table each step (tests); without it a decode extends the sequence's
        running checksum and only prefills read the cache back (same tokens,
        much cheaper — for the worker and benchmarks)."""
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.step_s = step_s
        self._sleep = sleep
        self._kv = np.full((num_blocks, block_size), -1, dtype=np.int64)
        self._w = _weights(max_model_len)
        self._w_list = self._w.tolist()
        self.verify = verify
        self._digests: dict[int, tuple[int, int]] = {}  # seq_id -> (positions, checksum)
        self.steps = 0
        self.prefill_tokens = 0

    def execute(self, plan: StepPlan) -> list[SeqOutput]:
        outs = [self._run(w) for w in plan.prefills]
        outs += [self._run(w) for w in plan.decodes]
        self.steps += 1
        self.prefill_tokens += sum(len(w.token_ids) for w in plan.prefills)
        if self.step_s > 0:
            self._sleep(self.step_s)
        return outs

    def _run(self, w: SeqWork) -> SeqOutput:
        bs = self.block_size
        n = w.start_pos + len(w.token_ids)
        table = w.block_table
        if n > self.max_model_len or len(table) * bs < n or not w.token_ids:
            raise ValueError(f"seq {w.seq_id}: block table of {len(table)} blocks cannot hold {n} positions")
        kv = self._kv
        for i, t in enumerate(w.token_ids):
            p = w.start_pos + i
            b = table[p // bs]
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"seq {w.seq_id}: block id {b} out of range")
            kv[b, p % bs] = t
        prev = self._digests.get(w.seq_id)
        if not self.verify and prev is not None and prev[0] == w.start_pos and len(w.token_ids) == 1:
            digest = prev[1] + w.token_ids[0] * self._w_list[w.start_pos]
        else:
            blocks = np.asarray(table[: -(-n // bs)], dtype=np.int64)
            if blocks.min() < 0 or blocks.max() >= self.num_blocks:
                raise ValueError(f"seq {w.seq_id}: block id out of range")
            ctx = kv[blocks].reshape(-1)[:n]
            if (ctx < 0).any():
                raise ValueError(f"seq {w.seq_id}: reads a KV slot nobody wrote")
            digest = int(np.dot(ctx, self._w[:n]))
        if len(self._digests) > 65536:  # forget the oldest half (finished sequences)
            for k in list(self._digests)[:32768]:
                del self._digests[k]
        self._digests[w.seq_id] = (n, digest)
        tok = _token(digest, w.seed, w.num_generated, w.params.temperature)
        lp = -(((digest ^ tok) % 1000) / 1000.0) - 0.01
        k = w.params.top_logprobs
        top_ids = tuple(32 + (tok - 32 + i) % 95 for i in range(k))
        top_lps = tuple(lp - i for i in range(k))
        return SeqOutput(w.seq_id, tok, lp, top_ids, top_lps)
