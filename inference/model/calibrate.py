"""GPTQ calibration: a model quantizes its own projections from its activations on random tokens.

How it works: ``sequences`` prompts of ``length`` uniformly random token ids
(a fixed seed, so a model always quantizes the same way) run through the
model layer by layer (:meth:`~inference.model.registry.Model.calibrate`: the
architecture knows its layers; this module knows GPTQ). Each projection's
input is captured and its Hessian ``X^T X`` accumulated; the projection is
then quantized with :func:`inference.kernels.gptq.gptq_quantize` and the
*quantized* projection is what the activations flow through to the next one
(the sequential order of the GPTQ paper: later layers are calibrated on the
inputs they will see when served).

Random tokens carry no language, but the calibration only needs the
second-moment structure of each projection's inputs (norm gains, which
features co-vary), which the model's own embeddings and layers produce.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from inference.kernels.gptq import gptq_quantize, hessian
from inference.kernels.quant import QuantizedWeightT, code_dtype
from inference.model.registry import Model

__all__ = ["CALIBRATION_SEED", "calibration_tokens", "quantize_projections_gptq"]

CALIBRATION_SEED = 20221031  # GPTQ's arXiv date; any fixed seed distinct from the tests' prompt seeds
Params = dict[str, Any]


def calibration_tokens(vocab_size: int, sequences: int = 8, length: int = 128,
                       seed: int = CALIBRATION_SEED) -> np.ndarray:
    """Uniformly random token ids ``[sequences, length]`` from a fixed seed."""
    return np.random.default_rng(seed).integers(0, vocab_size, (sequences, length), dtype=np.int32)


def quantize_projections_gptq(model: Model, params_t: Params, kind: str, *, head: bool = True,
                              tokens: np.ndarray | None = None) -> Params:
    """GPTQ-quantized copy of serving parameters (``model.serving_params``), calibrated on
    :func:`calibration_tokens` (or ``tokens``). The same layout as round-to-nearest quantization
    (``model.map_projections`` with ``quantize_weight_t``): a tied head gets its own quantized
    ``lm_head_t``; the embedding table stays float."""
    tokens = calibration_tokens(model.config.vocab_size) if tokens is None else tokens

    def quantize(w_t: Any, x: jax.Array) -> QuantizedWeightT:
        codes, scale = gptq_quantize(np.asarray(w_t, np.float32), hessian(np.asarray(x)), kind)
        return QuantizedWeightT(jnp.asarray(codes, code_dtype(kind)), jnp.asarray(scale))

    return model.calibrate(params_t, tokens, quantize, head=head)
