"""``gpu_kernels.py``'s whole-model checks: chunked prefill's mixed pass and a tensor-parallel step.

Both build a small random Llama (``_config``) with the kernel set the platform's worker builds
(``--smoke``: the Pallas kernels interpreted on CPU, tiny shapes) and check logits against the
same model run the plain way (relative L2, the bench's ``check``), then time the steps. No targets:
they say whether the paths compile and agree on the lent device, and what they cost there.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from inference.kernels.autotune import Autotuner, time_call
from inference.kernels.kernel_set import KernelSet, build_kernels, current_platform
from inference.kernels.paged_cache import init_kv_cache
from inference.model.config import LlamaConfig
from inference.model.jax_runner import JaxRunner
from inference.model.llama import Llama
from inference.model.tensor_parallel import Layout, ShardedModel, make_mesh, place, shard_params
from inference.runner import SeqWork, StepPlan
from inference.weights import LoadedModel
from transport.messages import SamplingParams

__all__ = ["chunked_prefill", "sharded_step"]

GREEDY = SamplingParams(temperature=0.0)
BOUND = 2e-2  # bf16 activations, float32 accumulation: the bench's other model-free checks use the same


def _config(smoke: bool) -> LlamaConfig:
    if smoke:
        return LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
    return LlamaConfig(vocab_size=8192, hidden_size=2048, intermediate_size=5632, num_hidden_layers=2,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=128, max_position_embeddings=8192)


def _kernels(bench: Any, dtype: Any) -> KernelSet:
    if bench.interpret:
        return build_kernels("pallas", dtype=dtype, interpret=True, tuner=Autotuner(enabled=False))
    return build_kernels("auto", dtype=dtype, tuner=bench.tuner)


def _loaded(cfg: LlamaConfig, dtype: Any) -> LoadedModel:
    model = Llama(cfg)
    return LoadedModel("bench", model, model.load_params(model.random_hf_weights(0).__getitem__, dtype), (0,))


def chunked_prefill(bench: Any, dtype: Any) -> None:
    """Decodes of ``n`` streams and a long prompt's chunks, one mixed pass each, against both alone."""
    smoke = bench.interpret
    cfg = _config(smoke)
    n, short, long, chunk = (2, 12, 40, 16) if smoke else (16, 256, 2048, 512)
    bs, width = 16, -(-(long + 64) // 16)
    runner = JaxRunner(_loaded(cfg, dtype), block_size=bs, num_blocks=(2 * n + 2) * width, max_batch=n,
                       max_model_len=width * bs, max_prefill_batch=1, step_tokens=chunk,
                       kernels=_kernels(bench, dtype))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, cfg.vocab_size, short).tolist() for _ in range(n)]
    prompt = rng.integers(0, cfg.vocab_size, long).tolist()
    tables = {(side, i): list(range((2 * i + side) * width, (2 * i + side + 1) * width)) for i in range(n + 1)
              for side in (0, 1)}  # side 0: run alone; 1: mixed

    def decodes(side: int, step: int, toks: list[int]) -> tuple[SeqWork, ...]:
        return tuple(SeqWork(i, [toks[i]], short + step, tables[side, i], GREEDY, 0, step + 1) for i in range(n))

    for side in (0, 1):
        runner.logits(StepPlan(tuple(SeqWork(i, p, 0, tables[side, i], GREEDY, 0, 0) for i, p in enumerate(prompts)),
                               ()))
    whole = runner.logits(StepPlan((SeqWork(n, prompt, 0, tables[0, n], GREEDY, 0, 0),), ()))[0]
    step_chunk = chunk - n
    cuts = [0, step_chunk // 2 + 3, *range(step_chunk // 2 + 3 + step_chunk, long, step_chunk), long]  # mid-block
    toks = [1] * n
    gots, refs = [], []
    for step, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
        ref = runner.logits(StepPlan((), decodes(0, step, toks)))
        got = runner.logits(StepPlan((SeqWork(n, prompt[a:b], a, tables[1, n], GREEDY, 0, 0),), decodes(1, step, toks)))
        gots.append(got[1:])
        refs.append(ref)
        toks = [int(t) for t in ref.argmax(-1)]
    print(f"\nchunked prefill: {n} decodes + a {long}-token prompt in {len(cuts) - 1} chunks of <= {step_chunk} "
          f"(step_tokens {chunk}), {jnp.dtype(dtype).name}, {runner.kernels.attention} kernels")
    bench.check("mixed pass: the decodes' logits", np.stack(gots), np.stack(refs), BOUND)
    bench.check("chunked prompt: its last logits vs whole", got[0], whole, BOUND)
    step = len(cuts)
    mid = SeqWork(n, prompt[long // 2: long // 2 + step_chunk], long // 2, tables[1, n], GREEDY, 0, 0)
    t_dec = time_call(lambda: runner.execute(StepPlan((), decodes(1, step, toks))), iters=bench.iters)
    t_chunk = time_call(lambda: runner.execute(StepPlan((mid,), ())), iters=bench.iters)
    t_mixed = time_call(lambda: runner.execute(StepPlan((mid,), decodes(1, step, toks))), iters=bench.iters)
    print(f"  decode step {t_dec * 1e3:.3f} ms, chunk of {step_chunk} alone {t_chunk * 1e3:.3f} ms, mixed pass "
          f"{t_mixed * 1e3:.3f} ms ({t_mixed / (t_dec + t_chunk):.2f} of the two apart)")


def sharded_step(bench: Any, dtype: Any) -> None:
    """Prefill then decode under ``shard_map`` over every local device, against the one-device model."""
    cfg = _config(bench.interpret)
    tp = len(jax.local_devices())
    while Layout(tp, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                 cfg.intermediate_size).problem():
        tp -= 1
    lay = Layout.of(cfg, tp)
    model, ks = Llama(cfg), _kernels(bench, dtype)
    params = model.serving_params(_loaded(cfg, dtype).params)
    b, t, bs = (2, 16, 16) if bench.interpret else (8, 512, 16)
    width = 2 * t // bs
    cache = init_kv_cache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, b * width, bs, dtype)
    mesh = make_mesh(tp, jax.local_devices())
    sharded_params, specs = shard_params(params, lay, mesh)
    wide = init_kv_cache(cfg.num_hidden_layers, lay.cache_kv_heads, cfg.head_dim, b * width, bs, dtype)
    sm = ShardedModel.of(model, lay, mesh, specs, wide)
    sharded_cache = place(wide, sm.cache_specs, mesh)
    rng = np.random.default_rng(4)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    tables = jnp.arange(b * width, dtype=jnp.int32).reshape(b, width)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    slots = tables[:, :1] * bs + pos
    zeros, lens, last = jnp.zeros(b, jnp.int32), jnp.full(b, t, jnp.int32), jnp.full(b, t - 1, jnp.int32)
    pre = (tokens, pos, slots, tables, zeros, lens, last)
    dec = (tokens[:, 0], lens, tables[:, 0] * bs + t, tables, lens + 1)
    runs = {name: _steps(m, p, c, ks, pre, dec, bench.iters)
            for name, m, p, c in (("one device", model, params, cache), (f"TP={tp}", sm, sharded_params, sharded_cache))}
    print(f"\nsharded step: TP={tp} over {len(jax.local_devices())} local devices "
          f"({current_platform()}), {jnp.dtype(dtype).name}, {ks.attention} kernels, prefill B{b} T{t}, decode B{b}")
    (l1, d1, p1, q1), (l2, d2, p2, q2) = runs.values()
    bench.check(f"TP={tp} prefill logits", l2, l1, BOUND)
    bench.check(f"TP={tp} decode logits", d2, d1, BOUND)
    print(f"  prefill {p1 * 1e3:.3f} ms one device, {p2 * 1e3:.3f} ms TP={tp}; decode {q1 * 1e3:.3f} / "
          f"{q2 * 1e3:.3f} ms")


def _steps(m: Any, p: Any, c: Any, ks: KernelSet, pre: tuple[Any, ...], dec: tuple[Any, ...],
           iters: int) -> tuple[Any, Any, float, float]:
    """Prefill logits, then one decode step's, through ``m`` (a model or a sharded one), and their times."""
    prefill = jax.jit(lambda p, c, *a: m.prefill(p, c, *a, kernels=ks))
    decode = jax.jit(lambda p, c, *a: m.decode(p, c, *a, kernels=ks))
    logits, filled = prefill(p, c, *pre)
    dlogits, _ = decode(p, filled, *dec)
    t_pre = time_call(lambda: prefill(p, c, *pre)[0], iters=iters)
    t_dec = time_call(lambda: decode(p, filled, *dec)[0], iters=iters)
    return logits, dlogits, t_pre, t_dec
