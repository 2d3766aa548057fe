"""GPTQ calibration: the model quantizes its own projections from activations on random tokens.

How it works: ``sequences`` prompts of ``length`` uniformly random token ids
(a fixed seed, so a model always quantizes the same way) run through the
model layer by layer, with the dense causal attention of a prefill. Each
projection's input is captured and its Hessian ``X^T X`` accumulated; the
projection is then quantized with :func:`inference.kernels.gptq.gptq_quantize`
and the *quantized* projection is what the activations flow through to the
next one (the sequential order of the GPTQ paper: later layers are
calibrated on the inputs they will see when served). Order per layer:
``wqkv`` (input: the attention norm), ``wo`` (the attention output),
``w_gate_up`` (the MLP norm), ``w_down`` (``silu(gate) * up``); then the
head (the final norm) unless ``head=False``.

Random tokens carry no language, but the calibration only needs the
second-moment structure of each projection's inputs (norm gains, which
features co-vary), which the model's own embeddings and layers produce.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from inference.kernels import reference
from inference.kernels.gptq import gptq_quantize, hessian
from inference.kernels.quant import QuantizedWeightT, code_dtype
from inference.model import llama
from inference.model.config import LlamaConfig

__all__ = ["CALIBRATION_SEED", "calibration_tokens", "quantize_projections_gptq"]

CALIBRATION_SEED = 20221031  # GPTQ's arXiv date; any fixed seed distinct from the tests' prompt seeds
Params = dict[str, Any]


def calibration_tokens(cfg: LlamaConfig, sequences: int = 8, length: int = 128,
                       seed: int = CALIBRATION_SEED) -> np.ndarray:
    """Uniformly random token ids ``[sequences, length]`` from a fixed seed."""
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (sequences, length), dtype=np.int32)


def _quantize(w_t: Any, x: jax.Array, kind: str) -> QuantizedWeightT:
    codes, scale = gptq_quantize(np.asarray(w_t, np.float32), hessian(np.asarray(x)), kind)
    return QuantizedWeightT(jnp.asarray(codes, code_dtype(kind)), jnp.asarray(scale))


def _attention(lp: dict[str, Any], x: jax.Array, cfg: LlamaConfig, kind: str) -> tuple[jax.Array, dict[str, Any]]:
    """Quantize ``wqkv`` then ``wo`` of one layer on their inputs; the layer's attention residual output."""
    b, t = x.shape[:2]
    h = llama._rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    lp = {**lp, "wqkv_t": _quantize(lp["wqkv_t"], h, kind)}
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    q, k, v = llama._qkv(x, lp, cfg, positions, jnp.asarray(llama.rope_inv_freq(cfg)))
    zeros, lens = jnp.zeros((b,), jnp.int32), jnp.full((b,), t, jnp.int32)
    o = reference.prefill_attention(q, k, v, zeros, lens, scale=cfg.head_dim ** -0.5).reshape(b, t, -1)
    lp["wo_t"] = _quantize(lp["wo_t"], o, kind)
    return x + llama._linear(o, lp, "wo"), lp


def _mlp(lp: dict[str, Any], x: jax.Array, cfg: LlamaConfig, kind: str) -> tuple[jax.Array, dict[str, Any]]:
    """Quantize ``w_gate_up`` then ``w_down`` of one layer on their inputs; the layer's output."""
    h = llama._rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    lp = {**lp, "w_gate_up_t": _quantize(lp["w_gate_up_t"], h, kind)}
    gate, up = jnp.split(llama._linear(h, lp, "w_gate_up"), 2, axis=-1)
    a = jax.nn.silu(gate) * up
    lp["w_down_t"] = _quantize(lp["w_down_t"], a, kind)
    return x + llama._linear(a, lp, "w_down"), lp


def quantize_projections_gptq(params_t: Params, cfg: LlamaConfig, kind: str, *, head: bool = True,
                              tokens: np.ndarray | None = None) -> Params:
    """GPTQ-quantized copy of transposed parameters (``llama.transpose_weights``), calibrated on
    :func:`calibration_tokens` (or ``tokens``). The same layout as ``llama.quantize_projections``:
    a tied head gets its own quantized ``lm_head_t``; the embedding table stays float."""
    tokens = calibration_tokens(cfg) if tokens is None else tokens
    x = params_t["embed"][jnp.asarray(tokens)]
    layers = []
    for lp in params_t["layers"]:
        x, lp = _attention(lp, x, cfg, kind)
        x, lp = _mlp(lp, x, cfg, kind)
        layers.append(lp)
    out = {**params_t, "layers": layers}
    if head:
        head_t = params_t["lm_head_t"] if "lm_head_t" in params_t else params_t["embed"]
        out["lm_head_t"] = _quantize(head_t, llama._rms_norm(x, params_t["norm"], cfg.rms_norm_eps), kind)
    return out
