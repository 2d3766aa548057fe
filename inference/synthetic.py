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
No JAX import.

Worker options (``quicserve worker --synthetic-step-ms 5``, ``[workers]`` keys,
``quicserve serve --worker-option=synthetic_step_ms=5``; defaults and checks in
:mod:`transport.common.worker_options`). At their defaults a step takes no time and
nothing fails.

Cost model (:class:`SyntheticCost`): each step sleeps ::

    synthetic_slowdown * (synthetic_step_ms
                          + synthetic_step_ms_per_seq * sequences in the step
                          + synthetic_prefill_us_per_token * prompt tokens it prefills)

Prompt tokens the prefix cache holds are not prefilled: the engine's own
prefix cache (:mod:`inference.kv_cache`: full blocks of ``block_size`` tokens
named by :mod:`transport.common.prefix`'s hash chain, LRU-evicted) hands the runner
only the uncached rest. Its capacity is the KV cache, ``num_blocks`` (8 bytes a
token here, so set it freely). So a request's TTFT is its queueing plus one
step whose prefill term is ``uncached prompt tokens * prefill cost``, and its
usage reports the cached part (``prompt_tokens_details.cached_tokens``). Being
the engine's own cache, it publishes the same KV events as a model's
(:mod:`inference.kv_events`), so a gateway routing by cache sees it exactly.

Faults (:class:`SyntheticFaults`), drawn from ``synthetic_fault_seed`` by a
counter-based hash of the sequence id (engine arrival order) or the step
number, so one seed and one arrival order give the same faults whatever the
batching:

- ``synthetic_error_rate``: share of requests that end with an INTERNAL error
  (``synthetic fault: ...``) once they have streamed ``synthetic_error_after``
  tokens (a request that finishes sooner finishes normally);
- ``synthetic_hang_rate``: share of requests that stop at that point: no
  token, no end, holding their batch slot, until cancelled (or past their
  deadline);
- ``synthetic_step_fail_rate``: share of steps that raise, as a failing model
  call does; the worker's loop (:mod:`inference.service`) then ends every
  request it holds with INTERNAL ``engine step failed: ...``, as for any runner;
- ``synthetic_slowdown``: factor on every modelled time.

Sampling settings it has no logits for (#31): it has no distribution to penalise, so presence,
frequency and repetition penalties change nothing here; it honours what decides a token outright --
``logit_bias`` +100 forces that token (the smallest such id), -100 bans one, and ``min_tokens`` bans
the end tokens (stop token ids; it never samples eos) until that many were generated, a banned draw
moving to the next printable byte. A structured output's grammar still has the last word.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .runner import SeqFault, SeqOutput, SeqWork, StepPlan
from .tasks import PromptResult

if TYPE_CHECKING:
    from .grammar import Guide

__all__ = ["SyntheticRunner", "SyntheticCost", "SyntheticFaults", "SyntheticStepFailure", "expected_token"]

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


@dataclass(frozen=True, slots=True)
class SyntheticCost:
    """The modelled time of a step, in seconds (see the module docstring)."""

    step_s: float = 0.0
    per_seq_s: float = 0.0
    prefill_token_s: float = 0.0
    slowdown: float = 1.0

    @classmethod
    def from_options(cls, o: Any) -> SyntheticCost:
        """From the ``synthetic_*`` worker options (a WorkerOptions or the worker's parsed flags)."""
        return cls(o.synthetic_step_ms / 1e3, o.synthetic_step_ms_per_seq / 1e3,
                   o.synthetic_prefill_us_per_token / 1e6, o.synthetic_slowdown)  # fmt: skip

    @property
    def free(self) -> bool:
        """Every step takes no time (the worker then runs steps on its loop, not a thread)."""
        return self.step_s == self.per_seq_s == self.prefill_token_s == 0

    def seconds(self, sequences: int, prefill_tokens: int) -> float:
        return self.slowdown * (self.step_s + self.per_seq_s * sequences + self.prefill_token_s * prefill_tokens)


class SyntheticStepFailure(RuntimeError):
    """An injected failure of a whole step (``synthetic_step_fail_rate``)."""


_ERROR_SALT, _STEP_SALT = 1, 2


def _uniform(*vals: int) -> float:
    """A draw in [0, 1) that depends only on ``vals``."""
    return _mix(*vals) / 2.0**64


@dataclass(frozen=True, slots=True)
class SyntheticFaults:
    """Which requests and steps fail (see the module docstring); the default injects nothing."""

    error_rate: float = 0.0
    hang_rate: float = 0.0
    error_after: int = 0
    step_fail_rate: float = 0.0
    seed: int = 0

    @classmethod
    def from_options(cls, o: Any) -> SyntheticFaults:
        """From the ``synthetic_*`` worker options (a WorkerOptions or the worker's parsed flags)."""
        return cls(o.synthetic_error_rate, o.synthetic_hang_rate, o.synthetic_error_after,
                   o.synthetic_step_fail_rate, o.synthetic_fault_seed)  # fmt: skip

    @property
    def per_request(self) -> bool:
        return self.error_rate > 0 or self.hang_rate > 0

    def request_fault(self, seq_id: int) -> SeqFault | None:
        """The fault sequence ``seq_id`` meets once it has ``error_after`` tokens, if any."""
        u = _uniform(self.seed, _ERROR_SALT, seq_id)
        if u < self.error_rate:
            return SeqFault(f"synthetic fault: injected error after {self.error_after} tokens "
                            f"(synthetic_error_rate={self.error_rate:g})")  # fmt: skip
        if u < self.error_rate + self.hang_rate:
            return SeqFault("synthetic fault: injected hang", hang=True)
        return None

    def step_fails(self, step: int) -> bool:
        """Whether step number ``step`` (0, 1, ... in the runner's order) fails."""
        return self.step_fail_rate > 0 and _uniform(self.seed, _STEP_SALT, step) < self.step_fail_rate


class SyntheticRunner:
    """Implements :class:`inference.runner.ModelRunner` without a model."""

    def __init__(
        self,
        *,
        block_size: int = 16,
        num_blocks: int = 1024,
        max_model_len: int = 4096,
        eos_token_ids: tuple[int, ...] = (257,),
        sleep: Callable[[float], None] = time.sleep,
        verify: bool = True,
        cost: SyntheticCost | None = None,
        faults: SyntheticFaults | None = None,
    ) -> None:
        """``verify`` re-reads every sequence's whole context through its block
        table each step (tests); without it a decode extends the sequence's
        running checksum and only prefills read the cache back (same tokens,
        much cheaper — for the worker and benchmarks). ``sleep`` is how a
        step spends its modelled ``cost`` (a fake clock's advance, in tests)."""
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.sliding_window: int | None = None
        self.cost = cost if cost is not None else SyntheticCost()
        self.faults = faults if faults is not None else SyntheticFaults()
        self._sleep = sleep
        self._kv = np.full((num_blocks, block_size), -1, dtype=np.int64)
        self._w = _weights(max_model_len)
        self._w_list = self._w.tolist()
        self.verify = verify
        self._digests: dict[int, tuple[int, int]] = {}  # seq_id -> (positions, checksum)
        self.steps = 0  # executed, failed ones included
        self.prefill_tokens = 0

    def execute(self, plan: StepPlan) -> list[SeqOutput]:
        step = self.steps
        self.steps += 1
        prefill_tokens = sum(len(w.token_ids) for w in plan.prefills)
        self.prefill_tokens += prefill_tokens
        seconds = self.cost.seconds(plan.size, prefill_tokens)
        if seconds > 0:
            self._sleep(seconds)
        faults = self.faults
        if faults.step_fails(step):
            raise SyntheticStepFailure(f"synthetic fault: step {step} failed "
                                       f"(synthetic_step_fail_rate={faults.step_fail_rate:g})")  # fmt: skip
        works = plan.prefills + plan.decodes
        if faults.per_request:
            return [self._faulted(w) or self._run(w) for w in works]
        return [self._run(w) for w in works]

    def _faulted(self, w: SeqWork) -> SeqOutput | None:
        if w.num_generated < self.faults.error_after:
            return None
        fault = self.faults.request_fault(w.seq_id)
        return None if fault is None else SeqOutput(w.seq_id, 0, 0.0, fault=fault)

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
        if w.adjust is not None:  # logit_bias +-100 and min_tokens (the module docstring)
            forced, banned = w.adjust.decided(w.num_generated)
            tok = forced if forced is not None else tok
            for _ in range(95):  # the next printable byte not banned (every one banned: the last tried)
                if tok not in banned:
                    break
                tok = 32 + (tok - 31) % 95
        if w.guide is not None:  # structured output: the same token if the grammar allows it, else one it does
            tok = _allowed(w.guide, tok, digest)
        lp = -(((digest ^ tok) % 1000) / 1000.0) - 0.01
        k = w.params.top_logprobs
        top_ids = tuple(32 + (tok - 32 + i) % 95 for i in range(k))
        top_lps = tuple(lp - i for i in range(k))
        return SeqOutput(w.seq_id, tok, lp, top_ids, top_lps)


    hidden_size = 32  # of its made-up hidden states (prompt_pass)

    def prepare_prompt_pass(self, length: int, logprobs: bool) -> None:
        """Nothing to compile."""

    def prompt_pass(self, ids: Sequence[int], logprobs: bool) -> PromptResult:
        """Made-up hidden states and prompt logprobs, a pure function of the prompt (no model): row t
        is a unit vector drawn from the seed (ids[t], t); position t's token is its own top
        alternative, with logprob -(hash mod 1000)/1000 - 0.01; the first position has none."""
        if not 0 < len(ids) <= self.max_model_len:
            raise ValueError(f"a prompt of {len(ids)} tokens (1..{self.max_model_len})")
        rows = [np.random.default_rng([int(t), i]).standard_normal(self.hidden_size) for i, t in enumerate(ids)]
        hidden = np.asarray([r / np.linalg.norm(r) for r in rows], np.float32)
        if not logprobs:
            return PromptResult(hidden)
        lps = np.asarray([-(_mix(int(t), i) % 1000) / 1000.0 - 0.01 for i, t in enumerate(ids)], np.float32)
        lps[0] = np.nan
        top_ids = (np.asarray(ids, np.int64)[:, None] + np.arange(20)[None, :]) % 256
        top_lps = lps[:, None] - np.arange(20, dtype=np.float32)[None, :]
        top_ids[0] = 0
        return PromptResult(hidden, lps, top_ids, top_lps)


def _allowed(guide: Guide, tok: int, digest: int) -> int:
    """``tok`` if the guide's mask allows it, else the allowed token the digest picks."""
    from .grammar import fill_masks, mask_words

    mask = np.zeros((1, mask_words(max(tok + 1, 258))), np.int32)
    fill_masks([(guide, 0)], mask)
    allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
    if not len(allowed) or tok in allowed:
        return tok
    return int(allowed[digest % len(allowed)])
