"""Parity with transformers on tiny random checkpoints of every registered architecture (CPU, float32).

Each checkpoint is written by transformers itself (``save_pretrained``, safetensors)
and loaded with our loader, which picks the architecture by ``model_type``. Block
size 4 and shuffled block ids make every sequence span several non-contiguous KV
blocks. A new architecture adds its transformers classes to ``HF_CLASSES`` and a
config or two to ``CONFIGS`` (docs/ARCHITECTURE.md, "How to add a model architecture").
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from inference.model.jax_runner import JaxRunner  # noqa: E402
from inference.model.registry import ARCHITECTURES  # noqa: E402
from inference.runner import SeqWork, StepPlan  # noqa: E402
from transport.messages import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

# model_type -> transformers' (config class, model class)
HF_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
}
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=256, initializer_range=0.1)
CONFIGS = {  # name: (model_type, config)
    "gqa-llama3-untied": ("llama", dict(BASE, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=500000.0,
                                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 32})),
    "mha-tied": ("llama", dict(BASE, num_key_value_heads=4, tie_word_embeddings=True, rope_theta=10000.0)),
    # a window wider than every sequence here, and one that most prompts and generations here outgrow
    "mistral-gqa-window": ("mistral", dict(BASE, num_key_value_heads=2, tie_word_embeddings=False,
                                           rope_theta=1000000.0, sliding_window=64)),
    "mistral-window-7": ("mistral", dict(BASE, num_key_value_heads=2, tie_word_embeddings=True, sliding_window=7)),
    # q|k|v biases; tied and untied heads
    "qwen2-gqa-tied": ("qwen2", dict(BASE, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0)),
    "qwen2-mha-untied": ("qwen2", dict(BASE, num_key_value_heads=4, tie_word_embeddings=False)),
    # per-head q/k norms, a head_dim that is not hidden_size / heads
    "qwen3-gqa-tied": ("qwen3", dict(BASE, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                                     rope_theta=1000000.0)),
    "qwen3-untied": ("qwen3", dict(BASE, num_key_value_heads=1, tie_word_embeddings=False)),
}
GREEDY = SamplingParams(temperature=0.0, top_logprobs=5)
ATOL = 2e-4


class Blocks:
    """Hands out shuffled, never reused block ids so sequences never share by accident."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self._free = list(np.random.default_rng(seed).permutation(n))

    def take(self, n: int) -> list[int]:
        out, self._free = self._free[:n], self._free[n:]
        assert len(out) == n, "test ran out of KV blocks"
        return [int(b) for b in out]


def test_every_registered_architecture_has_a_parity_config():
    assert set(HF_CLASSES) == set(ARCHITECTURES) == {model_type for model_type, _ in CONFIGS.values()}


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request, tmp_path_factory):
    torch.manual_seed(1234)
    model_type, config = CONFIGS[request.param]
    config_class, model_class = HF_CLASSES[model_type]
    hf = model_class(config_class(**config)).eval()
    with torch.no_grad():  # transformers makes norms ones and biases zeros, which would hide a missing one
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (0.0 if name.endswith("bias") else 1.0))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    runner = JaxRunner.load(str(path), block_size=4, num_blocks=128, max_batch=4, max_prefill_batch=4)
    assert runner.model.model_type == model_type
    return hf, runner, Blocks(128)


def hf_logits(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


def prompts(n: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, n, size=length).tolist() for length in lengths]


