"""Model weights: local Hugging Face checkpoints and the built-in ``tiny`` model.

A checkpoint directory holds ``config.json`` (its ``model_type`` picks the
architecture: :mod:`inference.model.registry`), one ``model.safetensors`` or
shards listed in ``model.safetensors.index.json`` (any ``*.safetensors`` is
accepted when there is no index), and optionally ``generation_config.json``
whose ``eos_token_id`` wins over the config's. The architecture maps the
tensors to its parameters. Nothing here touches the network: a name that is
not ``tiny`` must be an existing local directory.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from inference.model.config import TINY_CONFIG, ConfigError
from inference.model.llama import Llama
from inference.model.registry import Model, model_from_hf

__all__ = [
    "WeightsError",
    "LoadedModel",
    "load_model",
    "load_hf_dir",
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
    model: Model  # the architecture, configured
    params: dict[str, Any]  # jnp arrays, laid out as the architecture loads them
    eos_token_ids: tuple[int, ...]

    @property
    def config(self) -> Any:
        return self.model.config


def write_hf_checkpoint(directory: str | Path, config_dict: dict[str, Any], seed: int) -> Path:
    """Write config.json + model.safetensors (random weights, HF names) into ``directory``."""
    from safetensors.numpy import save_file

    model = model_from_hf(config_dict)
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    full = {**model.hf_config(), **config_dict}
    (path / "config.json").write_text(json.dumps(full, indent=2))
    save_file(model.random_hf_weights(seed), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _params(model: Model, get: Callable[[str], np.ndarray], dtype: Any, progress: Progress | None) -> dict[str, Any]:
    try:
        return model.load_params(get, dtype, progress)
    except ValueError as e:  # a tensor of the wrong shape
        raise WeightsError(str(e)) from None


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
    """Load a local HF checkpoint directory of an architecture the registry serves."""
    from safetensors import safe_open

    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise WeightsError(f"{path}: no config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise WeightsError(f"{cfg_file}: invalid JSON ({e})") from None
    model = model_from_hf(raw)
    eos = model.config.eos_token_ids
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

    params = _params(model, get, dtype, progress)
    return LoadedModel(path.name or str(path), model, params, eos)


def load_model(model: str = "tiny", *, dtype: Any = "float32", progress: Progress | None = None) -> LoadedModel:
    """``"tiny"`` (built-in, random weights from a fixed seed) or a local HF directory."""
    if model == "tiny":
        tiny = Llama(TINY_CONFIG)
        params = _params(tiny, tiny.random_hf_weights(TINY_SEED).__getitem__, dtype, progress)
        return LoadedModel("tiny", tiny, params, TINY_CONFIG.eos_token_ids)
    path = Path(model)
    if not path.is_dir():
        raise WeightsError(f"model {model!r} is neither 'tiny' nor a local checkpoint directory")
    try:
        return load_hf_dir(path, dtype=dtype, progress=progress)
    except ConfigError as e:
        raise WeightsError(f"{path}: {e}") from None
