"""Llama-family model configuration, read from a Hugging Face ``config.json``.

Only what the forward pass needs is kept; anything we cannot honour (biases,
unknown RoPE scaling types, a sliding window on some layers only) is refused
with a clear :class:`ConfigError` rather than silently producing wrong logits.
Which architecture a ``config.json`` names (``model_type``) is the registry's
question (:mod:`inference.model.registry`); Llama, Mistral and Qwen read their
fields here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["ConfigError", "LlamaConfig", "RopeScaling", "TINY_CONFIG", "effective_window", "layer_window"]

class ConfigError(ValueError):
    """The model configuration is invalid or uses a feature we do not implement."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling: ``rope_type`` "linear" or "llama3"."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default=())
    # Sliding-window attention: a query sees its last this many keys, itself included (None: all of them).
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"sliding_window must be positive or None, got {self.sliding_window}")

    @property
    def num_params(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        per_layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_hidden_layers * per_layer + h + head

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> LlamaConfig:
        """Build from a parsed HF ``config.json`` dict (its ``model_type`` is not checked here)."""
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise ConfigError("attention_bias / mlp_bias are not supported")
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            head_dim = d.get("head_dim") or hidden // heads
            eos = d.get("eos_token_id")
            # transformers >= 5 writes "rope_parameters" (rope_theta inside); older ones
            # write "rope_theta" and "rope_scaling" at the top level.
            rope = d.get("rope_parameters") or {}
            theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
            scaling = d.get("rope_scaling") or rope
            return cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                rope_theta=float(theta),
                rope_scaling=_parse_rope_scaling(scaling),
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=_as_ids(eos),
            )
        except KeyError as e:
            raise ConfigError(f"config.json is missing required key {e.args[0]!r}") from None

    def to_hf(self) -> dict[str, Any]:
        """The HF ``config.json`` dict for this configuration (LlamaForCausalLM)."""
        d: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if self.rope_scaling is not None:
            rs = self.rope_scaling
            d["rope_scaling"] = {"rope_type": rs.rope_type, "factor": rs.factor}
            if rs.rope_type == "llama3":
                d["rope_scaling"].update(
                    low_freq_factor=rs.low_freq_factor,
                    high_freq_factor=rs.high_freq_factor,
                    original_max_position_embeddings=rs.original_max_position_embeddings,
                )
        return d


def effective_window(window: int | None, max_position_embeddings: int) -> int | None:
    """The window that hides keys: None when it is at least the longest context (it then hides none)."""
    return window if window is not None and window < max_position_embeddings else None


def layer_window(d: dict[str, Any]) -> int | None:
    """The sliding window of every layer of a Qwen-style ``config.json``: ``layer_types`` when given
    (transformers >= 4.55), else ``use_sliding_window`` with ``sliding_window`` on the layers from
    ``max_window_layers`` on. A window on some layers only is a :class:`ConfigError` (the KV cache and
    the kernels apply one window to every layer)."""
    window = d.get("sliding_window")
    types = d.get("layer_types")
    if types is None:
        if not d.get("use_sliding_window") or window is None:
            return None
        first = int(d.get("max_window_layers", 0))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(int(d["num_hidden_layers"]))]
    kinds = set(types)
    if kinds == {"full_attention"}:
        return None
    if kinds != {"sliding_attention"}:
        raise ConfigError(f"a sliding window on some layers only is not supported (layer_types: {sorted(kinds)})")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ConfigError(f"sliding_window must be a positive integer, got {window!r}")
    return window


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _need(rs: dict[str, Any], key: str) -> Any:
    if key not in rs:
        raise ConfigError(f"rope scaling {rs.get('rope_type')!r} needs {key!r}")
    return rs[key]


def _parse_rope_scaling(rs: Any) -> RopeScaling | None:
    if not rs:
        return None
    if not isinstance(rs, dict):
        raise ConfigError(f"rope_scaling must be an object, got {rs!r}")
    rope_type = rs.get("rope_type") or rs.get("type") or "default"
    if rope_type == "default":
        return None
    if rope_type == "linear":
        return RopeScaling("linear", float(_need(rs, "factor")))
    if rope_type == "llama3":
        return RopeScaling(
            "llama3",
            float(_need(rs, "factor")),
            float(rs.get("low_freq_factor", 1.0)),
            float(rs.get("high_freq_factor", 4.0)),
            int(rs.get("original_max_position_embeddings", 8192)),
        )
    raise ConfigError(f"unsupported rope_scaling type {rope_type!r} (supported: default, linear, llama3)")


# The built-in "tiny" model: byte-level vocabulary (256 bytes + <s> + </s>).
TINY_CONFIG = LlamaConfig(
    vocab_size=258,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
    bos_token_id=256,
    eos_token_ids=(257,),
)
