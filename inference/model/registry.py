"""Model architectures by Hugging Face ``model_type``: the :class:`Model` protocol and its registry.

How it works: a checkpoint's ``config.json`` names its architecture in
``model_type``; :func:`model_from_hf` looks it up in :data:`ARCHITECTURES` and
builds that architecture's :class:`Model` from the config. The loader
(:mod:`inference.weights`) asks the model to map the checkpoint's tensors to its
parameters; the runner (:mod:`inference.model.jax_runner`) lays them out for
serving, calls ``prefill`` and ``decode`` over the paged KV cache with the
worker's :class:`~inference.kernels.kernel_set.KernelSet`, and quantizes
through ``map_projections`` and ``calibrate`` (GPTQ: :mod:`inference.model.calibrate`).
Nothing outside an architecture's own file knows its parameter names or layers.

Adding an architecture is one file (a class with these members; a variant of
an existing one subclasses it, as :class:`~inference.model.mistral.Mistral` and
:mod:`~inference.model.qwen`'s do :class:`~inference.model.llama.Llama`), one line in
:data:`ARCHITECTURES`, and a parity test against transformers (docs/ARCHITECTURE.md has the recipe).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Protocol

import jax
import numpy as np

from inference.kernels.kernel_set import KernelSet
from inference.kernels.paged_cache import KVCache
from inference.model.config import ConfigError
from inference.model.llama import Llama
from inference.model.mistral import Mistral
from inference.model.qwen import Qwen2, Qwen3

__all__ = ["ModelConfig", "Model", "ARCHITECTURES", "DEFAULT_MODEL_TYPE", "model_from_hf"]

Array = jax.Array
Params = dict[str, Any]
Progress = Callable[[str, int, int, str], None]


class ModelConfig(Protocol):
    """What the runner reads of any architecture's configuration (the KV cache's shape, the vocabulary)."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def num_hidden_layers(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def max_position_embeddings(self) -> int: ...
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...
    @property
    def sliding_window(self) -> int | None:
        """A query sees its last this many keys (None: all): the kernel set's window, the KV cache's."""
        ...


class Model(Protocol):
    """One architecture, configured: its weights, its forward pass, its quantization seam."""

    model_type: ClassVar[str]  # the HF config.json "model_type" it serves

    @property
    def config(self) -> ModelConfig:
        """The parsed configuration (the architecture reads more of it than the runner does)."""
        ...

    # config.json
    def hf_config(self) -> dict[str, Any]:
        """The ``config.json`` of this model (what :func:`model_from_hf` reads back)."""
        ...

    # weights
    def random_hf_weights(self, seed: int) -> dict[str, np.ndarray]:
        """Random float32 tensors under the checkpoint's names (the built-in model, tests)."""
        ...

    def load_params(self, get: Callable[[str], np.ndarray], dtype: Any, progress: Progress | None = None) -> Params:
        """The checkpoint's tensors (``get(name)``; a missing one raises) as parameters in ``dtype``."""
        ...

    def serving_params(self, params: Params) -> Params:
        """The parameters in the layout the runner serves (projections ``[out, in]``)."""
        ...

    def map_projections(self, params: Params, fn: Callable[[Any], Any]) -> Params:
        """Serving parameters with ``fn`` applied to every projection (quantize or pack them)."""
        ...

    # forward over the paged KV cache
    def prefill(self, params: Params, cache: KVCache, tokens: Array, positions: Array, slots: Array,
                block_tables: Array, q_offsets: Array, kv_lens: Array, last_idx: Array, *,
                kernels: KernelSet) -> tuple[Array, KVCache]:
        """New tokens ``[B, T]`` at ``q_offsets + t``, their K/V written at ``slots``: last-token logits ``[B, V]``."""
        ...

    def decode(self, params: Params, cache: KVCache, tokens: Array, positions: Array, slots: Array,
               block_tables: Array, context_lens: Array, *, kernels: KernelSet) -> tuple[Array, KVCache]:
        """One token per row ``[B]`` at ``positions``: logits ``[B, V]``."""
        ...

    def mixed(self, params: Params, cache: KVCache, decode: tuple[Array, ...], prefill: tuple[Array, ...], *,
              kernels: KernelSet) -> tuple[Array, KVCache]:
        """``decode``'s rows and ``prefill``'s chunks (the arguments of ``decode`` and ``prefill`` after the
        cache) in one pass: logits ``[Bd + Bp, V]``, the decode rows first (chunked prefill's mixed step)."""
        ...

    # calibration
    def calibrate(self, params: Params, tokens: np.ndarray, quantize: Callable[[Any, Array], Any], *,
                  head: bool = True) -> Params:
        """Serving parameters with each projection replaced by ``quantize(w, its input on tokens)``, in
        the order activations reach them, later ones seeing the replaced earlier ones' outputs."""
        ...


ARCHITECTURES: Mapping[str, Callable[[dict[str, Any]], Model]] = {
    Llama.model_type: Llama.from_hf,
    Mistral.model_type: Mistral.from_hf,
    Qwen2.model_type: Qwen2.from_hf,
    Qwen3.model_type: Qwen3.from_hf,
}
DEFAULT_MODEL_TYPE = "llama"  # a config.json without "model_type" (older Llama exports)


def model_from_hf(d: dict[str, Any]) -> Model:
    """The model a parsed ``config.json`` describes; :class:`ConfigError` for an architecture not served."""
    model_type = d.get("model_type", DEFAULT_MODEL_TYPE)
    build = ARCHITECTURES.get(model_type)
    if build is None:
        raise ConfigError(f"unsupported model_type {model_type!r}; expected one of {sorted(ARCHITECTURES)}")
    return build(d)
