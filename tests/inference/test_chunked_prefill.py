"""Chunked prefill in the scheduler: each step carries at most ``step_tokens`` tokens, decodes first.

The synthetic runner (``verify=True``) re-reads every sequence's whole context through its block
table each step and derives each token from it, so a chunk written to the wrong slot, or a decode
that reads a position no chunk wrote, changes the output or raises.
"""

from __future__ import annotations

import pytest

from inference.batch_window import AdaptiveWindow
from inference.engine import Engine, EngineConfig
from inference.runner import SeqOutput, StepPlan
from inference.synthetic import SyntheticRunner
from inference.tokenizer import ByteTokenizer
from tests.inference.doubles import Collector, run_until_done
from transport.messages import SamplingParams

TOK = ByteTokenizer()


class _Recording(SyntheticRunner):
    """The synthetic runner, keeping every plan it ran."""

    def __init__(self) -> None:
        super().__init__(block_size=4, num_blocks=256, max_model_len=512)
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> list[SeqOutput]:
        self.plans.append(plan)
        return super().execute(plan)


def _engine(step_tokens: int, *, max_batch: int = 8, **kw: object) -> tuple[Engine, _Recording]:
    runner = _Recording()
    cfg = EngineConfig(max_batch=max_batch, step_tokens=step_tokens, **kw)  # type: ignore[arg-type]
    return Engine(runner, TOK, cfg), runner


def _prompt(n: int, salt: int) -> list[int]:
    return [32 + (i * 7 + salt) % 90 for i in range(n)]


def _run(step_tokens: int) -> tuple[Collector, _Recording]:
    """Four streams decoding, then a 150-token prompt arrives."""
    eng, runner = _engine(step_tokens)
    return _streams_then_long(eng, streams=(4, 6, 40), steps=3, long=(150, 5)), runner


def _streams_then_long(eng: Engine, *, streams: tuple[int, int, int], steps: int, long: tuple[int, int]) -> Collector:
    """``streams`` = (how many, prompt tokens, max_tokens) decode for ``steps`` steps, then a prompt of
    ``long`` = (tokens, max_tokens) arrives under the key "long"; run until all are done."""
    col = Collector()
    n, prompt, max_tokens = streams
    for i in range(n):
        eng.add(i, _prompt(prompt, i), SamplingParams(max_tokens=max_tokens, seed=i), 0.0)
    t = 0.0
    for _ in range(steps):
        col.feed(eng.step(t))
        t += 0.01
    eng.add("long", _prompt(long[0], 9), SamplingParams(max_tokens=long[1], seed=9), t)
    run_until_done(eng, col, t0=t)
    return col


def test_a_long_prompt_is_chunked_beside_the_decodes_and_outputs_do_not_change() -> None:
    """Budget 32, four decodes: the 150-token prompt runs in chunks of 28 (32 - 4), each step still
    decodes all four streams, and every request's tokens equal those of the unchunked run."""
    chunked, runner = _run(32)
    whole, whole_runner = _run(0)
    for key in (0, 1, 2, 3, "long"):
        assert chunked.tokens(key) == whole.tokens(key)
    assert max(len(p.prefills[0].token_ids) for p in whole_runner.plans if p.prefills) == 150
    steps = [p for p in runner.plans if any(len(w.token_ids) > 6 for w in p.prefills)]
    assert [len(p.prefills[0].token_ids) for p in steps] == [28, 28, 28, 28, 28, 10]
    assert [p.prefills[0].start_pos for p in steps] == [0, 28, 56, 84, 112, 140]
    for p in steps:
        assert len(p.decodes) == 4 and sum(len(w.token_ids) for w in (*p.prefills, *p.decodes)) <= 32
    assert runner.plans.index(steps[-1]) - runner.plans.index(steps[0]) == len(steps) - 1  # one chunk a step


def test_several_prompts_share_a_step_and_the_prefix_cache_sees_finished_chunks() -> None:
    """Two 40-token prompts and budget 48: the first runs 40, the second starts with 8 in the same
    step. A later prompt with the same first 36 tokens finds them cached (whole blocks of 4)."""
    eng, runner = _engine(48)
    col = Collector()
    eng.add("a", _prompt(40, 1), SamplingParams(max_tokens=3, seed=1), 0.0)
    eng.add("b", _prompt(40, 2), SamplingParams(max_tokens=3, seed=2), 0.0)
    col.feed(eng.step(0.0))
    first = runner.plans[0]
    assert [(w.start_pos, len(w.token_ids)) for w in first.prefills] == [(0, 40), (0, 8)]
    assert not col.deltas.get("b")  # no token before the whole prompt is in
    run_until_done(eng, col, t0=0.01)
    assert len(col.tokens("b")) == 3
    eng.add("c", _prompt(40, 2)[:36] + [33] * 10, SamplingParams(max_tokens=2, seed=3), 1.0)
    run_until_done(eng, col, t0=1.0)
    ends = col.ends["c"]
    assert ends.cached_tokens == 36  # type: ignore[union-attr]


def test_decodes_never_starve_a_prompt() -> None:
    """More decodes than the budget: each step still moves the prompt by a block (4 tokens)."""
    eng, runner = _engine(4, max_batch=8)
    col = _streams_then_long(eng, streams=(6, 3, 30), steps=6, long=(20, 2))
    chunks = [w for p in runner.plans for w in p.prefills if w.seq_id == 7]
    assert [len(w.token_ids) for w in chunks] == [4, 4, 4, 4, 4]
    assert len(col.tokens("long")) == 2


def test_the_adaptive_window_is_told_each_mixed_steps_decodes() -> None:
    eng, _ = _engine(32)
    seen: list[tuple[list[int], int]] = []
    window = AdaptiveWindow(0.05)
    observe = window.observe

    def spy(latency: float, load: float, prefill_lengths=(), decodes: int = 0) -> None:  # type: ignore[no-untyped-def]
        seen.append((list(prefill_lengths), decodes))
        observe(latency, load, prefill_lengths, decodes)

    window.observe = spy  # type: ignore[method-assign]
    eng.window = window
    eng.add(0, _prompt(5, 0), SamplingParams(max_tokens=10, seed=0), 0.0)
    eng.step(0.0)
    eng.add(1, _prompt(60, 1), SamplingParams(max_tokens=1, seed=1), 0.01)
    eng.step(0.01)
    eng.step(0.02)
    assert seen == [([5], 0), ([31], 1), ([29], 1)]


@pytest.mark.parametrize("step_tokens", [-1])
def test_a_negative_budget_is_refused(step_tokens: int) -> None:
    with pytest.raises(ValueError, match="step_tokens"):
        _engine(step_tokens)
