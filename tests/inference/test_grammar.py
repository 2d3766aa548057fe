"""Structured output in the worker (inference.grammar): compiles bounded and cached, masks that hold
a sequence to its grammar, through the engine with the synthetic runner and the tiny JAX model."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from inference.engine import Engine, EngineConfig
from inference.grammar import GrammarCompiler, GrammarError, fill_masks, mask_words
from inference.sequence import Delta, Finished
from inference.synthetic import SyntheticRunner
from inference.tokenizer import ByteTokenizer
from transport.messages import FinishReason, SamplingParams

TOK = ByteTokenizer()
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False,
}


def run(engine: Engine, requests: dict[str, tuple[SamplingParams, str]], compiler: GrammarCompiler,
        ) -> dict[str, tuple[str, FinishReason]]:
    texts = {k: "" for k in requests}
    ends: dict[str, FinishReason] = {}
    for key, (params, prompt) in requests.items():
        guide = compiler.guide(params.guide_kind, params.guide) if params.guide_kind else None
        engine.add(key, TOK.encode(prompt), params, 0.0, guide=guide)
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        for ev in engine.step(0.0):
            if isinstance(ev, Delta):
                texts[str(ev.key)] += ev.text
            elif isinstance(ev, Finished):
                ends[str(ev.key)] = ev.reason
    return {k: (texts[k], ends[k]) for k in requests}


def test_a_compile_is_cached_by_content_and_each_sequence_gets_its_own_state() -> None:
    c = GrammarCompiler(TOK)
    a, b = c.guide("json", json.dumps(SCHEMA)), c.guide("json", json.dumps(SCHEMA))
    assert c.compiled == 1 and a.matcher is not b.matcher
    assert a.consume(ord("{")) and not b.accepting
    c.guide("regex", "[0-9]+")
    assert c.compiled == 2


@pytest.mark.parametrize(("kind", "text", "words"), [
    ("json", "{not json", "not valid JSON"),
    ("json", json.dumps({"type": "array", "uniqueItems": True}), "uniqueItems"),
    ("json", '{"type": "object", "properties": {"a": ' * 250 + "{}" + "}}" * 250, "too complex"),
    ("json", json.dumps({"enum": ["x" * 100] * 3000}), "at most 262144"),
    ("regex", "(", "cannot be enforced"),
    ("lark", "start: nothere", "cannot be enforced"),
    ("choice", "[]", "non-empty array"),
    ("xml", "<a/>", "unknown constraint kind"),
])
def test_what_cannot_be_compiled_is_refused_with_words_and_cached(kind: str, text: str, words: str) -> None:
    c = GrammarCompiler(TOK)
    for _ in range(2):
        with pytest.raises(GrammarError, match=re.escape(words)):
            c.guide(kind, text)
    assert c.compiled == 1  # the failure is cached too: a hostile schema sent again costs a lookup


def test_the_mask_allows_exactly_what_the_grammar_does() -> None:
    guide = GrammarCompiler(TOK).guide("choice", json.dumps(["yes", "no"]))
    masks = np.zeros((2, mask_words(TOK.vocab_size)), np.int32)
    fill_masks([(guide, 1)], masks)
    allowed = np.flatnonzero(np.unpackbits(masks[1].view(np.uint8), bitorder="little"))
    assert sorted(allowed) == [ord("n"), ord("y")] and not masks[0].any()


def test_the_synthetic_engine_keeps_to_a_schema_a_regex_and_a_choice() -> None:
    compiler = GrammarCompiler(TOK)
    engine = Engine(SyntheticRunner(num_blocks=256, eos_token_ids=(ByteTokenizer.EOS,)), TOK, EngineConfig(max_batch=8))
    reqs = {f"j{i}": (SamplingParams(max_tokens=200, seed=i, guide_kind="json", guide=json.dumps(SCHEMA)), "x")
            for i in range(4)}
    reqs["r"] = (SamplingParams(max_tokens=50, guide_kind="regex", guide="[0-9]{3}-[a-z]{2}"), "x")
    reqs["c"] = (SamplingParams(max_tokens=50, guide_kind="choice", guide='["red", "green"]'), "x")
    reqs["free"] = (SamplingParams(max_tokens=5, seed=1), "x")
    out = run(engine, reqs, compiler)
    for i in range(4):
        text, reason = out[f"j{i}"]
        assert reason is FinishReason.STOP, text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", out["r"][0]) and out["r"][1] is FinishReason.STOP
    assert out["c"][0] in ("red", "green")
    assert out["free"][1] is FinishReason.LENGTH  # an unconstrained neighbour is untouched


@pytest.mark.slow
def test_the_tiny_model_keeps_to_a_schema_whatever_its_weights_say() -> None:
    """Random weights would write anything; masked, every finished answer is valid, greedy or sampled,
    alone or batched with unconstrained rows (the decode path samples through the masked executable)."""
    from inference.model.jax_runner import JaxRunner

    runner = JaxRunner.load("tiny", max_batch=8, num_blocks=128, max_prefill_batch=1)
    compiler = GrammarCompiler(TOK, runner.eos_token_ids)
    engine = Engine(runner, TOK, EngineConfig(max_batch=8, prefill_batch=1))
    reqs = {f"j{i}": (SamplingParams(max_tokens=120, seed=i, temperature=0.0 if i == 0 else 1.0, guide_kind="json",
                                     guide=json.dumps(SCHEMA)), "x") for i in range(4)}
    reqs["free"] = (SamplingParams(max_tokens=8, seed=3, ignore_eos=True), "x")
    out = run(engine, reqs, compiler)
    finished = [k for k in out if k != "free" and out[k][1] is FinishReason.STOP]
    assert finished  # the schema bounds every string, so answers end
    for k in finished:
        jsonschema.validate(json.loads(out[k][0]), SCHEMA)
    assert out["free"][1] is FinishReason.LENGTH
