"""The model registry: ``model_type`` picks the architecture, each entry is a whole :class:`Model`, and
Mistral's sliding window is served by capping the context. (Logits against transformers for every
entry: ``test_parity.py``.)"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from inference.model.config import ConfigError
from inference.model.llama import Llama
from inference.model.mistral import Mistral
from inference.model.registry import ARCHITECTURES, Model, model_from_hf
from inference.weights import load_hf_dir, write_hf_checkpoint

SMALL = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, eos_token_id=3)
MEMBERS = [name for name in Model.__dict__ if not name.startswith("_")]  # the protocol's methods and attributes


def test_model_type_picks_the_architecture() -> None:
    assert type(model_from_hf(dict(SMALL, model_type="llama"))) is Llama
    assert type(model_from_hf(dict(SMALL, model_type="mistral"))) is Mistral
    assert type(model_from_hf(SMALL)) is Llama  # no model_type: an older Llama export
    with pytest.raises(ConfigError, match=r"unsupported model_type 'gpt2'; expected one of \['llama', 'mistral'\]"):
        model_from_hf(dict(SMALL, model_type="gpt2"))


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_every_entry_is_a_whole_model_that_round_trips_its_config(model_type: str) -> None:
    model = model_from_hf(dict(SMALL, model_type=model_type))
    assert {"config", "prefill", "decode", "load_params", "calibrate"} <= set(MEMBERS)
    assert all(hasattr(model, name) for name in MEMBERS), [n for n in MEMBERS if not hasattr(model, n)]
    assert model.model_type == model_type
    written = model.hf_config()
    assert written["model_type"] == model_type and model_from_hf(json.loads(json.dumps(written))) == model


@pytest.mark.parametrize("window,context", [(64, 64), (4096, 512), (None, 512)])
def test_mistral_serves_its_sliding_window_by_capping_the_context(window: int | None, context: int) -> None:
    """A window no wider than the context caps it (no key the window would hide is ever held); none
    (Mistral v0.2 and later) leaves it; a config.json without the key gets transformers' default, 4096."""
    model = model_from_hf(dict(SMALL, model_type="mistral", sliding_window=window))
    assert model.config.max_position_embeddings == context and model.sliding_window == window
    assert model_from_hf(dict(SMALL, model_type="mistral", max_position_embeddings=8192)).config \
        .max_position_embeddings == 4096
    with pytest.raises(ConfigError, match="sliding_window"):
        model_from_hf(dict(SMALL, model_type="mistral", sliding_window=0))


def test_a_mistral_checkpoint_loads_as_mistral_with_llamas_tensor_layout(tmp_path: Any) -> None:
    """The same tensors under the same names give the same parameters; only the configuration differs."""
    write_hf_checkpoint(tmp_path / "m", dict(SMALL, model_type="mistral", sliding_window=None), seed=4)
    write_hf_checkpoint(tmp_path / "l", dict(SMALL, model_type="llama"), seed=4)
    mistral, llama = load_hf_dir(tmp_path / "m"), load_hf_dir(tmp_path / "l")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["architectures"] == ["MistralForCausalLM"]
    assert type(mistral.model) is Mistral and type(llama.model) is Llama
    for a, b in zip(mistral.params["layers"], llama.params["layers"], strict=True):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
