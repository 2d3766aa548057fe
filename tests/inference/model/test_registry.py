"""The model registry: ``model_type`` picks the architecture, each entry is a whole :class:`Model`, a
sliding window is read into the configuration (one for every layer, or none) and Qwen's extra tensors
are loaded. (Logits against transformers for every entry: ``test_parity.py``.)"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from inference.model.config import ConfigError
from inference.model.llama import Llama
from inference.model.mistral import Mistral
from inference.model.qwen import Qwen2, Qwen3
from inference.model.registry import ARCHITECTURES, Model, model_from_hf
from inference.weights import load_hf_dir, write_hf_checkpoint

SMALL = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, eos_token_id=3)
MEMBERS = [name for name in Model.__dict__ if not name.startswith("_")]  # the protocol's methods and attributes


def test_model_type_picks_the_architecture() -> None:
    assert type(model_from_hf(dict(SMALL, model_type="llama"))) is Llama
    assert type(model_from_hf(dict(SMALL, model_type="mistral"))) is Mistral
    assert type(model_from_hf(dict(SMALL, model_type="qwen2"))) is Qwen2
    assert type(model_from_hf(dict(SMALL, model_type="qwen3"))) is Qwen3
    assert model_from_hf(dict(SMALL, model_type="qwen2", attention_bias=True)) == Qwen2.from_hf(SMALL)  # always
    with pytest.raises(ConfigError, match="attention_bias"):  # Qwen3's would bias o_proj as well
        model_from_hf(dict(SMALL, model_type="qwen3", attention_bias=True))
    assert type(model_from_hf(SMALL)) is Llama  # no model_type: an older Llama export
    with pytest.raises(ConfigError, match=r"unsupported model_type 'gpt2'; expected one of "
                                          r"\['llama', 'mistral', 'qwen2', 'qwen3'\]"):
        model_from_hf(dict(SMALL, model_type="gpt2"))


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_every_entry_is_a_whole_model_that_round_trips_its_config(model_type: str) -> None:
    model = model_from_hf(dict(SMALL, model_type=model_type))
    assert {"config", "prefill", "decode", "load_params", "calibrate"} <= set(MEMBERS)
    assert all(hasattr(model, name) for name in MEMBERS), [n for n in MEMBERS if not hasattr(model, n)]
    assert model.model_type == model_type
    written = model.hf_config()
    assert written["model_type"] == model_type and model_from_hf(json.loads(json.dumps(written))) == model


@pytest.mark.parametrize("window,effective", [(64, 64), (511, 511), (512, None), (4096, None), (None, None)])
def test_mistral_reads_its_sliding_window_into_the_config(window: int | None, effective: int | None) -> None:
    """The context stays the model's; the window goes to the config, where the kernels and the KV cache
    read it. One no narrower than the context hides no key (None: whole-context attention); none
    (Mistral v0.2 and later) leaves it; a config.json without the key gets transformers' default, 4096."""
    model = model_from_hf(dict(SMALL, model_type="mistral", sliding_window=window))
    assert (model.config.max_position_embeddings, model.config.sliding_window) == (512, effective)
    assert model.sliding_window == window  # written back as it was read
    default = model_from_hf(dict(SMALL, model_type="mistral", max_position_embeddings=32768)).config
    assert (default.max_position_embeddings, default.sliding_window) == (32768, 4096)
    for bad in (0, -3, "8", True):
        with pytest.raises(ConfigError, match="sliding_window"):
            model_from_hf(dict(SMALL, model_type="mistral", sliding_window=bad))


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_qwen_slides_one_window_over_every_layer_or_none(model_type: str) -> None:
    """Qwen's window keys as checkpoints write them: transformers < 4.55 (use_sliding_window, from
    max_window_layers on) and later (layer_types). Every layer sliding is one window; none, no window;
    some layers only is refused, never served as if it were one or the other."""
    def window(**keys: object) -> int | None:
        return model_from_hf(dict(SMALL, model_type=model_type, **keys)).config.sliding_window

    assert window(use_sliding_window=False, sliding_window=32768, max_window_layers=21) is None  # Qwen2.5's
    assert window(sliding_window=None, layer_types=["full_attention"] * 2) is None
    assert window(use_sliding_window=True, sliding_window=16, max_window_layers=0) == 16
    assert window(sliding_window=16, layer_types=["sliding_attention"] * 2) == 16
    assert window(use_sliding_window=True, sliding_window=4096, max_window_layers=0) is None  # wider than 512
    for keys in (dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
                 dict(sliding_window=16, layer_types=["full_attention", "sliding_attention"])):
        with pytest.raises(ConfigError, match="some layers only"):
            window(**keys)


def test_qwen_checkpoints_load_their_biases_and_head_norms(tmp_path: Any) -> None:
    """Qwen2's q|k|v biases and Qwen3's q/k norms land in each layer, in q|k|v order; a missing or
    misshapen one names the tensor."""
    cfg = dict(SMALL, head_dim=8)  # 4 heads x 8 = 32 wide queries on a hidden size of 16
    write_hf_checkpoint(tmp_path / "q2", dict(cfg, model_type="qwen2"), seed=5)
    write_hf_checkpoint(tmp_path / "q3", dict(cfg, model_type="qwen3"), seed=5)
    q2, q3 = load_hf_dir(tmp_path / "q2"), load_hf_dir(tmp_path / "q3")
    tensors = Qwen2.from_hf(dict(cfg, model_type="qwen2")).random_hf_weights(5)
    want = np.concatenate([tensors[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv"])
    np.testing.assert_array_equal(np.asarray(q2.params["layers"][1]["bqkv"]), want)
    assert want.shape == (32 + 2 * 16,) and "q_norm" not in q2.params["layers"][0]
    assert q3.params["layers"][0]["q_norm"].shape == (8,) and "bqkv" not in q3.params["layers"][0]
    model = Qwen3.from_hf(dict(cfg, model_type="qwen3"))
    weights = model.random_hf_weights(5)
    weights["model.layers.0.self_attn.k_norm.weight"] = np.ones(4, np.float32)
    with pytest.raises(ValueError, match=r"k_norm.weight: expected shape \(8,\), got \(4,\)"):
        model.load_params(weights.__getitem__, "float32")
    del weights["model.layers.0.self_attn.k_norm.weight"]
    with pytest.raises(KeyError, match="k_norm"):
        model.load_params(weights.__getitem__, "float32")


def test_a_mistral_checkpoint_loads_as_mistral_with_llamas_tensor_layout(tmp_path: Any) -> None:
    """The same tensors under the same names give the same parameters; only the configuration differs."""
    write_hf_checkpoint(tmp_path / "m", dict(SMALL, model_type="mistral", sliding_window=None), seed=4)
    write_hf_checkpoint(tmp_path / "l", dict(SMALL, model_type="llama"), seed=4)
    mistral, llama = load_hf_dir(tmp_path / "m"), load_hf_dir(tmp_path / "l")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["architectures"] == ["MistralForCausalLM"]
    assert type(mistral.model) is Mistral and type(llama.model) is Llama
    for a, b in zip(mistral.params["layers"], llama.params["layers"], strict=True):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
