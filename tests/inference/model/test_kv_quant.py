"""The runner with a quantized KV cache (``kv_cache_dtype="int8"|"fp8"``) against the float one.

Three prompts of different lengths (ragged batch of 3) are prefilled, then 64
greedy steps decode them as one batch. The float runner picks the tokens; the
quantized runners are teacher-forced with them, so every step compares logits
for the same context.
"""

from __future__ import annotations

import numpy as np
import pytest

from inference.model.jax_runner import JaxRunner
from inference.runner import SeqWork, StepPlan
from tests.inference.model.forced import GREEDY, teacher_forced

pytestmark = pytest.mark.slow
PROMPTS = [list(b"Hi!"), list(b"The quick brown fox jumps"), list(b"A longer prompt: it spans three blocks of sixteen.")]
STEPS = 64
BLOCKS_PER_SEQ = 8  # 128 tokens: the longest prompt (50) + 64 steps fit


def _runner(kind: str) -> JaxRunner:
    return JaxRunner.load("tiny", kv_cache_dtype=kind, max_batch=4, num_blocks=40, max_model_len=128)


def _run(runner: JaxRunner, forced: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Logits [3, 1 + STEPS, V] (after the prompt, then per decode step) and the tokens fed."""
    return teacher_forced(runner, PROMPTS, STEPS, BLOCKS_PER_SEQ, forced)


@pytest.fixture(scope="module")
def float_run() -> tuple[np.ndarray, np.ndarray]:
    return _run(_runner("auto"), None)


@pytest.fixture(scope="module", params=["int8", "fp8"])
def quant(request: pytest.FixtureRequest) -> JaxRunner:
    return _runner(request.param)


def test_kv_bytes_per_token() -> None:
    """Tiny model: 2 layers x 2 KV heads x 16 dims, K and V: 512 B in float32, 128 B of codes + 2 B of scales."""
    f32, i8, f8 = (_runner(k) for k in ("auto", "int8", "fp8"))
    assert f32.kv_bytes_per_token == f32.float_kv_bytes_per_token == 512
    assert i8.kv_bytes_per_token == f8.kv_bytes_per_token == 128 + 2 * 2 * 2 * 4 / 16
    assert i8.float_kv_bytes_per_token == 512
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        _runner("int4")


def test_quantized_cache_tracks_float_logits_and_greedy_tokens(float_run, quant) -> None:
    """>= 99% of teacher-forced steps pick the float runner's token; logits within 2% (int8) or 6% (fp8),
    relative L2, at every step. (Measured on the tiny model: 100% agreement for both; rel. error median /
    max 0.36% / 0.60% int8, 1.5% / 3.0% fp8: e4m3 keeps 3 mantissa bits, int8 ~7 over a block's range.)"""
    base_logits, tokens = float_run
    logits, _ = _run(quant, tokens)
    agree = float((logits.argmax(-1) == base_logits.argmax(-1)).mean())
    rel = np.linalg.norm(logits - base_logits, axis=-1) / np.linalg.norm(base_logits, axis=-1)
    print(f"{quant.kv_cache_dtype}: agreement {agree:.4f} over {rel.size} steps, "
          f"rel err median {np.median(rel):.2e} max {rel.max():.2e}")
    assert agree >= 0.99
    assert rel.max() < {"int8": 0.02, "fp8": 0.06}[quant.kv_cache_dtype]
    # One decode shape (batch bucket 4) and one prefill shape per prompt-length bucket, however many steps.
    assert quant.compile_count <= 4 <= quant.buckets.num_shapes


def test_prefix_reuse_with_quantized_cache_matches_a_fresh_prefill(quant) -> None:
    """A request reusing two cached full blocks (32 tokens) of another's prompt gets the logits and
    greedy tokens of the same prompt prefilled from scratch into fresh blocks."""
    shared = list(b"system: you are a helpful bot. " * 2)[:32]
    assert len(shared) == 32
    first, second = shared + list(b"question one?"), shared + list(b"what is two?")
    quant.logits(StepPlan(prefills=(SeqWork(1, first, 0, [24, 25, 26], GREEDY, 0, 0),), decodes=()))

    def generate(prefill: SeqWork, table: list[int]) -> tuple[np.ndarray, list[int]]:
        logits = quant.logits(StepPlan(prefills=(prefill,), decodes=()))
        out, toks = [logits[0]], [int(logits[0].argmax())]
        for step in range(8):
            work = SeqWork(2, [toks[-1]], len(second) + step, table, GREEDY, 0, step + 1)
            out.append(quant.logits(StepPlan(prefills=(), decodes=(work,)))[0])
            toks.append(int(out[-1].argmax()))
        return np.stack(out), toks

    cached = generate(SeqWork(2, second[32:], 32, [24, 25, 27, 28], GREEDY, 0, 0), [24, 25, 27, 28])
    fresh = generate(SeqWork(2, second, 0, [29, 30, 31, 32], GREEDY, 0, 0), [29, 30, 31, 32])
    assert cached[1] == fresh[1]
    np.testing.assert_allclose(cached[0], fresh[0], rtol=0, atol=1e-4)


def test_quantized_runner_samples_through_execute(quant) -> None:
    """``execute`` (the worker's path) samples the tokens the logits say, batched with ragged lengths."""
    tables = [[35, 36], [37, 38]]
    works = tuple(SeqWork(i, p, 0, tables[i], GREEDY, 0, 0) for i, p in enumerate(PROMPTS[:2]))
    outs = quant.execute(StepPlan(prefills=works, decodes=()))
    again = quant.logits(StepPlan(prefills=works, decodes=()))
    assert [o.token_id for o in outs] == list(again.argmax(-1))


def test_quantized_steps_write_the_cache_in_place(quant, request) -> None:
    """No compiled step copies or converts a whole layer's codes (the cache is donated, written where it lies).

    fp8 on CPU fails this: XLA:CPU has no float8 scatter, so each write copies
    the cache (as uint8 bytes, see ``write_quantized_kv``): use int8 on CPU.
    """
    if quant.kv_cache_dtype == "fp8":
        request.applymarker(pytest.mark.xfail(strict=True, reason="XLA:CPU has no float8 scatter"))
    from tests.inference.model.test_runner import _elements

    work = SeqWork(0, PROMPTS[0], 0, [39], GREEDY, 0, 0)
    quant.logits(StepPlan(prefills=(work,), decodes=()))
    quant.logits(StepPlan(prefills=(), decodes=(SeqWork(0, [1], len(PROMPTS[0]), [39], GREEDY, 0, 1),)))
    quant.execute(StepPlan(prefills=(), decodes=(SeqWork(0, [1], len(PROMPTS[0]) + 1, [39], GREEDY, 0, 2),)))
    codes_elems = quant._cache[0][0][0].size
    assert {k[0] for k in quant._execs} >= {"prefill", "decode", "decode_logits"}
    for key, exe in quant._execs.items():
        copied = [line for line in exe.as_text().split("ENTRY", 1)[1].splitlines()
                  if (" copy(" in line or "convert" in line.split("=", 1)[0])
                  and _elements(line.split("=", 1)[1]) == codes_elems]
        assert not copied, f"{key}: {copied[0].strip()[:160]}"


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_pallas_decode_kernel_reads_the_quantized_cache(kind) -> None:
    """The Pallas kernels (interpreted on CPU) get the codes and scales and give the reference's logits."""
    from inference.kernels.kernel_set import build_kernels

    prompt = list(b"hello pallas world, a longer prompt")
    got = {}
    for backend in ("reference", "pallas"):
        kernels = build_kernels(backend, kv_quant=kind, interpret=True)
        r = JaxRunner.load("tiny", kernels=kernels, kv_cache_dtype=kind, max_batch=2, num_blocks=16)
        pre = r.logits(StepPlan(prefills=(SeqWork(0, prompt, 0, [3, 5, 9], GREEDY, 0, 0),), decodes=()))
        dec = r.logits(StepPlan(prefills=(), decodes=(SeqWork(0, [7], len(prompt), [3, 5, 9], GREEDY, 0, 1),)))
        got[backend] = (pre, dec)
    for ref, pallas in zip(got["reference"], got["pallas"], strict=True):
        assert abs(ref - pallas).max() < 1e-4
