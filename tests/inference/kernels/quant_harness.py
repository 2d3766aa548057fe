"""Greedy decoding with a quantized KV cache and/or quantized weights, for quality tests.

The model's own decode step (``Model.decode``) runs every token: over a float
cache, or over an int8 / fp8 one (quantized when written, dequantized in
attention), with float or weight-only quantized projections (``[in, out]``
:class:`~inference.kernels.quant.QuantizedWeight`, per channel or group-wise).
The kernels are the reference set by default: the ground truth's attention,
the same arithmetic on every platform, so a quality figure measures the
quantization and nothing else; the tests check that the kernels a worker
serves with give the same run.

Prompts are fed one token per step (positions 0..P-1), then ``steps`` greedy
tokens follow. A quantized run can be *teacher-forced* with the baseline's
tokens so that every step compares logits for the same context.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from inference.kernels.kernel_set import KernelSet, build_kernels
from inference.kernels.paged_cache import init_kv_cache
from inference.kernels.quant import QuantizedWeight, quantize_weight
from inference.model.config import LlamaConfig
from inference.model.llama import random_hf_tensors
from inference.model.registry import Model

__all__ = ["DecodeRun", "LLAMA", "greedy_decode", "quantize_params", "write_random_llama", "compare"]

_MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")
LLAMA = {
    "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}


def write_random_llama(directory: Path, init: str = "fan_in", seed: int = 1) -> Path:
    """A random HF-format Llama (config :data:`LLAMA`) in ``directory``.

    ``init="hf"``: every matrix N(0, 0.02), as HF initialises Llama. At this
    width (hidden 256) that is 3x below fan-in scale and the logits come out
    flat (std ~0.3 over 1000 tokens). ``init="fan_in"``: matrices N(0,
    1/fan_in), embeddings N(0, 1) -- the scale 0.02 is meant to approximate at
    hidden ~2500; logits std ~1.
    """
    from safetensors.numpy import save_file

    cfg = LlamaConfig.from_hf(LLAMA)
    tensors = random_hf_tensors(cfg, seed)  # N(0, 0.02)
    if init == "fan_in":
        for name, t in tensors.items():
            if t.ndim == 2:
                tensors[name] = (t / 0.02 * (1.0 if "embed" in name else t.shape[1] ** -0.5)).astype(np.float32)
    elif init != "hf":
        raise ValueError(f"unknown init {init!r}")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg.to_hf()))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def compare(base: DecodeRun, run: DecodeRun) -> dict[str, Any]:
    """Teacher-forced agreement and logits error of ``run`` against the float ``base``.

    ``agree``: fraction of steps whose argmax is the baseline's token.
    ``rel``: per-step ``||l_q - l|| / ||l||``. ``gap``: the baseline's top-1
    minus top-2 logit per step; ``flip_gaps`` its values where the argmax
    changed and ``flip_pctile`` their rank among all steps' gaps;
    ``flip_shift``: how much the quantized run moved the decisive pair
    (``l[top1] - l[new]``) at those steps.
    """
    lb, lq = base.logits, run.logits
    flips = run.argmax != base.tokens
    rel = np.linalg.norm(lq - lb, axis=-1) / np.linalg.norm(lb, axis=-1)
    top2 = np.sort(lb, axis=-1)[..., -2:]
    gap = top2[..., 1] - top2[..., 0]

    def at(logits: np.ndarray, tok: np.ndarray) -> np.ndarray:
        return np.take_along_axis(logits, tok[..., None], -1)[..., 0]

    shift = (at(lq, base.tokens) - at(lq, run.argmax)) - (at(lb, base.tokens) - at(lb, run.argmax))
    return {
        "agree": float(1 - flips.mean()), "flips": int(flips.sum()), "steps": int(flips.size),
        "rel": rel, "gap": gap, "flip_gaps": gap[flips],
        "flip_pctile": np.array([np.mean(gap < g) for g in gap[flips]]), "flip_shift": shift[flips],
    }


@dataclass(frozen=True)
class DecodeRun:
    tokens: np.ndarray  # [B, steps] greedy (or forced) tokens after the prompt
    argmax: np.ndarray  # [B, steps] argmax of each step's logits
    logits: np.ndarray  # [B, steps, V] float32


def quantize_params(params: dict[str, Any], kind: str, group_size: int | None = None, *,
                    method: str = "rtn", model: Model | None = None) -> dict[str, Any]:
    """Weight-only quantization of every layer's linear maps (embeddings/lm_head stay float).

    ``method="rtn"``: round to nearest (optionally group-wise). ``"gptq"``: the
    runner's GPTQ (``inference.model.calibrate``, calibrated on the model's own
    activations for its fixed random calibration tokens; needs ``model``), the
    same codes and per-channel scales the runner would serve, as ``[in, out]``.
    """
    if method == "gptq":
        if model is None or group_size is not None:
            raise ValueError("gptq needs the model and has one scale per output channel")
        from inference.model.calibrate import quantize_projections_gptq

        q = quantize_projections_gptq(model, model.serving_params(params), kind, head=False)
        layers = [{k: QuantizedWeight(lq[k + "_t"].codes.T, lq[k + "_t"].scale) if k in _MATRICES else v
                   for k, v in lp.items()} for lp, lq in zip(params["layers"], q["layers"], strict=True)]
        return {**params, "layers": layers}
    if method != "rtn":
        raise ValueError(f"unknown method {method!r}")
    layers = [
        {k: quantize_weight(v, kind, group_size=group_size) if k in _MATRICES else v for k, v in lp.items()}
        for lp in params["layers"]
    ]
    return {**params, "layers": layers}


def _step_fn(model: Model, kernels: KernelSet):
    def step(params, cache, tokens, positions, block_tables):
        b = tokens.shape[0]
        bs = jax.tree.leaves(cache)[0].shape[1]  # the flat slot = block * bs + offset
        slots = block_tables[jnp.arange(b), positions // bs] * bs + positions % bs
        return model.decode(params, cache, tokens, positions, slots, block_tables, positions + 1, kernels=kernels)

    return jax.jit(step)


def greedy_decode(
    model: Model,
    params: dict[str, Any],
    prompts: np.ndarray,
    steps: int,
    *,
    kv_kind: str | None = None,
    forced: np.ndarray | None = None,
    kernels: str = "reference",
    block_size: int = 16,
) -> DecodeRun:
    """Feed ``prompts[B,P]`` then decode ``steps`` tokens (or the ``forced`` ones) with the ``kernels`` set."""
    cfg = model.config
    b, p = prompts.shape
    total = p + steps
    m = -(-total // block_size)
    num_blocks = b * m
    tables = jnp.asarray(np.arange(num_blocks, dtype=np.int32).reshape(b, m))
    dtype = params["embed"].dtype
    cache: Any = init_kv_cache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, num_blocks, block_size,
                               dtype, kv_kind)
    step = _step_fn(model, build_kernels(kernels, dtype=dtype, kv_quant=kv_kind))
    token = jnp.asarray(prompts[:, 0], jnp.int32)
    out_tokens, out_argmax, out_logits = [], [], []
    for pos in range(total - 1):
        positions = jnp.full((b,), pos, jnp.int32)
        logits, cache = step(params, cache, token, positions, tables)
        if pos + 1 < p:
            token = jnp.asarray(prompts[:, pos + 1], jnp.int32)
            continue
        am = np.asarray(jnp.argmax(logits, axis=-1))
        i = pos + 1 - p
        nxt = am if forced is None else forced[:, i]
        out_argmax.append(am)
        out_tokens.append(nxt)
        out_logits.append(np.asarray(logits, np.float32))
        token = jnp.asarray(nxt, jnp.int32)
    return DecodeRun(np.stack(out_tokens, 1), np.stack(out_argmax, 1), np.stack(out_logits, 1))
