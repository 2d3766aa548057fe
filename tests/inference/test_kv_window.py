"""A sliding window's KV bookkeeping: the blocks wholly before the window of a sequence's next query go
back to the cache, the table keeps naming a held block for them, and every position a step's queries
can see stays in a held block (the bookkeeping alone here; the model through it: test_architectures.py)."""

from __future__ import annotations

import pytest

from inference.engine import Engine, EngineConfig
from inference.kv_cache import KVCache
from inference.tokenizer import ByteTokenizer
from tests.inference.doubles import Collector, ScriptedRunner, run_until_done
from transport.messages import SamplingParams


def test_blocks_wholly_before_the_window_go_back() -> None:
    """Block size 4, window 6: after 18 positions the next query (position 18) sees 13..18, so blocks
    0-2 (positions 0-11) are released and block 3 (12-15) is kept for position 13 on."""
    kv = KVCache(20, 4, window=6)
    alloc = kv.allocate(1, list(range(18)))
    assert alloc is not None and kv.num_free == 15
    kv.register(1, list(range(18)), 18)
    assert kv.release_out_of_window(1, 18) == 3
    table = kv.block_table(1)
    assert len(table) == 5 and table[:3] == (alloc.block_table[3],) * 3 and table[3:] == alloc.block_table[3:]
    assert kv.num_free == 18 and kv.window_releases == 3
    assert kv.release_out_of_window(1, 18) == 0  # nothing more until the window moves a block on
    assert kv.release_out_of_window(1, 20) == 0  # position 20 sees 15..20: block 3 (12-15) still
    assert kv.ensure_capacity(1, 22)
    assert kv.release_out_of_window(1, 21) == 1 and kv.block_table(1)[:4] == (alloc.block_table[4],) * 4
    kv.check_invariants()
    kv.free(1)
    kv.check_invariants()
    assert kv.num_free == 20


def test_released_blocks_stay_in_the_prefix_cache() -> None:
    """A released full block keeps its hash: another prompt with that prefix still shares it."""
    kv = KVCache(16, 4, window=4)
    prompt = list(range(100, 117))  # 17 tokens: 4 full blocks
    kv.allocate(1, prompt)
    kv.register(1, prompt, 17)
    assert kv.release_out_of_window(1, 17) == 3  # position 17 sees 14..17: blocks 0-2 go
    assert kv.cached_prefix_len(prompt[:13] + [7]) == 12  # blocks 0-2, evictable, still match
    alloc = kv.allocate(2, prompt[:13] + [7])
    assert alloc is not None and alloc.num_cached_tokens == 12
    kv.check_invariants()


def test_the_last_block_is_never_released_and_no_window_releases_nothing() -> None:
    kv = KVCache(8, 4, window=1)
    kv.allocate(1, list(range(8)))
    assert kv.release_out_of_window(1, 8) == 1  # position 8 (a block not yet allocated) sees only itself
    assert kv.block_table(1) == (kv.block_table(1)[1],) * 2
    whole = KVCache(8, 4)
    whole.allocate(1, list(range(8)))
    assert whole.release_out_of_window(1, 8) == 0 and whole.num_free == 6
    with pytest.raises(ValueError, match="window"):
        KVCache(8, 4, window=0)


@pytest.mark.parametrize("step_tokens", [0, 8])
def test_every_position_a_step_can_see_is_held_and_no_more(step_tokens: int) -> None:
    """Three sequences, prompts longer than the window, generating past it, with chunked prefill on and
    off. In every step each row's table names held blocks for every position its queries see (the
    window before its first query on), and a decoding sequence holds at most the window's blocks plus
    one. No preemption: the cache (24 blocks of 4) could not hold the three whole (3 x 40 tokens)."""
    window, bs = 10, 4
    runner = ScriptedRunner({s: [65 + s] * 40 for s in (1, 2, 3)}, block_size=bs, num_blocks=24,
                            max_model_len=96)
    runner.sliding_window = window
    eng = Engine(runner, ByteTokenizer(), EngineConfig(step_tokens=step_tokens, max_prefill_tokens=64))  # type: ignore[arg-type]
    for s in (1, 2, 3):
        eng.add(s, [s] * 22, SamplingParams(max_tokens=18, seed=s, ignore_eos=True), 0.0)
    col = Collector()
    checked = 0
    execute = runner.execute

    def checking(plan):  # type: ignore[no-untyped-def]
        nonlocal checked
        for w in (*plan.prefills, *plan.decodes):
            first = max(0, w.start_pos - window + 1)
            for pos in range(first, w.start_pos + len(w.token_ids)):
                assert eng.kv.ref_count(w.block_table[pos // bs]) >= 1, (w.seq_id, pos)
            if plan.decodes and w in plan.decodes:
                held = len(set(w.block_table))
                assert held <= -(-window // bs) + 1, (w.seq_id, w.start_pos, w.block_table)
            checked += 1
        eng.kv.check_invariants()
        return execute(plan)

    runner.execute = checking  # type: ignore[method-assign]
    run_until_done(eng, col)
    assert checked > 50 and eng.num_preemptions == 0 and eng.kv.window_releases > 0
    assert all(col.tokens(s) == [65 + s] * 18 for s in (1, 2, 3))
    assert eng.kv.num_free == 24
