"""The families' published chat templates render, and tokenize, as transformers renders them: Qwen2.5's
and Qwen3's (tools as JSON with its characters unescaped, tool calls and responses, Qwen3's reasoning
kept on the last turn only) and Mistral's (bos spelled by the template, roles that must alternate)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

from inference.tokenizer import TokenizerError, load_tokenizer  # noqa: E402
from tests.integration.hf_checkpoints import write_checkpoint  # noqa: E402

TINY = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=64)
TOOLS = [{"type": "function", "function": {"name": "legs", "description": "Count <legs> & 'feet'",
                                           "parameters": {"type": "object", "properties": {"animal": {
                                               "type": "string", "enum": ["spider", "fox"]}}}}}]
CHATS: dict[str, list[dict[str, Any]]] = {
    "plain": [{"role": "user", "content": "how many legs does a spider have?"}],
    "system and turns": [{"role": "system", "content": "You are a helpful assistant."},
                         {"role": "user", "content": "the quick brown fox"},
                         {"role": "assistant", "content": "<think>\nfoxes\n</think>\n\njumps"},
                         {"role": "user", "content": "over the lazy dog?"}],
    "tool round trip": [{"role": "user", "content": "legs of a spider?"},
                        {"role": "assistant", "content": "", "tool_calls": [
                            {"type": "function", "function": {"name": "legs", "arguments": {"animal": "spider"}}}]},
                        {"role": "tool", "content": "8"}],
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for model_type in ("qwen2", "qwen3", "mistral"):
        out[model_type] = path = tmp_path_factory.mktemp(model_type)
        write_checkpoint(path, model_type, dict(TINY, head_dim=8) if model_type == "qwen3" else TINY)
    return out


# Mistral's template takes alternating user and assistant turns only (refused below).
@pytest.mark.parametrize("model_type,chat", [("qwen2", c) for c in CHATS] + [("qwen3", c) for c in CHATS]
                         + [("mistral", "plain")])
def test_a_chat_renders_and_tokenizes_as_transformers_does(checkpoints: dict[str, Path], model_type: str,
                                                           chat: str) -> None:
    path, messages = checkpoints[model_type], CHATS[chat]
    ours, theirs = load_tokenizer(str(path)), transformers.AutoTokenizer.from_pretrained(str(path))
    tools = TOOLS if chat == "tool round trip" else None
    want = theirs.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(messages, tools=tools) == want
    ids = theirs.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                     return_dict=False)
    assert ours.encode_chat(messages, tools=tools) == list(ids)
    if tools is not None:
        assert "<legs> & 'feet'" in want  # JSON as json.dumps writes it, no HTML escapes


def test_mistrals_template_refuses_what_it_cannot_say(checkpoints: dict[str, Path]) -> None:
    tok = load_tokenizer(str(checkpoints["mistral"]))
    with pytest.raises(TokenizerError, match="alternate"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
