"""Quantization quality on real model code: greedy agreement and logits error over 256 decode steps.

Method: the float model (its own decode step, ``Model.decode``, with the
reference kernels: ``quant_harness``) decodes 4 prompts greedily for 256 steps. Each quantized variant is then run
*teacher-forced* on the baseline's tokens, so every step compares logits for
the same context; a step "agrees" when its argmax equals the baseline token.
(Free-running agreement is not used: after the first flip the two runs decode
different texts, so it measures where the first near-tie falls.) Logits error
is ``||l_q - l|| / ||l||`` per step; the bound is on the max over all steps.

Models: the built-in ``tiny`` model and a random Llama checkpoint in HF format
(``quant_harness.write_random_llama``: hidden 256, 8 query / 2 KV heads, head
dim 64) with fan-in init, N(0, 1/fan_in). HF's N(0, 0.02) is meant to
approximate that at hidden ~2500; at hidden 256 it is 3x smaller and the
logits are nearly flat (std 0.3, median top-2 gap 0.05): there even running
the float model in bf16, with no quantization, changes 2.9% of greedy steps
(``tests/bench/bench_quant_quality.py --hf-init``).

Measured (CPU, float32 baseline), asserted with some margin:
  tiny:  KV int8 100% / fp8 100%, weights int8 100% / fp8 99.9% of steps agree.
  llama: KV int8 99.6%, KV fp8 98.3%, weights int8 98.4% (group-wise g=64:
  98.8%). The issue's 99% target holds for int8 KV. fp8 KV and int8 weights
  fall short on this random checkpoint and are asserted at the levels they
  reach: every flip is at a near-tie (baseline top-2 gap median 0.007 vs 0.22
  over all steps), and over 4096 steps the bench finds bf16 weights and
  activations alone (no quantization) agree on only 99.0% of steps, against
  98.1% (KV fp8) and 98.5% (weights int8). fp8 KV is at e4m3's floor: per-
  token scales instead of per-block ones do not lower its error.
  GPTQ (``inference.kernels.gptq``, same int8 codes + per-channel scales,
  calibrated on 8 x 128 random tokens through the float-then-quantized
  layers, 1% dampening) does not close the gap: on these 4 x 256 steps 98.05%
  (20 flips, RTN 16), logits rel error median 0.0100 max 0.0155 (RTN 0.0099 /
  0.0162). This checkpoint's projection inputs are close to isotropic (random
  fan-in weights, unit norm gains), so ``H = X^T X`` is near a multiple of
  the identity and GPTQ's error feedback has little to exploit; on
  correlated, unequally scaled inputs it cuts the output error to ~0.79x of
  RTN's (``tests/inference/kernels/test_gptq.py``).
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from inference.kernels.quant import kv_read_bytes  # noqa: E402
from inference.weights import load_hf_dir, load_model  # noqa: E402
from tests.inference.kernels.quant_harness import (  # noqa: E402
    compare,
    greedy_decode,
    quantize_params,
    write_random_llama,
)

pytestmark = pytest.mark.slow
STEPS = 256


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):
    tiny = load_model("tiny")
    llama = load_hf_dir(write_random_llama(tmp_path_factory.mktemp("llama") / "random-llama"))
    out = {}
    for name, m, vocab, seed in (("tiny", tiny, 256, 0), ("llama", llama, 1000, 1)):
        prompts = np.random.default_rng(seed).integers(0, vocab, (4, 8))
        base = greedy_decode(m.model, m.params, prompts, STEPS)
        out[name] = (m, prompts, base)
    return out


def test_the_served_kernels_give_the_reference_run(models) -> None:
    """The figures below are measured with the reference kernels; the ones a worker serves with here
    (``auto``) pick the same greedy tokens at every one of the 256 steps, logits within 1e-4."""
    for m, prompts, base in models.values():
        run = greedy_decode(m.model, m.params, prompts, STEPS, forced=base.tokens, kernels="auto")
        np.testing.assert_array_equal(run.argmax, base.tokens)
        assert np.abs(run.logits - base.logits).max() < 1e-4


CASES = [
    # model, what, kind, min agreement, max logits rel error
    ("tiny", "kv", "int8", 0.99, 0.01),
    ("tiny", "kv", "fp8", 0.99, 0.03),
    ("tiny", "weights", "int8", 0.99, 0.02),
    ("tiny", "weights", "fp8", 0.99, 0.06),
    ("llama", "kv", "int8", 0.99, 0.015),
    ("llama", "kv", "fp8", 0.97, 0.035),
    ("llama", "weights", "int8", 0.975, 0.025),
    ("llama", "weights/g64", "int8", 0.975, 0.02),
]


@pytest.mark.parametrize("model,what,kind,min_agree,max_rel", CASES)
def test_quantized_decoding_quality(models, model, what, kind, min_agree, max_rel) -> None:
    m, prompts, base = models[model]
    if what == "kv":
        run = greedy_decode(m.model, m.params, prompts, STEPS, kv_kind=kind, forced=base.tokens)
    else:  # "weights" (one scale per output channel) or "weights/g<N>" (group-wise, N input rows)
        group = int(what.split("/g")[1]) if "/g" in what else None
        run = greedy_decode(m.model, quantize_params(m.params, kind, group), prompts, STEPS, forced=base.tokens)
    c = compare(base, run)
    rel = float(c["rel"].max())
    print(f"\n{model} {what} {kind}: greedy agreement {c['agree']:.2%} of {c['steps']} steps, logits rel error "
          f"max {rel:.4f} median {np.median(c['rel']):.4f}; flipped steps' top-2 gaps "
          f"[{', '.join(f'{g:.4f}' for g in c['flip_gaps'])}] (median gap of all steps {np.median(c['gap']):.3f})")
    assert c["agree"] >= min_agree
    assert 0 < rel < max_rel
    # Any flip is a near-tie: its baseline top-2 gap is among the smallest quarter of all steps'.
    assert (c["flip_pctile"] < 0.25).all()


def test_kv_bytes_read_per_decode_step(models) -> None:
    """Bytes of KV one decode step reads at the end of the run, per model, float vs quantized."""
    for name, (m, prompts, _) in models.items():
        cfg = m.config
        lens = [prompts.shape[1] + STEPS] * prompts.shape[0]
        kw = dict(block_size=16, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim)
        layers = cfg.num_hidden_layers
        bf16 = layers * kv_read_bytes(lens, dtype="bfloat16", **kw)
        f32 = layers * kv_read_bytes(lens, dtype="float32", **kw)
        q8 = layers * kv_read_bytes(lens, dtype="int8", quantized=True, **kw)
        print(f"\n{name}: KV bytes read per decode step (batch {len(lens)}, context {lens[0]}): "
              f"float32 {f32}, bfloat16 {bf16}, int8/fp8 {q8} "
              f"(saves {1 - q8 / bf16:.1%} vs bf16, {1 - q8 / f32:.1%} vs float32)")
        assert q8 < 0.55 * bf16
