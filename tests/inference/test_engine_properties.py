"""Hypothesis: random workloads against a small paged cache (preemption, prefix
sharing, cancels, pauses, stall timeouts). Every request ends exactly once, the
block bookkeeping stays consistent, every block comes back, and each
uncancelled request streams exactly the tokens and text an unconstrained
reference run gives (the synthetic runner reads its paged KV back, so a wrong
block would change the output) — or, paused past the stall timeout, a prefix of
them and a TIMEOUT."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference.engine import Engine, EngineConfig, EngineError
from inference.sequence import Failed, Finished
from inference.synthetic import SyntheticRunner, expected_token
from inference.tokenizer import ByteTokenizer
from tests.inference.doubles import Collector
from transport.messages import ErrorCode, FinishReason, SamplingParams

TOK = ByteTokenizer()
BASES = [list(b"shared system prompt: "), list(b"another base text"), list(b"zz")]

request = st.fixed_dictionaries(
    {
        "base": st.integers(0, len(BASES) - 1),
        "suffix": st.lists(st.integers(32, 126), max_size=6),
        "max_tokens": st.integers(1, 12),
        "seed": st.integers(0, 3),
        "stop": st.lists(st.sampled_from(["a", "Q", "zz", "%&", "xyz"]), max_size=2),
        "arrive": st.integers(0, 8),
        "cancel_at": st.one_of(st.none(), st.integers(0, 20)),
        "pause": st.one_of(st.none(), st.tuples(st.integers(0, 10), st.integers(1, 5))),
    }
)


def reference(prompt: list[int], p: SamplingParams) -> tuple[list[int], str, FinishReason]:
    ctx, gen = list(prompt), []
    for i in range(p.max_tokens):
        t = expected_token(ctx, p.seed or 0, i)
        gen.append(t)
        ctx.append(t)
        text = bytes(gen).decode()
        hits = [text.find(s) for s in p.stop if s in text]
        if hits:
            return gen, text[: min(hits)], FinishReason.STOP
    return gen, bytes(gen).decode(), FinishReason.LENGTH


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(request, min_size=1, max_size=8),
    num_blocks=st.integers(6, 24),
    max_batch=st.integers(1, 4),
    prefix_cache=st.booleans(),
    verify=st.booleans(),
)
def test_random_workloads_end_once_and_match_reference(
    reqs: list[dict], num_blocks: int, max_batch: int, prefix_cache: bool, verify: bool
) -> None:
    runner = SyntheticRunner(block_size=4, num_blocks=num_blocks, max_model_len=64, verify=verify)
    # Paused for 5 steps (resumed at the 5th, before it runs) is past the timeout; 1-4 is not.
    eng = Engine(runner, TOK, EngineConfig(max_batch=max_batch, max_prefill_tokens=24,
                                           enable_prefix_cache=prefix_cache, stall_timeout=4.0))  # fmt: skip
    col = Collector()
    added: dict[int, tuple[list[int], SamplingParams]] = {}
    refused: set[int] = set()
    cancelled: set[int] = set()
    for step in range(400):
        for i, r in enumerate(reqs):
            if r["arrive"] == step:
                prompt = BASES[r["base"]] + r["suffix"]
                p = SamplingParams(max_tokens=r["max_tokens"], seed=r["seed"], stop=tuple(r["stop"]))
                try:
                    eng.add(i, prompt, p, float(step))
                    added[i] = (prompt, p)
                except EngineError:
                    refused.add(i)
            if r["cancel_at"] == step and i in added:
                fin = eng.cancel(i)
                if fin is not None:
                    cancelled.add(i)
                    col.feed([fin])
            if r["pause"] and i in added:
                at, length = r["pause"]
                if step == at:
                    eng.pause(i, float(step))
                elif step == at + length:
                    eng.resume(i)
        col.feed(eng.step(float(step)))
        eng.kv.check_invariants()
        if step > 30 and not eng.has_unfinished():
            break
    assert not eng.has_unfinished()
    assert set(col.ends) == set(added) and not (set(added) & refused)
    assert set(added) | refused == set(range(len(reqs)))
    assert eng.kv.num_free == num_blocks
    for i, (prompt, p) in added.items():
        end = col.ends[i]
        toks, text, reason = reference(prompt, p)
        if isinstance(end, Failed):
            assert reqs[i]["pause"] and reqs[i]["pause"][1] == 5 and end.code is ErrorCode.TIMEOUT
            assert toks[: len(col.tokens(i))] == col.tokens(i)
            continue
        assert isinstance(end, Finished), end
        if i in cancelled:
            assert end.reason is FinishReason.CANCELLED
            continue
        assert col.tokens(i) == toks
        assert col.text(i) == text
        assert end.reason is reason and end.completion_tokens == len(toks)
