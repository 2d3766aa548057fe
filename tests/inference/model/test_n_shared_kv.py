"""n = 8 shares one prompt's KV on the JAX engine (the tiny model): the eight sequences of one prompt
use about the blocks of one, not eight times them.

The gateway runs ``n`` > 1 as sub-generations on one replica (gateway.api.fanout); the engine admits
the first, and the others wait for its prefill's blocks to be registered, then take them from the
prefix cache (``Engine._follows``): reference counts, no copy, no second prefill. What each follower
adds is the block holding the prompt's last token (a cache hit always leaves one token to compute:
its logits are the follower's first sample) and the blocks its own output fills. With block size
16, an L-token prompt and o output tokens, a follower owns the blocks covering positions
16 * floor((L - 1) / 16) .. L + o - 1: one for L = 1000, o = 8 (positions 992..1007), so n = 8 holds
63 + 7 * 1 = 70 blocks against 63 for n = 1: 1.11x. A block-aligned prompt (L = 1024) is wholly cached:
the follower shares every prompt block and runs its last token again for its logits without writing
its K/V (``SeqWork.shared_tokens``: the shared block holds the same token's K/V, and the attention reads
it there), so it owns only its output's blocks (1024..1031): 65 + 7 = 72 / 65 = 1.11x (1.22x before,
when it recomputed, into a block of its own, the whole last block).

Measured here: the peak of blocks in use over the whole run (``num_blocks - num_free``), n = 1 and
n = 8 in the same run, with the prefix cache off as the baseline that prefills eight times (its peak
is bounded by the prefill budget per step, which staggers the eight admissions); and the
followers' tokens equal those of the same seed run alone (shared KV gives the same answer). More lengths: tests/bench/bench_n_kv.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from inference.model.jax_runner import JaxRunner
from inference.runner import SeqWork, StepPlan
from tests.bench.bench_n_kv import long_runner, peak_blocks
from transport.messages import SamplingParams

jax = pytest.importorskip("jax")

L, OUT, BS = 1000, 8, 16
PROMPT = [(i * 37 + 11) % 250 + 1 for i in range(L)]


@pytest.fixture(scope="module")
def runner() -> JaxRunner:
    return JaxRunner.load("tiny", max_batch=8, num_blocks=640, max_model_len=1024, block_size=BS)


def _run(runner: JaxRunner, seeds: list[int], prefix_cache: bool = True) -> tuple[int, int, dict[int, list[int]]]:
    return peak_blocks(runner, PROMPT, OUT, seeds, prefix_cache)


def test_n8_holds_at_most_1_2x_the_blocks_of_n1(runner: JaxRunner) -> None:
    one, pre1, alone = _run(runner, [0])
    eight, pre8, col = _run(runner, list(range(8)))
    unshared, pre_off, _ = _run(runner, list(range(8)), prefix_cache=False)
    print(f"\nKV blocks in use at peak, {L}-token prompt, {OUT} tokens each: n=1 {one}, n=8 {eight} "
          f"({eight / one:.3f}x); prefix cache off: {unshared} ({unshared / one:.3f}x). Prompt tokens prefilled: "
          f"{pre1}, {pre8}, {pre_off}")
    assert one == -(-(L + OUT) // BS) == 63
    assert eight == one + 7 and eight / one <= 1.2
    assert unshared > 2 * eight  # without sharing (admission's prefill budget staggers the eight prompts)
    assert pre8 <= pre1 + 7 * BS and pre_off == 8 * pre1  # one prefill, each follower only its last block
    assert all(len(col[s]) == OUT for s in range(8))
    assert col[0] == alone[0]
    _, _, five = _run(runner, [5])
    assert col[5] == five[5]  # a follower's answer is its seed's answer alone


GREEDY = SamplingParams(temperature=0.0)


def test_a_rerun_last_token_writes_nothing_and_gives_the_prompts_logits(runner: JaxRunner) -> None:
    """The runner's side: ``shared_tokens`` sends those positions' K/V write out of bounds (dropped), in a
    prefill group and in the mixed pass (a decode beside it), and the attention reads the shared block's K/V."""
    prompt, other = PROMPT[:32], PROMPT[100:120]
    first = runner.logits(StepPlan((SeqWork(0, prompt, 0, [3, 4], GREEDY, 0, 0),
                                    SeqWork(1, other, 0, [6, 7], GREEDY, 0, 0)), ()))[0]
    rerun = SeqWork(2, prompt[-1:], 31, [3, 4], GREEDY, 0, 0, shared_tokens=1)
    before = [np.asarray(a) for a in jax.tree.leaves(runner._cache)]
    alone = runner.logits(StepPlan((rerun,), ()))[0]
    np.testing.assert_allclose(alone, first, rtol=1e-4, atol=1e-4)
    mixed = runner.logits(StepPlan((rerun,), (SeqWork(1, [5], 20, [6, 7], GREEDY, 0, 1),)))[0]
    np.testing.assert_allclose(mixed, first, rtol=1e-4, atol=1e-4)
    # another token there (whose K/V would differ) shows nothing is written into the shared block
    runner.logits(StepPlan((SeqWork(2, [7], 31, [3, 4], GREEDY, 0, 0, shared_tokens=1),), ()))
    runner.logits(StepPlan((SeqWork(2, [7], 31, [3, 4], GREEDY, 0, 0, shared_tokens=1),),
                           (SeqWork(1, [6], 21, [6, 7], GREEDY, 0, 2),)))
    after = [np.asarray(a) for a in jax.tree.leaves(runner._cache)]
    assert all(np.array_equal(a[3:5], b[3:5]) for a, b in zip(before, after, strict=True))
    assert not np.array_equal(after[0][7], before[0][7])  # the decodes beside it wrote theirs
    k = after[0]  # layer 0's K: [blocks, block size, heads, dim]
    # without shared_tokens the same token is written, as every computed position of a prompt is
    runner.logits(StepPlan((SeqWork(3, prompt[-1:], 31, [3, 5], GREEDY, 0, 0),), ()))
    k5 = np.asarray(jax.tree.leaves(runner._cache)[0])[5, 15]
    np.testing.assert_allclose(k5, k[4, 15], rtol=1e-5, atol=1e-5)


def test_n8_of_a_block_aligned_prompt_shares_every_prompt_block() -> None:
    aligned = [(i * 37 + 11) % 250 + 1 for i in range(1024)]
    r = long_runner(1040, 160)
    one, pre1, alone = peak_blocks(r, aligned, OUT, [0])
    eight, pre8, col = peak_blocks(r, aligned, OUT, list(range(8)))
    print(f"\nKV blocks in use at peak, 1024-token prompt, {OUT} tokens each: n=1 {one}, n=8 {eight} "
          f"({eight / one:.3f}x). Prompt tokens prefilled: {pre1}, {pre8}")
    assert one == 65 and eight == one + 7 and eight / one <= 1.2  # each follower: one block, its output's
    assert pre1 == 1024 and pre8 == 1024 + 7  # each follower runs the prompt's last token only
    assert col[0] == alone[0]
    for s in (3, 7):
        assert col[s] == peak_blocks(r, aligned, OUT, [s])[2][s]  # a follower's answer is its seed's alone
    _, _, greedy = peak_blocks(r, aligned, OUT, list(range(4)), temperature=0.0)
    _, _, greedy_alone = peak_blocks(r, aligned, OUT, [9], temperature=0.0)
    assert all(greedy[s] == greedy_alone[9] for s in range(4))
