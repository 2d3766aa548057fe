"""Byte-level and Hugging Face tokenizers, chat templates, incremental decode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inference.tokenizer import ByteTokenizer, HFTokenizer, TokenizerError, load_tokenizer


def test_byte_tokenizer_round_trip_and_specials() -> None:
    tok = load_tokenizer("tiny")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 258
    ids = tok.encode("héllo")
    assert ids[0] == 256 and ids[1:] == list("héllo".encode())
    assert tok.encode("a", add_special_tokens=False) == [97]
    assert tok.decode([256, *ids[1:], 257]) == "héllo"
    assert tok.eos_token_ids == (257,) and tok.bos_token_id == 256


def test_byte_incremental_decoder_holds_incomplete_utf8() -> None:
    dec = ByteTokenizer().incremental_decoder()
    pieces = [dec.push(b) for b in "a€😀".encode()]
    assert pieces == ["a", "", "", "€", "", "", "", "😀"]
    dec.push(0xE2)
    assert dec.flush() == "\ufffd"


def test_tiny_chat_template() -> None:
    tok = ByteTokenizer()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs)
    assert text == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    assert tok.encode_chat(msgs) == tok.encode(text)
    with pytest.raises(TokenizerError):
        tok.apply_chat_template([{"content": "no role"}])


def _write_hf(d: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<eot>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(["hello world", "héllo wörld 😀 日本語", "the quick brown fox"] * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(d / "tokenizer.json"))
    template = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    (d / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": template})
    )
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2], "bos_token_id": 0}))


def test_hf_directory_tokenizer(tmp_path: Path) -> None:
    _write_hf(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_token_ids == (1, 2) and tok.bos_token_id == 0
    text = "héllo wörld 😀 日本語 the fox"
    ids = tok.encode(text)
    assert ids[0] == 0 and tok.decode(ids) == text
    dec = tok.incremental_decoder(ids[:1])
    pieces = [dec.push(i) for i in ids[1:]]
    pieces.append(dec.flush())
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)
    chat = tok.encode_chat([{"role": "user", "content": "hello"}])
    assert chat.count(0) == 1 and chat[0] == 0  # the template's bos only, not twice
    assert tok.decode(chat) == "[user]hello[assistant]"


def test_bad_model_names_and_dirs(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError):
        load_tokenizer("no-such-model")
    with pytest.raises(TokenizerError):
        load_tokenizer(str(tmp_path))  # no tokenizer.json
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError):
        load_tokenizer(str(tmp_path))


def test_chat_template_compiled_once_and_errors_stay_clear() -> None:
    from inference.tokenizer import _compiled

    tok = ByteTokenizer("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    _compiled.cache_clear()
    for i in range(5):
        assert tok.apply_chat_template([{"role": "user", "content": str(i)}]) == f"<user>{i}"
    info = _compiled.cache_info()
    assert (info.misses, info.hits) == (1, 4)
    with pytest.raises(TokenizerError, match="chat template"):
        ByteTokenizer("{% for m in messages %}").apply_chat_template([{"role": "user", "content": "x"}])
    raising = ByteTokenizer("{{ raise_exception('only user turns') }}")
    for _ in range(2):  # the cached template still raises through its hook
        with pytest.raises(TokenizerError, match="only user turns"):
            raising.apply_chat_template([{"role": "system", "content": "x"}])
