"""Mistral's sliding window through the engine and every CPU kernel set, against transformers.

The engine test runs prompts longer than the window to generations past it, three at a time, in
chunked-prefill steps, in a KV cache too small to hold the three whole: the window's bookkeeping
(blocks released as they fall out of every window) is what lets them run without a preemption, and
the greedy tokens are transformers' ``generate``'s. The kernel test holds the xla and reference
attention (the native one: test_parity.py) to transformers' logits for a prefill and a few decodes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from inference.engine import Engine, EngineConfig  # noqa: E402
from inference.kernels.kernel_set import build_kernels  # noqa: E402
from inference.kernels.paged_cache import init_kv_cache  # noqa: E402
from inference.model.jax_runner import JaxRunner  # noqa: E402
from inference.runner import SeqWork, StepPlan  # noqa: E402
from inference.tokenizer import load_tokenizer  # noqa: E402
from inference.weights import load_model  # noqa: E402
from tests.inference.doubles import Collector, run_until_done  # noqa: E402
from tests.integration.hf_checkpoints import write_checkpoint  # noqa: E402
from transport.messages import SamplingParams  # noqa: E402

WINDOW = 8
CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1, sliding_window=WINDOW,
              tie_word_embeddings=False)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    path = tmp_path_factory.mktemp("mistral-window")
    return write_checkpoint(path, "mistral", CONFIG, seed=3), path


def hf_generate(hf: object, prompt: list[int], n: int) -> list[int]:
    hf.generation_config.eos_token_id = None  # type: ignore[attr-defined]
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),  # type: ignore[attr-defined]
                          do_sample=False, max_new_tokens=n, pad_token_id=0)
    return [int(t) for t in out[0, len(prompt):]]


def test_the_engine_serves_past_the_window_in_a_cache_that_holds_only_the_windows(mistral) -> None:
    """Block size 4: a sequence decoding holds at most 3 blocks (8 keys: 2 blocks, 3 when they straddle
    one) plus the one it writes. The three sequences (41, 37 and 45 tokens at the end) would need 33
    blocks whole; the cache has 20, so without the releases the engine would have to preempt."""
    hf, path = mistral
    rng = np.random.default_rng(0)
    vocab = hf.config.vocab_size  # type: ignore[attr-defined]
    prompts = [rng.integers(3, vocab, size=n).tolist() for n in (21, 17, 25)]
    n_new = 20
    expected = [hf_generate(hf, p, n_new) for p in prompts]
    runner = JaxRunner.load(str(path), block_size=4, num_blocks=20, max_batch=4, max_prefill_batch=2,
                            step_tokens=12)
    assert runner.sliding_window == WINDOW and runner.kernels.window == WINDOW
    eng = Engine(runner, load_tokenizer(str(path)), EngineConfig(max_batch=4, step_tokens=12, prefill_batch=2))
    for i, p in enumerate(prompts):
        eng.add(i, p, SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True), 0.0)
    col = Collector()
    run_until_done(eng, col)
    assert [col.tokens(i) for i in range(3)] == expected
    assert eng.num_preemptions == 0 and eng.kv.window_releases > 0
    assert eng.kv.num_free == 20


@pytest.mark.parametrize("attention", ["xla", "reference"])
def test_every_cpu_kernel_set_applies_the_window(mistral, attention: str) -> None:
    """Logits of a 19-token prefill (positions past the window) and of 4 decodes equal transformers'
    within the parity tests' bound."""
    hf, path = mistral
    runner = JaxRunner.load(str(path), attention=attention, block_size=4, num_blocks=16, max_batch=1,
                            max_prefill_batch=1)
    assert (runner.kernels.attention, runner.kernels.window) == (attention, WINDOW)
    seq = np.random.default_rng(1).integers(3, hf.config.vocab_size, size=19).tolist()  # type: ignore[attr-defined]
    table = list(range(6))
    plan = StepPlan(prefills=(SeqWork(0, seq, 0, table, SamplingParams(temperature=0.0), 0, 0),), decodes=())
    for step in range(5):
        with torch.no_grad():
            want = hf(torch.tensor([seq])).logits[0, -1].numpy()  # type: ignore[operator]
        got = runner.logits(plan)[0]
        np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
        nxt = int(np.argmax(want))
        plan = StepPlan(prefills=(), decodes=(SeqWork(0, [nxt], len(seq), table, SamplingParams(temperature=0.0),
                                                      0, step + 1),))
        seq = seq + [nxt]


def test_a_kernel_set_without_the_window_is_refused(mistral) -> None:
    """Neither the runner nor the model runs a windowed model on attention over the whole context."""
    _, path = mistral
    loaded = load_model(str(path))
    with pytest.raises(ValueError, match=r"window None; this runner is float32 with float, window 8"):
        JaxRunner(loaded, kernels=build_kernels("native"))
    model, whole = loaded.model, build_kernels("xla")
    cache = init_kv_cache(2, 2, 16, 4, 4, np.float32)
    one = np.zeros((1, 1), np.int32)
    with pytest.raises(ValueError, match="the kernel set's attention has window None, the model 8"):
        model.prefill(model.serving_params(loaded.params), cache, one, one, one, one, one[0], one[0] + 1, one[0],
                      kernels=whole)
