"""n = 8 shares one prompt's KV on the JAX engine (the tiny model): the eight sequences of one prompt
use about the blocks of one, not eight times them.

The gateway runs ``n`` > 1 as sub-generations on one replica (gateway.api.fanout); the engine admits
the first, and the others wait for its prefill's blocks to be registered, then take them from the
prefix cache (``Engine._follows``): reference counts, no copy, no second prefill. What each follower
adds is the block holding the prompt's last token (a cache hit always leaves one token to compute:
its logits are the follower's first sample) and the blocks its own output fills. With block size
16, an L-token prompt and o output tokens, a follower owns the blocks covering positions
16 * floor((L - 1) / 16) .. L + o - 1: one for L = 1000, o = 8 (positions 992..1007), so n = 8 holds
63 + 7 * 1 = 70 blocks against 63 for n = 1: 1.11x (a block-aligned L = 1024 needs two: 79 / 65 = 1.22x).

Measured here: the peak of blocks in use over the whole run (``num_blocks - num_free``), n = 1 and
n = 8 in the same run, with the prefix cache off as the baseline that prefills eight times (its peak
is bounded by the prefill budget per step, which staggers the eight admissions); and the
followers' tokens equal those of the same seed run alone (shared KV gives the same answer). More lengths: tests/bench/bench_n_kv.py.
"""

from __future__ import annotations

import pytest

from inference.model.jax_runner import JaxRunner
from tests.bench.bench_n_kv import peak_blocks

pytest.importorskip("jax")

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