def test_prefill_and_decode_logits_match_batched_different_lengths(model):
    hf, runner, blocks = model
    seqs = prompts(128, [5, 11, 17], seed=1)
    steps = 4
    tables = [blocks.take(-(-(len(s) + steps) // 4)) for s in seqs]
    plan = StepPlan(prefills=tuple(SeqWork(i, s, 0, tables[i], GREEDY, 0, 0) for i, s in enumerate(seqs)),
                    decodes=())
    ours = runner.logits(plan)
    for i, s in enumerate(seqs):
        np.testing.assert_allclose(ours[i], hf_logits(hf, s)[-1], atol=ATOL, rtol=1e-4)
    for _ in range(steps):
        nxt = [int(np.argmax(hf_logits(hf, s)[-1])) for s in seqs]
        plan = StepPlan(prefills=(), decodes=tuple(
            SeqWork(i, [t], len(s), tables[i], GREEDY, 0, 1) for i, (s, t) in enumerate(zip(seqs, nxt, strict=True))))
        seqs = [s + [t] for s, t in zip(seqs, nxt, strict=True)]
        ours = runner.logits(plan)
        for i, s in enumerate(seqs):
            np.testing.assert_allclose(ours[i], hf_logits(hf, s)[-1], atol=ATOL, rtol=1e-4)


def test_greedy_generation_matches_transformers_generate(model):
    hf, runner, blocks = model
    seqs = prompts(128, [3, 9, 14], seed=2)
    n_new = 12
    hf.generation_config.eos_token_id = None
    expected = []
    for s in seqs:
        with torch.no_grad():
            out = hf.generate(torch.tensor([s]), attention_mask=torch.ones(1, len(s), dtype=torch.long),
                              do_sample=False, max_new_tokens=n_new, pad_token_id=0)
        expected.append(out[0, len(s):].tolist())
    tables = [blocks.take(-(-(len(s) + n_new) // 4)) for s in seqs]
    gen: list[list[int]] = [[] for _ in seqs]
    outs = runner.execute(StepPlan(
        prefills=tuple(SeqWork(i, s, 0, tables[i], GREEDY, 0, 0) for i, s in enumerate(seqs)), decodes=()))
    for _ in range(n_new):
        for o in outs:
            full = seqs[o.seq_id] + gen[o.seq_id]
            ref = torch.log_softmax(torch.tensor(hf_logits(hf, full)[-1]), -1).numpy()
            assert o.logprob == pytest.approx(float(ref[o.token_id]), abs=1e-4)
            assert o.top_ids[0] == o.token_id and len(o.top_ids) == 5
            np.testing.assert_allclose(o.top_logprobs, np.sort(ref)[::-1][:5], atol=1e-4)
            gen[o.seq_id].append(o.token_id)
        if len(gen[0]) == n_new:
            break
        outs = runner.execute(StepPlan(prefills=(), decodes=tuple(
            SeqWork(i, [gen[i][-1]], len(s) + len(gen[i]) - 1, tables[i], GREEDY, 0, len(gen[i]))
            for i, s in enumerate(seqs))))
    assert gen == expected


def test_prefix_cached_prefill_equals_full_prefill(model):
    hf, runner, blocks = model
    first, = prompts(128, [20], seed=3)
    second = first[:16] + prompts(128, [6], seed=4)[0]
    shared = blocks.take(5)
    runner.logits(StepPlan(prefills=(SeqWork(0, first, 0, shared, GREEDY, 0, 0),), decodes=()))
    # The second sequence reuses the 4 full blocks (16 tokens) of the first; only 6 tokens run.
    table = shared[:4] + blocks.take(2)
    cached = runner.logits(StepPlan(prefills=(SeqWork(1, second[16:], 16, table, GREEDY, 0, 0),), decodes=()))
    full = runner.logits(StepPlan(prefills=(SeqWork(2, second, 0, blocks.take(6), GREEDY, 0, 0),), decodes=()))
    np.testing.assert_allclose(cached[0], full[0], atol=1e-5)
    np.testing.assert_allclose(cached[0], hf_logits(hf, second)[-1], atol=ATOL, rtol=1e-4)


def test_bfloat16_is_close_to_float32(model, tmp_path):
    hf, runner, blocks = model
    seq, = prompts(128, [10], seed=5)
    path = tmp_path / "ckpt"
    hf.save_pretrained(path, safe_serialization=True)
    bf = JaxRunner.load(str(path), dtype="bfloat16", block_size=4, num_blocks=8, max_batch=1)
    got = bf.logits(StepPlan(prefills=(SeqWork(0, seq, 0, [0, 1, 2], GREEDY, 0, 0),), decodes=()))[0]
    ref = hf_logits(hf, seq)[-1]
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max() + 0.05
