"""The Mistral architecture (HF ``MistralForCausalLM``): Llama's layers under their own ``model_type``.

Mistral's checkpoints use Llama's tensor names and layer (GQA attention,
SwiGLU MLP, RMSNorm, ``rotate_half`` RoPE); what differs is its
configuration, above all its sliding-window attention (``sliding_window``: a
token sees at most that many keys, itself included). The window goes into
the configuration (:attr:`LlamaConfig.sliding_window`), from which the runner
builds its kernel set's attention (:func:`inference.kernels.kernel_set.build_kernels`)
and the engine its KV cache, which releases the blocks that fall out of
every window. Mistral-7B-v0.1 (window 4096) thus serves its whole 32k
context; v0.2 and later have no window.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

from inference.model.config import ConfigError, LlamaConfig, effective_window
from inference.model.llama import Llama

__all__ = ["Mistral"]

_HF_DEFAULT_WINDOW = 4096  # transformers' MistralConfig, for a config.json without the key


@dataclass(frozen=True, slots=True)
class Mistral(Llama):
    """HF ``model_type`` "mistral" as a :class:`~inference.model.registry.Model`."""

    model_type: ClassVar[str] = "mistral"
    hf_architecture: ClassVar[str] = "MistralForCausalLM"
    sliding_window: int | None = None  # as config.json says it (the config holds the one that hides keys)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> Mistral:
        cfg = LlamaConfig.from_hf(d)
        window = d.get("sliding_window", _HF_DEFAULT_WINDOW)
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise ConfigError(f"sliding_window must be a positive integer or null, got {window!r}")
        return cls(replace(cfg, sliding_window=effective_window(window, cfg.max_position_embeddings)), window)

    def hf_config(self) -> dict[str, Any]:
        return {**Llama.hf_config(self), "sliding_window": self.sliding_window}
