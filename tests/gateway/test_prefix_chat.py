"""The gateway's chat prompts hash as the worker tokenizes them: PrefixHasher's ids for a chat (through
the tokenizer's ChatRenderer, no jinja for a template that allows it) equal ``encode_chat``'s, for the
byte tokenizer and a Hugging Face one (whose template spells out its bos), tools included."""

from __future__ import annotations

import json
import random
from pathlib import Path

from gateway.routing.chain_memo import u32le
from gateway.routing.prefix import _ids_of
from inference.tokenizer import ByteTokenizer, load_tokenizer
from tests.inference.test_tokenizer import _write_hf
from transport.messages import SamplingParams, Submit

TOOLS = json.dumps([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])


def _chats(n: int) -> list[tuple[dict[str, str], ...]]:
    rng = random.Random(7)
    words = ["hello", "world", " ", "\n", "é😀", "the fox", ""]
    return [tuple({"role": rng.choice(["system", "user", "assistant"]),
                   "content": "".join(rng.choice(words) for _ in range(rng.randint(0, 5)))}
                  for _ in range(rng.randint(1, 5))) for _ in range(n)]


def test_chat_ids_equal_encode_chat(tmp_path: Path) -> None:
    _write_hf(tmp_path)
    for tok in (ByteTokenizer(), load_tokenizer(str(tmp_path))):
        ids = _ids_of(tok)
        for i, chat in enumerate(_chats(200)):
            tools = TOOLS if i % 3 == 0 else None
            sub = Submit(1, "m", SamplingParams(max_tokens=1, tools=tools or ""), messages=chat)
            want = tok.encode_chat(chat, tools=json.loads(tools) if tools else None)
            assert ids.u32le(sub) == u32le(want), chat
