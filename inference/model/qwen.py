"""The Qwen2/Qwen2.5 and Qwen3 architectures (HF ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``): Llama's
layers plus what each adds to the attention's inputs.

Both keep Llama's tensor names, SwiGLU MLP, RMSNorms and ``rotate_half`` RoPE
(usually ``rope_theta`` 1e6), and their small sizes tie the head to the
embedding. What differs:

- Qwen2 (and Qwen2.5, the same ``model_type``): biases on the q, k and v
  projections (none on o). They are one ``bqkv`` vector per layer, added to the
  fused q|k|v projection.
- Qwen3: no bias, and an RMSNorm over each query head and each key head
  (``q_norm``, ``k_norm``: one ``[head_dim]`` weight each, shared by the heads),
  after the projection and before RoPE. ``head_dim`` is its own setting
  (128 where ``hidden_size / heads`` is 64 on the small ones).

Llama's forward pass applies both by the layer's parameters
(:func:`inference.model.llama.qkv_extras`), so quantization, the kernel set and
calibration reach them unchanged. Either may slide a window over every layer
(``use_sliding_window``, or ``layer_types`` all ``sliding_attention``); a window
on some layers only is refused (:func:`inference.model.config.layer_window`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np

from inference.model.config import LlamaConfig, effective_window, layer_window
from inference.model.llama import Llama, Params

__all__ = ["Qwen2", "Qwen3"]

_ATTN = "model.layers.{n}.self_attn."
Progress = Callable[[str, int, int, str], None]


def _config(d: dict[str, Any]) -> LlamaConfig:
    cfg = LlamaConfig.from_hf(d)  # attention_bias: Qwen3's puts one on o_proj too, refused there
    return replace(cfg, sliding_window=effective_window(layer_window(d), cfg.max_position_embeddings))


def _window_fields(cfg: LlamaConfig) -> dict[str, Any]:
    """config.json's window keys for one window on every layer (or none)."""
    return {"use_sliding_window": cfg.sliding_window is not None, "sliding_window": cfg.sliding_window,
            "max_window_layers": 0}


def _take(get: Callable[[str], np.ndarray], name: str, shape: tuple[int, ...]) -> np.ndarray:
    arr = get(name)
    if tuple(arr.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(arr.shape)}")
    return np.asarray(arr, np.float32)


def _with_layer_params(params: Params, extra: Callable[[int], dict[str, np.ndarray]], dtype: Any) -> Params:
    """``params`` with ``extra(n)``'s arrays (in ``dtype``) added to layer ``n``."""
    layers = [{**lp, **{k: jnp.asarray(v, dtype=dtype) for k, v in extra(n).items()}}
              for n, lp in enumerate(params["layers"])]
    return {**params, "layers": layers}


@dataclass(frozen=True, slots=True)
class Qwen2(Llama):
    """HF ``model_type`` "qwen2" (Qwen2, Qwen2.5) as a :class:`~inference.model.registry.Model`."""

    model_type: ClassVar[str] = "qwen2"
    hf_architecture: ClassVar[str] = "Qwen2ForCausalLM"

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> Qwen2:
        # transformers' Qwen2 biases q, k and v whatever attention_bias says (and o never)
        return cls(_config({k: v for k, v in d.items() if k != "attention_bias"}))

    def hf_config(self) -> dict[str, Any]:
        out = {**Llama.hf_config(self), **_window_fields(self.config)}
        del out["attention_bias"]  # Qwen2's q, k and v always have one
        return out

    def _sizes(self) -> tuple[int, int]:
        c = self.config
        return c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim

    def random_hf_weights(self, seed: int) -> dict[str, np.ndarray]:
        out = Llama.random_hf_weights(self, seed)
        rng = np.random.default_rng(seed + 1)
        q, kv = self._sizes()
        for n in range(self.config.num_hidden_layers):
            for proj, size in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                out[_ATTN.format(n=n) + proj + ".bias"] = (rng.standard_normal(size) * 0.02).astype(np.float32)
        return out

    def load_params(self, get: Callable[[str], np.ndarray], dtype: Any, progress: Progress | None = None) -> Params:
        q, kv = self._sizes()

        def bias(n: int) -> dict[str, np.ndarray]:
            p = _ATTN.format(n=n)
            return {"bqkv": np.concatenate([_take(get, p + "q_proj.bias", (q,)), _take(get, p + "k_proj.bias", (kv,)),
                                            _take(get, p + "v_proj.bias", (kv,))])}

        return _with_layer_params(Llama.load_params(self, get, dtype, progress), bias, dtype)


@dataclass(frozen=True, slots=True)
class Qwen3(Llama):
    """HF ``model_type`` "qwen3" as a :class:`~inference.model.registry.Model`."""

    model_type: ClassVar[str] = "qwen3"
    hf_architecture: ClassVar[str] = "Qwen3ForCausalLM"

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> Qwen3:
        return cls(_config(d))

    def hf_config(self) -> dict[str, Any]:
        return {**Llama.hf_config(self), **_window_fields(self.config)}

    def random_hf_weights(self, seed: int) -> dict[str, np.ndarray]:
        out = Llama.random_hf_weights(self, seed)
        d = self.config.head_dim
        for n in range(self.config.num_hidden_layers):
            out[_ATTN.format(n=n) + "q_norm.weight"] = np.ones(d, np.float32)
            out[_ATTN.format(n=n) + "k_norm.weight"] = np.ones(d, np.float32)
        return out

    def load_params(self, get: Callable[[str], np.ndarray], dtype: Any, progress: Progress | None = None) -> Params:
        d = self.config.head_dim

        def norms(n: int) -> dict[str, np.ndarray]:
            p = _ATTN.format(n=n)
            return {"q_norm": _take(get, p + "q_norm.weight", (d,)), "k_norm": _take(get, p + "k_norm.weight", (d,))}

        return _with_layer_params(Llama.load_params(self, get, dtype, progress), norms, dtype)
