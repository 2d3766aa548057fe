"""Penalties, logit_bias and min_tokens through the engine and the tiny model's runner (prefill, decode
and the mixed pass around them): each has its effect, composes with the others' rows in one batch, and
a batch without them keeps the plain sampler's executables."""

from __future__ import annotations

from collections.abc import Hashable

import pytest

from inference.engine import Delta, Engine, EngineConfig, EngineError, Finished
from inference.model.jax_runner import JaxRunner
from inference.tokenizer import ByteTokenizer
from transport.messages import FinishReason, SamplingParams

pytestmark = pytest.mark.slow
TOK = ByteTokenizer()
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def runner() -> JaxRunner:
    return JaxRunner.load("tiny", max_batch=8, num_blocks=256, max_prefill_batch=2)


def run(runner: JaxRunner, requests: dict[Hashable, tuple[bytes, SamplingParams]]) -> dict[Hashable, list[int]]:
    """Every request to its end in one engine; the tokens each produced (and its finish reason last)."""
    eng = Engine(runner, TOK, EngineConfig(max_batch=8))  # type: ignore[arg-type]
    out: dict[Hashable, list[int]] = {k: [] for k in requests}
    for k, (prompt, p) in requests.items():
        eng.add(k, list(prompt), p, 0.0, return_text=False)
    ends: dict[Hashable, FinishReason] = {}
    while eng.has_unfinished():
        for ev in eng.step(0.0):
            if isinstance(ev, Delta):
                out[ev.key] += ev.token_ids
            elif isinstance(ev, Finished):
                ends[ev.key] = ev.reason
    return {k: [*v, ends[k]] for k, v in out.items()}  # type: ignore[list-item]


def test_logit_bias_forces_and_bans(runner: JaxRunner) -> None:
    plain = run(runner, {"a": (b"Hello there", GREEDY)})["a"][:-1]
    forced = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True, logit_bias=((65, 100.0),))
    banned = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                            logit_bias=tuple((t, -100.0) for t in set(plain)))
    got = run(runner, {"f": (b"Hello there", forced), "b": (b"Hello there", banned), "p": (b"xyz", GREEDY)})
    assert got["f"][:-1] == [65] * 12
    assert not set(got["b"][:-1]) & set(plain)


def test_frequency_and_presence_penalties_reduce_repeats(runner: JaxRunner) -> None:
    """Greedy on random weights repeats itself; a large penalty makes it repeat less."""
    long = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    freq = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, frequency_penalty=2.0)
    pres = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, presence_penalty=2.0)
    rep = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, repetition_penalty=5.0)
    got = run(runner, {k: (b"The cat sat on the", p) for k, p in
                       {"none": long, "freq": freq, "pres": pres, "rep": rep}.items()})
    distinct = {k: len(set(v[:-1])) for k, v in got.items()}
    assert distinct["none"] < distinct["freq"]
    assert distinct["none"] < distinct["pres"]
    assert distinct["none"] < distinct["rep"]


def test_min_tokens_holds_the_end_back(runner: JaxRunner) -> None:
    first = run(runner, {"a": (b"Once upon", GREEDY)})["a"][0]
    stop_now = SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=(first,))
    held = SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=(first,), min_tokens=6)
    got = run(runner, {"now": (b"Once upon", stop_now), "held": (b"Once upon", held)})
    assert got["now"] == [FinishReason.STOP]  # the stop id, not streamed, at once
    assert len(got["held"]) - 1 >= 6 and first not in got["held"][:6]


def test_an_adjusted_request_samples_the_same_alone_or_among_others(runner: JaxRunner) -> None:
    p = SamplingParams(max_tokens=16, temperature=0.9, seed=77, frequency_penalty=0.8, repetition_penalty=1.2,
                       logit_bias=((101, 3.0),))
    alone = run(runner, {"me": (b"seeded prompt", p)})["me"]
    others = {i: (b"other %d" % i * (i + 1), SamplingParams(max_tokens=10 + i, temperature=0.7, seed=i))
              for i in range(5)}
    crowd = run(runner, {**others, "me": (b"seeded prompt", p)})["me"]
    assert alone == crowd


def test_plain_batches_run_only_the_plain_executables(runner: JaxRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    used: list[str] = []
    real = runner._executable
    monkeypatch.setattr(runner, "_executable", lambda key: used.append(key[0]) or real(key))
    run(runner, {"a": (b"plain", GREEDY), "b": (b"also plain", SamplingParams(max_tokens=5, seed=1))})
    assert set(used) <= {"prefill", "sample", "decode", "mixed"}
    used.clear()
    run(runner, {"a": (b"plain", SamplingParams(max_tokens=5, logit_bias=((66, 1.0),)))})
    assert "sample_adjusted" in used and "decode_logits" in used


def test_the_engine_refuses_what_it_cannot_honour(runner: JaxRunner) -> None:
    eng = Engine(runner, TOK, EngineConfig(max_batch=8))  # type: ignore[arg-type]
    for p, words in [(SamplingParams(logit_bias=((258, 1.0),)), "vocabulary"),
                     (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
                     (SamplingParams(max_tokens=4, min_tokens=5), "min_tokens"),
                     (SamplingParams(presence_penalty=2.5), "presence_penalty")]:
        with pytest.raises(EngineError, match=words):
            eng.add("x", [1, 2], p, 0.0)


_TP_SCRIPT = """
from inference.engine import Engine, EngineConfig
from inference.model.jax_runner import JaxRunner
from inference.tokenizer import ByteTokenizer
from tests.inference.doubles import Collector, run_until_done
from transport.messages import SamplingParams
for tp in (1, 2):
    r = JaxRunner.load("tiny", tensor_parallel=tp, max_batch=2, num_blocks=32, max_model_len=64, max_prefill_batch=1)
    eng = Engine(r, ByteTokenizer(), EngineConfig(max_batch=2, prefill_batch=1))
    eng.add(0, [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, frequency_penalty=1.5,
                                         logit_bias=((66, 3.0),)), 0.0)
    eng.add(1, [9, 9, 9, 9], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), 0.0)
    col = Collector()
    run_until_done(eng, col)
    print(col.tokens(0) + col.tokens(1))
"""


def test_adjusted_sampling_runs_over_a_tensor_parallel_mesh() -> None:
    """The adjusted sampler takes the mesh's replicated logits (TP = 2 on two CPU devices) and samples
    what TP = 1 does."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-c", _TP_SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = proc.stdout.splitlines()[-2:]
    assert one == two and "66" in one
