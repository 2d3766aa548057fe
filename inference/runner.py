"""The contract between the scheduler (``inference.engine``, pure Python, no JAX)
and whatever executes a step (``inference.model.jax_runner.JaxRunner`` for a
real model, ``inference.synthetic.SyntheticRunner`` for the test/benchmark
engine). The one module named ``runner``: the protocol, its plan and outputs.

The scheduler owns the paged KV cache *bookkeeping* (``inference.kv_cache``:
which physical blocks a sequence uses); the runner owns the KV *arrays*,
indexed by those physical block ids. Each step the scheduler hands the runner
a :class:`StepPlan`; the runner writes the new tokens' K/V into the given
blocks, computes logits for the last position of each sequence, samples, and
returns one :class:`SeqOutput` per sequence, in plan order.

KV layout (runner side, per layer): ``k``/``v`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``; position ``p`` of a
sequence lives in block ``block_table[p // block_size]`` at slot
``p % block_size``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from transport.messages import SamplingParams

if TYPE_CHECKING:
    from .grammar import Guide
    from .penalties import LogitAdjust

__all__ = ["SeqWork", "StepPlan", "SeqFault", "SeqOutput", "ModelRunner"]


# SeqWork, SeqOutput (and the engine's Delta) are built once per sequence per step: plain slotted
# dataclasses, not frozen ones, whose __init__ costs ~4x (object.__setattr__ per field). Treat them
# as values all the same: nothing mutates one after it is built.
@dataclass(slots=True)
class SeqWork:
    """One sequence's work in a step.

    ``token_ids`` are the tokens to run now: the uncached part of the prompt
    for a prefill (positions ``start_pos .. start_pos+len-1``), or the single
    last sampled token for a decode. ``block_table`` covers every position up
    to ``start_pos + len(token_ids) - 1``. ``num_generated`` is how many tokens
    this request has sampled so far (the step index for seeded sampling, so
    the same seed gives the same output whatever the batch).
    """

    seq_id: int
    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    params: SamplingParams
    seed: int  # the request's seed, or one the engine drew for it
    num_generated: int
    # Structured output: where this sequence stands in its grammar (inference.grammar.Guide), whose
    # mask the runner applies when it samples; None (nearly always): nothing to mask.
    guide: Guide | None = None
    # Penalties, logit_bias, min_tokens (inference.penalties): the sequence's table, read when it samples;
    # None (nearly always): the plain sampler.
    adjust: LogitAdjust | None = None
    # Leading ``token_ids`` whose K/V a shared block already holds (a wholly cached, block-aligned prompt: its
    # last token runs again for its logits): computed, their K/V not written. 0 (nearly always): all written.
    shared_tokens: int = 0


@dataclass(frozen=True, slots=True)
class StepPlan:
    prefills: tuple[SeqWork, ...]
    decodes: tuple[SeqWork, ...]

    @property
    def size(self) -> int:
        return len(self.prefills) + len(self.decodes)


@dataclass(frozen=True, slots=True)
class SeqFault:
    """What a runner returns in place of a token for one sequence that failed while the rest of
    its step ran. (A runner whose whole step fails raises instead: the worker then ends every
    request with an INTERNAL error.)

    ``hang`` False: the request ends with an INTERNAL error carrying ``message``. True: the
    sequence stops where it is, keeping its batch slot and KV blocks, with no token and no end,
    until it is cancelled, passes its deadline or the worker stops. The synthetic engine's
    injected faults are the only source today (``inference.synthetic``)."""

    message: str
    hang: bool = False


@dataclass(slots=True)
class SeqOutput:
    seq_id: int
    token_id: int
    logprob: float  # log-softmax of the sampled token (always computed)
    top_ids: tuple[int, ...] = ()  # params.top_logprobs alternatives
    top_logprobs: tuple[float, ...] = ()
    fault: SeqFault | None = None  # set: no token was sampled for this sequence (token_id is ignored)


class ModelRunner(Protocol):
    block_size: int
    num_blocks: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None  # the model's (a query sees its last this many keys): the KV cache frees the rest

    def execute(self, plan: StepPlan) -> list[SeqOutput]:
        """Run prefills then decodes; one output per SeqWork, prefills first."""
        ...
