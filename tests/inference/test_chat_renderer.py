"""ChatRenderer: a chat template's text from a skeleton per chat shape, equal to jinja's full render.

Random chats (roles, empty and whitespace-edged contents, tool calls, tools, contents holding the
skeleton's own marker characters) through the tiny template and the families' published ones
(Qwen2.5 and Mistral take the skeleton path; Qwen3 tests its contents, so renders every time), and
templates that use a content in ways a skeleton cannot reproduce: each is refused, and still equal.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from inference.tokenizer import TINY_CHAT_TEMPLATE, ByteTokenizer, ChatRenderer, TokenizerError, _render
from tests.integration.hf_checkpoints import TEMPLATES

EXTRA = {"bos_token": "<s>", "eos_token": "</s>"}
TOOLS = json.dumps([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}])
PIECES = ["hello", " ", "\n", "  padded  ", "é€😀", "{{ x }}", "<|im_end|>", "\ue000", "\ue0000\ue001", "[INST]", "0"]


def _content(rng: random.Random) -> str:
    if rng.random() < 0.15:
        return ""
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 6)))


def _chat(rng: random.Random, alternate: bool) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if not alternate and rng.random() < 0.6:
        out.append({"role": "system", "content": _content(rng)})
    for i in range(rng.randint(1, 6)):
        role = ("user", "assistant")[i % 2] if alternate else rng.choice(["user", "assistant", "tool", "user"])
        m: dict[str, Any] = {"role": role, "content": _content(rng)}
        if role == "assistant" and not alternate and rng.random() < 0.3:
            m["tool_calls"] = [{"type": "function", "function": {"name": "get_weather",
                                                                   "arguments": {"city": _content(rng)}}}]
        out.append(m)
    return out


def _full(template: str, chat: list[dict[str, Any]], agp: bool, tools: str | None) -> str | type[Exception]:
    try:
        return _render(template, chat, agp, tools=json.loads(tools) if tools else None, **EXTRA)
    except TokenizerError:
        return TokenizerError


@pytest.mark.parametrize("name,fast", [("tiny", True), ("qwen2", True), ("mistral", True), ("qwen3", False)])
def test_random_chats_render_as_the_template_does(name: str, fast: bool) -> None:
    template = TINY_CHAT_TEMPLATE if name == "tiny" else TEMPLATES[name]
    r = ChatRenderer(template, **EXTRA)
    assert r.fast is fast
    rng = random.Random(name)
    for _ in range(400):
        chat = _chat(rng, alternate=name == "mistral" and rng.random() < 0.8)
        agp, tools = rng.random() < 0.8, TOOLS if rng.random() < 0.2 else None
        want = _full(template, chat, agp, tools)
        if want is TokenizerError:
            with pytest.raises(TokenizerError):
                r.render(chat, agp, tools)
        else:
            assert r.render(chat, agp, tools) == want, chat
    if fast:  # chats of one shape share one skeleton
        assert 0 < len(r.skeletons) < 400


@pytest.mark.parametrize("template", [
    "{% for m in messages %}{{ m.content | trim }}{% endfor %}",
    "{% for m in messages %}{{ m['content'].strip() }}{% endfor %}",
    "{% for m in messages %}{% if m.content.startswith('/') %}cmd{% endif %}{{ m.content }}{% endfor %}",
    "{% for m in messages %}{% if '</think>' in m.content %}t{% endif %}{{ m.content }}{% endfor %}",
    "{% for m in messages %}{{ m.content if m.content == 'x' else 'y' }}{% endfor %}",
    "{% for m in messages %}{{ m }}{% endfor %}",
    "{% for m in messages %}{{ m | tojson }}{% endfor %}",
    "{% set first = messages[0] %}{{ first.content | upper }}{% for m in messages %}{{ m.content }}{% endfor %}",
    "{% set messages = messages[1:] %}{% for m in messages %}{{ m.content }}{% endfor %}",
    "{% for m in messages %}{{ m.content }}{{ loop.nextitem.content | length if loop.nextitem }}{% endfor %}",
    "{% for m in messages %}{% filter upper %}{{ m.content }}{% endfilter %}{% endfor %}",
    "{% for m in messages %}{% set c %}{{ m.content }}{% endset %}{{ c | trim }}{% endfor %}",
    "{% for m in messages %}{{ m.content }}{% endfor %}{{ strftime_now('%d %b %Y') }}",
    "{% for m in messages %}{{ m.get('content') | length }}{% endfor %}",
    "{% for m in messages %}{% set ns = namespace(c=m.content) %}{{ ns.c[:3] }}{% endfor %}",
    "{% for m in messages %}{% for ch in m.content %}{{ ch }}.{% endfor %}{% endfor %}",
    "{% for m in messages|selectattr('role', 'equalto', 'user') %}{{ m.content | trim }}{% endfor %}",
])
def test_templates_that_read_contents_render_every_time(template: str) -> None:
    r = ChatRenderer(template, **EXTRA)
    assert not r.fast
    chat = [{"role": "user", "content": "  /x</think> "}, {"role": "assistant", "content": "y"}]
    assert r.render(chat, True, None) == _full(template, chat, True, None)


def test_printing_and_testing_contents_takes_the_skeleton() -> None:
    template = ("{% for m in messages %}{% if m.content %}<{{ m['role'] + ':' ~ m.content }}>{% endif %}"
                "{{ (m.get('content') or '-') if m.content is string }}{% endfor %}")
    r = ChatRenderer(template)
    assert r.fast
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]
    assert r.render(chat, True, None) == "<user:a>a-"
    assert r.render([{"role": "user", "content": "b c"}, chat[1]], True, None) == "<user:b c>b c-"
    assert len(r.skeletons) == 1


def test_the_byte_tokenizer_encodes_the_rendered_chat_as_encode_chat() -> None:
    tok = ByteTokenizer()
    r = tok.chat_renderer()
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    assert tok.encode_rendered(r.render(chat, True, TOOLS)) == tok.encode_chat(chat, tools=json.loads(TOOLS))


def test_the_skeletons_are_bounded() -> None:
    r = ChatRenderer(TINY_CHAT_TEMPLATE, max_shapes=2)
    for n in range(1, 6):  # five shapes: one to five messages
        chat = [{"role": "user", "content": f"q{i}"} for i in range(n)]
        assert r.render(chat) == _full(TINY_CHAT_TEMPLATE, chat, True, None)
        assert len(r.skeletons) <= 2
