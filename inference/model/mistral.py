"""The Mistral architecture (HF ``MistralForCausalLM``): Llama's layers under their own ``model_type``.

Mistral's checkpoints use Llama's tensor names and layer (GQA attention,
SwiGLU MLP, RMSNorm, ``rotate_half`` RoPE); what differs is its
configuration. Its sliding-window attention (``sliding_window``: a token sees
at most that many keys, itself included) is served exactly by capping the
context at the window: no sequence then holds a key the window would hide.
Mistral-7B-v0.1 (window 4096) serves 4096 tokens; v0.2 and later (no window)
their full context.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

from inference.model.config import ConfigError, LlamaConfig
from inference.model.llama import Llama

__all__ = ["Mistral"]

_HF_DEFAULT_WINDOW = 4096  # transformers' MistralConfig, for a config.json without the key


@dataclass(frozen=True, slots=True)
class Mistral(Llama):
    """HF ``model_type`` "mistral" as a :class:`~inference.model.registry.Model`."""

    model_type: ClassVar[str] = "mistral"
    hf_architecture: ClassVar[str] = "MistralForCausalLM"
    sliding_window: int | None = None

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> Mistral:
        cfg = LlamaConfig.from_hf(d)
        window = d.get("sliding_window", _HF_DEFAULT_WINDOW)
        if window is None:
            return cls(cfg)
        if not isinstance(window, int) or window < 1:
            raise ConfigError(f"sliding_window must be a positive integer or null, got {window!r}")
        return cls(replace(cfg, max_position_embeddings=min(cfg.max_position_embeddings, window)), window)

    def hf_config(self) -> dict[str, Any]:
        return {**Llama.hf_config(self), "sliding_window": self.sliding_window}
