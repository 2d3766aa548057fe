"""A tiny Hugging Face causal LM written here, for an OpenAI-compatible server that is not quicserve.

:func:`write_tiny_model` writes a 2-layer Llama with random weights and a byte-level BPE tokenizer
trained on a sentence, in the layout ``from_pretrained`` reads (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json): nothing is downloaded, and neither torch nor transformers
is imported to write it (numpy, safetensors and tokenizers do). The model has no end-of-sequence
token at all (none in the tokenizer, the model config or the generation config), so every
generation runs to ``max_tokens``, as quicserve's synthetic engine does; a chat template of our
own makes the chat endpoint work. The vocabulary holds printable ASCII only (byte-level BPE over
those bytes, space and newline): every token is whole text, so a server can stream a piece of
text a token and never holds back part of a character.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

__all__ = ["write_tiny_model"]

_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
_HIDDEN, _FFN, _LAYERS, _HEADS, _KV_HEADS, _HEAD_DIM = 32, 64, 2, 4, 2, 8


def _tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = [chr(c) for c in range(33, 127)] + ["\u0120", "\u010a"]  # GPT-2's byte map: space, newline
    trainer = trainers.BpeTrainer(vocab_size=200, initial_alphabet=alphabet, limit_alphabet=len(alphabet))
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog,\nhello world: user assistant"] * 20,
                            trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": _TEMPLATE, "model_max_length": 2048}))
    vocab: int = tok.get_vocab_size()
    return vocab


def _weights(vocab: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    q, kv = _HEADS * _HEAD_DIM, _KV_HEADS * _HEAD_DIM
    out = {"model.embed_tokens.weight": w(vocab, _HIDDEN), "model.norm.weight": np.ones(_HIDDEN, np.float32),
           "lm_head.weight": w(vocab, _HIDDEN)}
    for i in range(_LAYERS):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": w(q, _HIDDEN), p + "self_attn.k_proj.weight": w(kv, _HIDDEN),
                p + "self_attn.v_proj.weight": w(kv, _HIDDEN), p + "self_attn.o_proj.weight": w(_HIDDEN, q),
                p + "mlp.gate_proj.weight": w(_FFN, _HIDDEN), p + "mlp.up_proj.weight": w(_FFN, _HIDDEN),
                p + "mlp.down_proj.weight": w(_HIDDEN, _FFN),
                p + "input_layernorm.weight": np.ones(_HIDDEN, np.float32),
                p + "post_attention_layernorm.weight": np.ones(_HIDDEN, np.float32)}
    return out


def write_tiny_model(out: Path, seed: int = 0) -> None:
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    vocab = _tokenizer(out)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
              "hidden_size": _HIDDEN, "intermediate_size": _FFN, "num_hidden_layers": _LAYERS,
              "num_attention_heads": _HEADS, "num_key_value_heads": _KV_HEADS, "head_dim": _HEAD_DIM,
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "hidden_act": "silu", "rope_theta": 10000.0,
              "tie_word_embeddings": False, "torch_dtype": "float32",
              "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    (out / "config.json").write_text(json.dumps(config))
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    save_file(_weights(vocab, seed), str(out / "model.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    write_tiny_model(Path(sys.argv[1]))
