"""Chunked prefill through the JAX runner: a prompt run in chunks that start mid-sequence (and
mid-block), each chunk in one mixed pass with other sequences' decodes, gives the logits of the
whole prompt run at once and leaves the decodes' logits as they are alone; and through the
engine, greedy outputs equal the unchunked engine's.

Tolerances: the same float32 arithmetic in a different grouping (rows of one matmul, keys
split between cache and chunk), so agreement to float32 rounding of an O(1) logit, ~1e-5; an
int8 KV cache rescales a block's codes when a later chunk raises its scale, one code step
(1/127 of the block's largest |K|) at most: logits agree to ~1e-2 and the greedy tokens hold.
"""

from __future__ import annotations

import numpy as np
import pytest

from inference.engine import Engine, EngineConfig
from inference.model.jax_runner import JaxRunner
from inference.runner import SeqWork, StepPlan
from inference.tokenizer import ByteTokenizer
from tests.inference.doubles import Collector, run_until_done
from transport.messages import SamplingParams

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0.0)
BS = 16


def _runner(attention: str, kv: str, step_tokens: int = 64) -> JaxRunner:
    return JaxRunner.load("tiny", attention=attention, kv_cache_dtype=kv, max_batch=8, num_blocks=64,
                          max_model_len=256, max_prefill_batch=1, step_tokens=step_tokens)


def _prompt(n: int, salt: int) -> list[int]:
    return [(i * 37 + salt * 11) % 250 for i in range(n)]


@pytest.mark.parametrize("attention,kv,tol", [("native", "auto", 1e-4), ("xla", "int8", 3e-2)])
def test_chunks_mixed_with_decodes_give_the_whole_prompts_logits(attention: str, kv: str, tol: float) -> None:
    short = [_prompt(10, 1), _prompt(23, 2)]
    long = _prompt(100, 3)
    tables = [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]
    cuts = [0, 37, 70, 100]  # chunk boundaries, mid-block on purpose

    def decodes(step: int, toks: list[int]) -> tuple[SeqWork, ...]:
        return tuple(SeqWork(i, [toks[i]], len(p) + step, tables[i], GREEDY, 0, step + 1)
                     for i, p in enumerate(short))

    alone, mixed = _runner(attention, kv), _runner(attention, kv)
    for r in (alone, mixed):
        r.logits(StepPlan(tuple(SeqWork(i, p, 0, tables[i], GREEDY, 0, 0) for i, p in enumerate(short)), ()))
    whole = alone.logits(StepPlan((SeqWork(2, long, 0, tables[2], GREEDY, 0, 0),), ()))[0]
    toks = [5, 6]
    for step, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
        ref = alone.logits(StepPlan((), decodes(step, toks)))
        chunk = SeqWork(2, long[a:b], a, tables[2], GREEDY, 0, 0)
        got = mixed.logits(StepPlan((chunk,), decodes(step, toks)))
        assert any(k[0] == "mixed_logits" for k in mixed._execs)  # the decodes rode in the chunk's pass
        np.testing.assert_allclose(got[1:], ref, atol=tol, rtol=0)
        toks = [int(t) for t in ref.argmax(-1)]
    np.testing.assert_allclose(got[0], whole, atol=tol, rtol=0)
    assert int(got[0].argmax()) == int(whole.argmax())
    # sampled in the same executable: the greedy tokens of the mixed pass's rows
    out = mixed.execute(StepPlan((SeqWork(3, _prompt(20, 4), 0, list(range(24, 30)), GREEDY, 0, 0),),
                                 decodes(len(cuts) - 1, toks)))
    assert [o.seq_id for o in out] == [3, 0, 1]


def test_the_engine_chunked_gives_the_unchunked_greedy_tokens() -> None:
    """Three streams decoding, then a 200-token prompt: chunked (budget 48) and whole, same tokens."""
    def run(step_tokens: int) -> Collector:
        runner = _runner("native", "auto", step_tokens)
        eng = Engine(runner, ByteTokenizer(), EngineConfig(max_batch=8, step_tokens=step_tokens, prefill_batch=1))
        col = Collector()
        for i in range(3):
            eng.add(i, _prompt(12 + i, i), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), 0.0)
        for t in range(2):
            col.feed(eng.step(t * 0.01))
        eng.add("long", _prompt(200, 7), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), 0.02)
        run_until_done(eng, col, t0=0.03)
        return col

    chunked, whole = run(48), run(0)
    for key in (0, 1, 2, "long"):
        assert chunked.tokens(key) == whole.tokens(key) and len(whole.tokens(key)) in (6, 12)
