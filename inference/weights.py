"""Model weights: local Hugging Face Llama checkpoints and the built-in ``tiny`` model.

A checkpoint directory holds ``config.json``, one ``model.safetensors`` or
shards listed in ``model.safetensors.index.json`` (any ``*.safetensors`` is
accepted when there is no index), and optionally ``generation_config.json``
whose ``eos_token_id`` wins over the config's. HF stores q/k projections in
the ``rotate_half`` RoPE layout our model uses, so no permutation is applied.
Nothing here touches the network: a name that is not ``tiny`` must be an
existing local directory.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from inference.model.config import TINY_CONFIG, ConfigError, LlamaConfig

__all__ = [
    "WeightsError",
    "LoadedModel",
    "load_model",
    "load_hf_dir",
    "random_hf_tensors",
    "write_hf_checkpoint",
    "TINY_SEED",
]

TINY_SEED = 0
Progress = Callable[[str, int, int, str], None]


class WeightsError(ValueError):
    """The checkpoint cannot be loaded (missing files, tensors or wrong shapes)."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    name: str
    config: LlamaConfig
    params: dict[str, Any]  # jnp arrays, see inference.model.llama
    eos_token_ids: tuple[int, ...]


def random_hf_tensors(cfg: LlamaConfig, seed: int) -> dict[str, np.ndarray]:
    """Random float32 weights under HF Llama parameter names (normal(0, 0.02), unit norms)."""
    rng = np.random.default_rng(seed)
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    out = {"model.embed_tokens.weight": w(cfg.vocab_size, h), "model.norm.weight": np.ones(h, np.float32)}
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        out[p + "self_attn.q_proj.weight"] = w(cfg.num_attention_heads * d, h)
        out[p + "self_attn.k_proj.weight"] = w(cfg.num_key_value_heads * d, h)
        out[p + "self_attn.v_proj.weight"] = w(cfg.num_key_value_heads * d, h)
        out[p + "self_attn.o_proj.weight"] = w(h, cfg.num_attention_heads * d)
        out[p + "mlp.gate_proj.weight"] = w(i, h)
        out[p + "mlp.up_proj.weight"] = w(i, h)
        out[p + "mlp.down_proj.weight"] = w(h, i)
        out[p + "input_layernorm.weight"] = np.ones(h, np.float32)
        out[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = w(cfg.vocab_size, h)
    return out


def write_hf_checkpoint(directory: str | Path, config_dict: dict[str, Any], seed: int) -> Path:
    """Write config.json + model.safetensors (random weights, HF names) into ``directory``."""
    from safetensors.numpy import save_file

    cfg = LlamaConfig.from_hf(config_dict)
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    full = {**cfg.to_hf(), **config_dict}
    (path / "config.json").write_text(json.dumps(full, indent=2))
    save_file(random_hf_tensors(cfg, seed), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _convert(cfg: LlamaConfig, get: Callable[[str], np.ndarray], dtype: Any,
             progress: Progress | None) -> dict[str, Any]:
    import jax.numpy as jnp

    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    hq, kv = cfg.num_attention_heads, cfg.num_key_value_heads

    def take(name: str, shape: tuple[int, ...]) -> np.ndarray:
        arr = get(name)
        if tuple(arr.shape) != shape:
            raise WeightsError(f"{name}: expected shape {shape}, got {tuple(arr.shape)}")
        return arr

    def dev(arr: np.ndarray) -> Any:
        return jnp.asarray(np.asarray(arr, dtype=np.float32), dtype=dtype)

    layers = []
    total = cfg.num_hidden_layers + 1
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        q = take(p + "self_attn.q_proj.weight", (hq * d, h))
        k = take(p + "self_attn.k_proj.weight", (kv * d, h))
        v = take(p + "self_attn.v_proj.weight", (kv * d, h))
        gate = take(p + "mlp.gate_proj.weight", (i, h))
        up = take(p + "mlp.up_proj.weight", (i, h))
        layers.append({
            "attn_norm": dev(take(p + "input_layernorm.weight", (h,))),
            "wqkv": dev(np.concatenate([np.asarray(q, np.float32).T, np.asarray(k, np.float32).T,
                                        np.asarray(v, np.float32).T], axis=1)),
            "wo": dev(np.asarray(take(p + "self_attn.o_proj.weight", (h, hq * d)), np.float32).T),
            "mlp_norm": dev(take(p + "post_attention_layernorm.weight", (h,))),
            "w_gate_up": dev(np.concatenate([np.asarray(gate, np.float32).T,
                                             np.asarray(up, np.float32).T], axis=1)),
            "w_down": dev(np.asarray(take(p + "mlp.down_proj.weight", (h, i)), np.float32).T),
        })
        if progress:
            progress("load", n + 1, total, f"layer {n + 1}/{cfg.num_hidden_layers}")
    params: dict[str, Any] = {
        "embed": dev(take("model.embed_tokens.weight", (cfg.vocab_size, h))),
        "layers": layers,
        "norm": dev(take("model.norm.weight", (h,))),
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = dev(np.asarray(take("lm_head.weight", (cfg.vocab_size, h)), np.float32).T)
    if progress:
        progress("load", total, total, "weights loaded")
    return params


def _shard_files(path: Path) -> dict[str, Path]:
    """tensor name -> file holding it."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise WeightsError(f"{index}: no weight_map")
        files = {name: path / fname for name, fname in weight_map.items()}
        for f in set(files.values()):
            if not f.exists():
                raise WeightsError(f"{index} names {f.name}, which does not exist")
        return files
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise WeightsError(f"{path}: no *.safetensors files")
    files = {}
    for f in shards:
        with safe_open(str(f), framework="numpy") as sf:
            files.update({name: f for name in sf.keys()})
    return files


def load_hf_dir(path: str | Path, *, dtype: Any = "float32", progress: Progress | None = None) -> LoadedModel:
    """Load a local HF Llama checkpoint directory."""
    from safetensors import safe_open

    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise WeightsError(f"{path}: no config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise WeightsError(f"{cfg_file}: invalid JSON ({e})") from None
    cfg = LlamaConfig.from_hf(raw)
    eos = cfg.eos_token_ids
    gen_file = path / "generation_config.json"
    if gen_file.exists():
        gen_eos = json.loads(gen_file.read_text()).get("eos_token_id")
        if gen_eos is not None:
            eos = (gen_eos,) if isinstance(gen_eos, int) else tuple(int(e) for e in gen_eos)
    files = _shard_files(path)
    handles: dict[Path, Any] = {}

    def get(name: str) -> np.ndarray:
        f = files.get(name)
        if f is None:
            raise WeightsError(f"{path}: tensor {name!r} not found in the checkpoint")
        if f not in handles:
            handles[f] = safe_open(str(f), framework="numpy")
        return handles[f].get_tensor(name)

    params = _convert(cfg, get, dtype, progress)
    return LoadedModel(path.name or str(path), cfg, params, eos)


def load_model(model: str = "tiny", *, dtype: Any = "float32", progress: Progress | None = None) -> LoadedModel:
    """``"tiny"`` (built-in, random weights from a fixed seed) or a local HF directory."""
    if model == "tiny":
        tensors = random_hf_tensors(TINY_CONFIG, TINY_SEED)
        params = _convert(TINY_CONFIG, tensors.__getitem__, dtype, progress)
        return LoadedModel("tiny", TINY_CONFIG, params, TINY_CONFIG.eos_token_ids)
    path = Path(model)
    if not path.is_dir():
        raise WeightsError(f"model {model!r} is neither 'tiny' nor a local checkpoint directory")
    try:
        return load_hf_dir(path, dtype=dtype, progress=progress)
    except ConfigError as e:
        raise WeightsError(f"{path}: {e}") from None
