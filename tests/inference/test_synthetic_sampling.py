"""The synthetic engine and the sampling settings it can honour without logits (inference/synthetic.py's
docstring): logit_bias +-100 and min_tokens decide; penalties change nothing."""

from __future__ import annotations

from collections.abc import Hashable

from inference.engine import Engine, EngineConfig
from inference.sequence import Delta, Finished
from inference.synthetic import SyntheticRunner
from inference.tokenizer import ByteTokenizer
from transport.messages import FinishReason, SamplingParams

TOK = ByteTokenizer()


def run(params: SamplingParams, prompt: bytes = b"hello") -> tuple[list[int], FinishReason]:
    eng = Engine(SyntheticRunner(), TOK, EngineConfig())  # type: ignore[arg-type]
    key: Hashable = "r"
    eng.add(key, list(prompt), params, 0.0, return_text=False)
    tokens: list[int] = []
    while True:
        for ev in eng.step(0.0):
            if isinstance(ev, Delta):
                tokens += ev.token_ids
            elif isinstance(ev, Finished):
                return tokens, ev.reason


def test_plus_100_forces_and_minus_100_bans() -> None:
    base = SamplingParams(max_tokens=20, seed=5)
    plain, _ = run(base)
    forced, _ = run(SamplingParams(max_tokens=20, seed=5, logit_bias=((90, 100.0), (70, 100.0))))
    assert forced == [70] * 20
    banned, _ = run(SamplingParams(max_tokens=20, seed=5, logit_bias=tuple((t, -100.0) for t in set(plain))))
    assert not set(banned) & set(plain)
    mild, _ = run(SamplingParams(max_tokens=20, seed=5, logit_bias=((plain[0], -50.0),)))
    assert mild == plain  # only the values that decide a token are honoured


def test_min_tokens_holds_the_stop_ids_back() -> None:
    plain, _ = run(SamplingParams(max_tokens=20, seed=9))
    stops = tuple(sorted(set(plain[:3])))
    short, reason = run(SamplingParams(max_tokens=20, seed=9, stop_token_ids=stops))
    assert reason is FinishReason.STOP and len(short) < 3
    held, _ = run(SamplingParams(max_tokens=20, seed=9, stop_token_ids=stops, min_tokens=8))
    assert len(held) >= 8 and not set(held[:8]) & set(stops)


def test_penalties_change_nothing_here() -> None:
    plain = run(SamplingParams(max_tokens=20, seed=1))
    assert run(SamplingParams(max_tokens=20, seed=1, frequency_penalty=2.0, presence_penalty=1.0,
                              repetition_penalty=3.0)) == plain
