"""A roofline for a decode run: the least time any engine could take for the same steps on this machine.

Why: ``bench_decode`` compares us with ``transformers``; when a ratio target is
missed, the question is whether the engine or the machine is the limit. This
module answers it with two measured machine figures and a count of the work:

* ``peak_flops``: the best float32 matmul rate measured here (XLA and torch,
  several large shapes of the bench model, best of a few runs), with the
  thread count the run uses;
* ``peak_bandwidth``: the best memory read+write rate of a large copy
  (numpy and XLA);
* the work of each runner step, recorded from the real run: every prefill's
  and decode's token count and context, turned into matmul FLOPs (every
  projection on every real token, no padding; the LM head on each
  sequence's last token only), attention FLOPs (causal), and bytes (all
  weights read once per step, each token's K/V context read once, new K/V
  written once).

The floor of a step is ``max(flops / peak_flops, bytes / peak_bandwidth)``;
the floor of a run is the sum over its steps. Nothing an engine does on this
machine can beat it: it assumes no padding, no norms/RoPE/sampling/Python,
every matmul at the best rate seen, and perfect overlap of compute and memory
traffic. ``ceiling = t_baseline / floor`` is then the largest ratio any engine
could show against the measured baseline, and ``floor / t_ours`` is the
fraction of the roofline our engine reaches.

Pure counting lives in :func:`step_cost` (tested in
``tests/inference/test_roofline.py`` against hand-counted figures); only
:func:`measure_machine` touches the hardware.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["ModelShape", "Machine", "step_cost", "floor_seconds", "measure_machine", "Recorder"]


@dataclass(frozen=True, slots=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int = 4

    @classmethod
    def from_config(cls, cfg: dict[str, Any], dtype_bytes: int = 4) -> ModelShape:
        heads = cfg["num_attention_heads"]
        return cls(cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], heads,
                   cfg.get("num_key_value_heads", heads), cfg.get("head_dim", cfg["hidden_size"] // heads),
                   cfg["vocab_size"], dtype_bytes)

    @property
    def layer_matmul_params(self) -> int:
        """Weights one token multiplies by in one layer (q, k, v, o, gate, up, down)."""
        h, d = self.hidden, self.head_dim
        return h * d * (2 * self.heads + 2 * self.kv_heads) + 3 * h * self.intermediate

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def weight_bytes(self) -> int:
        """Bytes of every matrix a step multiplies by (the embedding table is only indexed)."""
        return (self.layers * self.layer_matmul_params + self.head_params) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one position, all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class Machine:
    peak_flops: float  # FLOP/s
    peak_bandwidth: float  # bytes/s


def step_cost(shape: ModelShape, prefills: Sequence[tuple[int, int]],
              decode_contexts: Sequence[int]) -> tuple[float, float]:
    """(FLOPs, bytes) of one step, at minimum.

    ``prefills``: (tokens run now, tokens already cached before them) per
    prefill; ``decode_contexts``: per decode, the context it attends to
    (cached tokens plus itself).
    """
    L, hq, d = shape.layers, shape.heads, shape.head_dim
    per_token = 2 * L * shape.layer_matmul_params
    flops = 0.0
    kv_tokens = 0  # K/V positions read or written
    for n, cached in prefills:
        flops += n * per_token + 2 * shape.head_params
        # causal attention: token j (0-based, after `cached`) sees cached + j + 1 keys; QK and PV each 2*d per key
        keys = n * cached + n * (n + 1) // 2
        flops += 4 * L * hq * d * keys
        kv_tokens += cached + 2 * n  # read the cached prefix once, write and read the new tokens once
    for ctx in decode_contexts:
        flops += per_token + 2 * shape.head_params + 4 * L * hq * d * ctx
        kv_tokens += ctx + 1
    moved = shape.weight_bytes + kv_tokens * shape.kv_bytes_per_token if (prefills or decode_contexts) else 0
    return flops, float(moved)


def floor_seconds(shape: ModelShape, machine: Machine,
                  steps: Sequence[tuple[Sequence[tuple[int, int]], Sequence[int]]]) -> float:
    """The sum over steps of ``max(compute time, memory time)`` at the machine's peaks."""
    total = 0.0
    for prefills, decodes in steps:
        flops, moved = step_cost(shape, prefills, decodes)
        total += max(flops / machine.peak_flops, moved / machine.peak_bandwidth)
    return total


class Recorder:
    """Wraps a runner; records each executed step as ``(prefills, decode_contexts)`` for :func:`floor_seconds`."""

    def __init__(self, runner: Any) -> None:
        self._runner = runner
        self.steps: list[tuple[list[tuple[int, int]], list[int]]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def execute(self, plan: Any) -> Any:
        self.steps.append(([(len(w.token_ids), w.start_pos) for w in plan.prefills],
                           [w.start_pos + 1 for w in plan.decodes]))
        return self._runner.execute(plan)


def _best(fn: Any, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_machine(shape: ModelShape, torch: Any = None, repeats: int = 5) -> Machine:
    """Best float32 matmul rate (XLA and torch) over the model's projection shapes, and best copy bandwidth."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    best_flops = 0.0
    dot = jax.jit(lambda a, b: a @ b)
    for rows in (256, 1024):
        for k, n in ((shape.hidden, shape.intermediate * 2), (shape.intermediate, shape.hidden),
                     (shape.hidden, shape.vocab)):
            x = rng.standard_normal((rows, k), dtype=np.float32)
            w = rng.standard_normal((k, n), dtype=np.float32)
            xj, wj = jnp.asarray(x), jnp.asarray(w)
            t = _best(lambda: dot(xj, wj).block_until_ready(), repeats)  # noqa: B023
            best_flops = max(best_flops, 2 * rows * k * n / t)
            if torch is not None:
                xt, wt = torch.from_numpy(x), torch.from_numpy(w)
                t = _best(lambda: xt @ wt, repeats)  # noqa: B023
                best_flops = max(best_flops, 2 * rows * k * n / t)
    src = np.ones(64 << 20, dtype=np.float32)  # 256 MiB: far past any cache
    dst = np.empty_like(src)
    best_bw = 2 * src.nbytes / _best(lambda: np.copyto(dst, src), repeats)
    srcj = jnp.asarray(src)
    copy = jax.jit(lambda a: a + 1.0)
    best_bw = max(best_bw, 2 * src.nbytes / _best(lambda: copy(srcj).block_until_ready(), repeats))
    return Machine(best_flops, best_bw)
