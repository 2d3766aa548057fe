"""Checkpoint loading: single file, sharded index, generation config, errors; the tiny model."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from inference.model.config import TINY_CONFIG, ConfigError, LlamaConfig
from inference.model.llama import random_hf_tensors
from inference.weights import WeightsError, load_hf_dir, load_model, write_hf_checkpoint

SMALL = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, eos_token_id=3)


def flat(params) -> dict[str, np.ndarray]:
    out = {k: np.asarray(v) for k, v in params.items() if k != "layers"}
    for i, layer in enumerate(params["layers"]):
        out.update({f"{i}.{k}": np.asarray(v) for k, v in layer.items()})
    return out


def test_write_then_load_round_trip_places_every_tensor(tmp_path):
    write_hf_checkpoint(tmp_path, SMALL, seed=5)
    m = load_hf_dir(tmp_path)
    t = random_hf_tensors(LlamaConfig.from_hf(SMALL), 5)
    layer = m.params["layers"][1]
    q = t["model.layers.1.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(np.asarray(layer["wqkv"])[:, : q.shape[0]], q.T)
    np.testing.assert_array_equal(np.asarray(layer["w_down"]), t["model.layers.1.mlp.down_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(m.params["lm_head"]), t["lm_head.weight"].T)
    assert m.eos_token_ids == (3,) and m.config.head_dim == 4 and m.name == tmp_path.name


def test_sharded_index_loads_the_same_weights(tmp_path):
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    write_hf_checkpoint(single, SMALL, seed=1)
    sharded.mkdir()
    (sharded / "config.json").write_text((single / "config.json").read_text())
    tensors = random_hf_tensors(LlamaConfig.from_hf(SMALL), 1)
    names = sorted(tensors)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in parts.items():
        save_file({k: tensors[k] for k in keys}, str(sharded / fname))
    weight_map = {k: fname for fname, keys in parts.items() for k in keys}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a, b = flat(load_hf_dir(single).params), flat(load_hf_dir(sharded).params)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_generation_config_eos_wins(tmp_path):
    write_hf_checkpoint(tmp_path, SMALL, seed=0)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 7]}))
    assert load_hf_dir(tmp_path).eos_token_ids == (3, 7)


def test_missing_and_misshapen_tensors_are_clear_errors(tmp_path):
    write_hf_checkpoint(tmp_path, SMALL, seed=0)
    tensors = random_hf_tensors(LlamaConfig.from_hf(SMALL), 0)
    del tensors["model.norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError, match="model.norm.weight"):
        load_hf_dir(tmp_path)
    tensors["model.norm.weight"] = np.ones(5, np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError, match="expected shape"):
        load_hf_dir(tmp_path)


def test_bad_model_names_and_configs(tmp_path):
    with pytest.raises(WeightsError, match="neither"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(WeightsError, match="config.json"):
        load_model(str(tmp_path))
    with pytest.raises(ConfigError, match="rope_scaling type"):
        LlamaConfig.from_hf(dict(SMALL, rope_scaling={"rope_type": "yarn", "factor": 2.0}))
    with pytest.raises(ConfigError, match="bias"):
        LlamaConfig.from_hf(dict(SMALL, attention_bias=True))
    with pytest.raises(ConfigError, match="hidden_size"):
        LlamaConfig.from_hf({k: v for k, v in SMALL.items() if k != "hidden_size"})
    with pytest.raises(ConfigError, match="multiple"):
        LlamaConfig.from_hf(dict(SMALL, num_key_value_heads=3))
    (tmp_path / "config.json").write_text(json.dumps(dict(SMALL, model_type="gpt2")))
    with pytest.raises(WeightsError, match="model_type"):
        load_model(str(tmp_path))


def test_transformers_reads_our_checkpoint(tmp_path):
    transformers = pytest.importorskip("transformers")
    write_hf_checkpoint(tmp_path, SMALL, seed=9)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    t = random_hf_tensors(LlamaConfig.from_hf(SMALL), 9)
    state = hf.state_dict()
    for name, arr in t.items():
        np.testing.assert_array_equal(state[name].numpy(), arr)


def test_tiny_is_deterministic_byte_level():
    a, b = load_model("tiny"), load_model("tiny")
    assert a.config == TINY_CONFIG and a.config.vocab_size == 258 and a.eos_token_ids == (257,)
    fa, fb = flat(a.params), flat(b.params)
    assert all(np.array_equal(fa[k], fb[k]) for k in fa)
    assert "lm_head" not in a.params  # tied embeddings
