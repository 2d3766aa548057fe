"""Prompts that share leading blocks with one being prefilled wait for its blocks, then hit the
prefix cache (``Engine._follows``): how ``n`` > 1 shares one prompt's KV. Scripted runner, fake clock."""

from __future__ import annotations

from inference.engine import Engine, EngineConfig
from inference.tokenizer import ByteTokenizer
from tests.inference.doubles import Collector, ScriptedRunner, run_until_done
from transport.messages import SamplingParams

BS = 4
PROMPT = [(i * 7) % 200 + 1 for i in range(41)]  # 10 full blocks and one token
P = SamplingParams(max_tokens=3, ignore_eos=True, seed=0)


def _engine(**cfg: int) -> tuple[Engine, ScriptedRunner]:
    runner = ScriptedRunner({s: [10 + s, 20 + s, 30 + s] for s in range(16)}, block_size=BS, num_blocks=128)
    return Engine(runner, ByteTokenizer(), EngineConfig(max_batch=16, **cfg)), runner


def _prefilled(runner: ScriptedRunner) -> list[int]:
    return [len(w.token_ids) for plan in runner.plans for w in plan.prefills]


def _seeded(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=3, ignore_eos=True, seed=i)


def test_identical_prompts_arriving_together_are_prefilled_once() -> None:
    """Eight copies of a 41-token prompt: the first prefills 41 tokens; the seven others wait one step
    and then compute only the last token (10 blocks shared): 41 + 7 * 1 prompt tokens, not 8 * 41."""
    eng, runner = _engine()
    for i in range(8):
        eng.add(i, PROMPT, _seeded(i), 0.0)
    col = Collector()
    col.feed(eng.step(0.0))
    assert [len(w.token_ids) for w in runner.plans[0].prefills] == [41]
    col.feed(eng.step(0.01))
    assert [len(w.token_ids) for w in runner.plans[1].prefills] == [1] * 7
    run_until_done(eng, col, t0=0.02)
    assert sum(_prefilled(runner)) == 41 + 7
    assert all(col.tokens(i) == [10 + i, 20 + i, 30 + i] for i in range(8))  # each its own seed
    assert [col.ends[i].cached_tokens for i in range(8)] == [0] + [40] * 7  # type: ignore[union-attr]


def test_blocks_in_use_for_eight_are_a_few_more_than_for_one() -> None:
    def peak(n: int) -> int:
        eng, _ = _engine()
        for i in range(n):
            eng.add(i, PROMPT, _seeded(i), 0.0)
        top, t, col = 0, 0.0, Collector()
        while eng.has_unfinished():
            col.feed(eng.step(t))
            top = max(top, eng.kv.num_blocks - eng.kv.num_free)
            t += 0.01
        return top

    one, eight = peak(1), peak(8)
    assert one == 11  # 41 + 3 positions
    assert eight == one + 7  # each follower: its own block 10 (the prompt's last token and its outputs)


def test_a_cancelled_leader_lets_its_followers_go() -> None:
    eng, runner = _engine(step_tokens=8)  # chunked: the leader's prefill takes several steps
    eng.add("lead", PROMPT, P, 0.0)
    eng.step(0.0)
    eng.add("follow", PROMPT, P, 0.0)
    eng.step(0.01)
    assert all(w.seq_id != 2 for w in runner.plans[-1].prefills)  # it waits for the leader's blocks
    eng.cancel("lead")
    col = Collector()
    col.feed(eng.step(0.02))
    assert any(w.seq_id == 2 for w in runner.plans[-1].prefills)
    run_until_done(eng, col, t0=0.03)
    assert col.ends["follow"].reason.name == "LENGTH"  # type: ignore[union-attr]


def test_a_follower_of_a_chunked_leader_takes_every_block_it_registered() -> None:
    eng, runner = _engine(step_tokens=8)
    eng.add("lead", PROMPT, P, 0.0)
    eng.add("follow", PROMPT, P, 0.0)
    col = Collector()
    run_until_done(eng, col)
    assert _prefilled(runner) == [8] * 5 + [1]  # the leader's 40 in chunks (its 41st decodes), the follower's 1
    assert col.ends["follow"].cached_tokens == 40  # type: ignore[union-attr]


def test_different_prompts_do_not_wait() -> None:
    eng, runner = _engine()
    eng.add(0, PROMPT, P, 0.0)
    eng.add(1, [5, *PROMPT[1:]], P, 0.0)  # differs in its first block
    eng.step(0.0)
    assert len(runner.plans[0].prefills) == 2


def test_without_the_prefix_cache_nothing_waits() -> None:
    eng, runner = _engine(enable_prefix_cache=False)
    for i in range(3):
        eng.add(i, PROMPT, P, 0.0)
    eng.step(0.0)
    assert len(runner.plans[0].prefills) == 3
