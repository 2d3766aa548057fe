"""Tokenizers for the worker: a byte-level one for the built-in ``tiny`` model
and Hugging Face ``tokenizers`` for checkpoint directories. No JAX, no network.

Both hand out an :class:`IncrementalDecoder` per request that turns token ids
into text deltas one token at a time, holding back bytes/tokens that do not
yet form complete UTF-8 characters, so a streamed text never contains a
half-character replacement glyph that a later token would have completed.
"""

from __future__ import annotations

import codecs
import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "Tokenizer",
    "IncrementalDecoder",
    "ByteTokenizer",
    "HFTokenizer",
    "TokenizerError",
    "load_tokenizer",
    "TINY_CHAT_TEMPLATE",
    "ChatRenderer",
]

TINY_CHAT_TEMPLATE = (
    "{% if tools %}<|tools|>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] or '' }}"
    "{% for call in message['tool_calls'] or [] %}<tool_call>{\"name\": {{ call['function']['name'] | tojson }}, "
    "\"arguments\": {{ call['function']['arguments'] }}}</tool_call>{% endfor %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class TokenizerError(ValueError):
    """Bad tokenizer files, bad token ids or a chat the template cannot render."""


class IncrementalDecoder(Protocol):
    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (may be "")."""
        ...

    def flush(self) -> str:
        """Return any held-back text (incomplete characters become U+FFFD)."""
        ...


class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str: ...

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]: ...

    def incremental_decoder(self, prompt_ids: Sequence[int] = ()) -> IncrementalDecoder: ...


def _raise_exception(message: str) -> None:  # the template's own error hook
    raise TokenizerError(f"chat template: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=32)
def _compiled(template: str) -> Any:
    """The template compiled once per text (the tiny template: compiling ~1.2 ms, rendering ~20 µs)."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # As transformers renders them: break/continue, and a tojson that does not escape HTML (Qwen's tools).
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except TemplateError as exc:
        raise TokenizerError(f"chat template failed: {exc}") from exc


def _render(
    template: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, **extra: Any
) -> str:
    from jinja2 import TemplateError

    for m in messages:
        if not isinstance(m, Mapping) or "role" not in m:
            raise TokenizerError("each chat message needs a 'role'")
    compiled = _compiled(template)
    try:
        text = compiled.render(messages=list(messages), add_generation_prompt=add_generation_prompt, **extra)
        return str(text)
    except TemplateError as exc:
        raise TokenizerError(f"chat template failed: {exc}") from exc


class _ByteDecoder:
    __slots__ = ("_dec",)

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if 0 <= token_id < 256:
            return str(self._dec.decode(bytes((token_id,))))
        return ""

    def flush(self) -> str:
        return str(self._dec.decode(b"", final=True))


class ByteTokenizer:
    """ids 0..255 are bytes, 256 = ``<s>`` (bos), 257 = ``</s>`` (eos)."""

    BOS = 256
    EOS = 257

    def __init__(self, chat_template: str = TINY_CHAT_TEMPLATE) -> None:
        self.vocab_size = 258
        self.bos_token_id: int | None = self.BOS
        self.eos_token_ids: tuple[int, ...] = (self.EOS,)
        self.chat_template = chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        return _render(self.chat_template, messages, add_generation_prompt, tools=tools)

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools))

    def chat_renderer(self) -> ChatRenderer:
        """:meth:`apply_chat_template`'s text, fast (a router's; see :class:`ChatRenderer`)."""
        return ChatRenderer(self.chat_template)

    def encode_rendered(self, text: str) -> list[int]:
        """:meth:`encode_chat`'s ids from its rendered text."""
        return self.encode(text)

    def incremental_decoder(self, prompt_ids: Sequence[int] = ()) -> IncrementalDecoder:
        return _ByteDecoder()


class _HFDecoder:
    """The prefix/read-offset scheme: decode a short window twice and emit the
    difference once it no longer ends in an incomplete character."""

    __slots__ = ("_tok", "_ids", "_prefix", "_read")

    def __init__(self, tok: Any, prompt_ids: Sequence[int]) -> None:
        self._tok = tok
        self._ids = list(prompt_ids[-6:])
        self._prefix = 0
        self._read = len(self._ids)

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._emit(final=False)

    def _emit(self, final: bool) -> str:
        ids = self._ids
        prefix_text = self._tok.decode(ids[self._prefix : self._read], skip_special_tokens=True)
        new_text = self._tok.decode(ids[self._prefix :], skip_special_tokens=True)
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            delta = str(new_text[len(prefix_text) :])
            self._prefix = self._read
            self._read = len(ids)
            if self._prefix > 64:  # keep the window short
                del ids[: self._prefix]
                self._read -= self._prefix
                self._prefix = 0
            return delta
        return ""

    def flush(self) -> str:
        if self._read == len(self._ids):
            return ""
        return self._emit(final=True)


class HFTokenizer:
    """A checkpoint directory's ``tokenizer.json`` + ``tokenizer_config.json``
    (chat template, bos/eos) + ``generation_config.json`` (eos ids)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _Tok

        d = Path(path)
        tj = d / "tokenizer.json"
        if not tj.is_file():
            raise TokenizerError(f"{d}: no tokenizer.json")
        try:
            self._tok = _Tok.from_file(str(tj))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise TokenizerError(f"{tj}: {exc}") from exc
        cfg = _read_json(d / "tokenizer_config.json")
        gen = _read_json(d / "generation_config.json")
        model_cfg = _read_json(d / "config.json")
        self.vocab_size = int(model_cfg.get("vocab_size") or self._tok.get_vocab_size(with_added_tokens=True))
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        bos_id = gen.get("bos_token_id", model_cfg.get("bos_token_id"))
        if bos_id is None and self.bos_token:
            bos_id = self._tok.token_to_id(self.bos_token)
        self.bos_token_id: int | None = int(bos_id) if bos_id is not None else None
        eos: Any = gen.get("eos_token_id", model_cfg.get("eos_token_id"))
        if eos is None and self.eos_token:
            eos = self._tok.token_to_id(self.eos_token)
        self.eos_token_ids: tuple[int, ...] = tuple(int(e) for e in _as_list(eos))
        self.chat_template = _pick_template(cfg.get("chat_template"))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        if self.chat_template is None:
            raise TokenizerError("this model has no chat template")
        return _render(
            self.chat_template,
            messages,
            add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            tools=tools,
        )

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        return self.encode_rendered(self.apply_chat_template(messages, add_generation_prompt, tools))

    def chat_renderer(self) -> ChatRenderer | None:
        """:meth:`apply_chat_template`'s text, fast (a router's; see :class:`ChatRenderer`)."""
        if self.chat_template is None:
            return None
        return ChatRenderer(self.chat_template, bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_rendered(self, text: str) -> list[int]:
        """:meth:`encode_chat`'s ids from its rendered text."""
        # Templates that spell out the bos token already carry it.
        has_bos = bool(self.bos_token) and text.startswith(self.bos_token or "")
        return self.encode(text, add_special_tokens=not has_bos)

    def incremental_decoder(self, prompt_ids: Sequence[int] = ()) -> IncrementalDecoder:
        return _HFDecoder(self._tok, prompt_ids)

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what llguidance builds its token trie from)."""
        return str(self._tok.to_str())


def _read_json(p: Path) -> dict[str, Any]:
    if not p.is_file():
        return {}
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{p}: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{p}: expected a JSON object")
    return data


def _token_text(v: Any) -> str | None:
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _as_list(v: Any) -> Iterable[Any]:
    if v is None:
        return ()
    return v if isinstance(v, list) else (v,)


def _pick_template(v: Any) -> str | None:
    if isinstance(v, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in v if isinstance(t, dict)}
        v = named.get("default") or next(iter(named.values()), None)
    return v if isinstance(v, str) else None


def load_tokenizer(model: str) -> Tokenizer:
    """``"tiny"`` -> :class:`ByteTokenizer`; a directory with tokenizer.json ->
    :class:`HFTokenizer`. Never touches the network."""
    if model == "tiny":
        return ByteTokenizer()
    d = Path(model)
    if d.is_dir():
        if (d / "tokenizer.json").is_file():
            return HFTokenizer(d)
        raise TokenizerError(f"{d}: no tokenizer.json")
    raise TokenizerError(f"unknown model {model!r}: use 'tiny' or a local checkpoint directory")


# -- the chat template's text without the template engine, for prompts routed by their cache --------
#
# A router hashes a chat as the worker renders it, for each request: jinja's render costs ~10 µs of
# fixed overhead. Most templates print a message's content verbatim and branch only on its role, its
# other fields and whether it is empty; then the rendered text of every chat of one *shape* (those,
# per message, and the tools and add_generation_prompt) is one skeleton with each content pasted in.
# :func:`_contents_opaque` proves that from the template's syntax tree (a content may be printed,
# alone or concatenated, or tested for truth; anything else -- a filter, a method, a comparison, a
# whole message printed or assigned, ``loop.nextitem`` -- and the template renders every time).

_MARK = "\ue000"  # a content's stand-in: _MARK, its message's index, _MARK_END (private-use code points)
_MARK_END = "\ue001"
_SAFE_TESTS = frozenset({"defined", "undefined", "none", "string", "mapping", "sequence", "iterable"})
_UNSAFE_NAMES = frozenset({"strftime_now", "lipsum"})  # their text changes between renders


class _Opaque:
    """The check behind :func:`_contents_opaque` (a walk of jinja's nodes, each with how its value is used)."""

    def __init__(self, msg_vars: set[str]) -> None:
        self.msg_vars = msg_vars  # loop variables over the messages

    def messages(self, n: Any) -> bool:  # messages, or a slice of them
        from jinja2 import nodes

        if isinstance(n, nodes.Getitem) and isinstance(n.arg, nodes.Slice):
            n = n.node
        return isinstance(n, nodes.Name) and n.name == "messages"

    def message(self, n: Any) -> bool:  # a message: a loop variable over them, or messages[i]
        from jinja2 import nodes

        if isinstance(n, nodes.Name):
            return n.name in self.msg_vars
        return isinstance(n, nodes.Getitem) and not isinstance(n.arg, nodes.Slice) and self.messages(n.node) \
            and self.ok(n.arg, "value")  # messages[i]: its index may not depend on a content either

    def field(self, n: Any) -> str | None:  # the field a message[...] / message.x / message.get(x) reads
        from jinja2 import nodes

        if isinstance(n, nodes.Getattr) and self.message(n.node):
            return str(n.attr)
        if isinstance(n, nodes.Getitem) and self.message(n.node) and isinstance(n.arg, nodes.Const):
            return str(n.arg.value)
        if isinstance(n, nodes.Call) and isinstance(n.node, nodes.Getattr) and n.node.attr == "get" \
                and self.message(n.node.node) and n.args and isinstance(n.args[0], nodes.Const) \
                and not n.kwargs and n.dyn_args is None and n.dyn_kwargs is None \
                and all(isinstance(a, nodes.Const) for a in n.args):
            return str(n.args[0].value)
        return None

    def ok(self, n: Any, use: str) -> bool:  # use: "print" (printed as is), "test" (its truth), "value"
        from jinja2 import nodes

        f = self.field(n)
        if f is not None:
            return f != "content" or use in ("print", "test")
        if self.message(n) or self.messages(n):
            return False  # a whole message or the list, used some other way: it could carry a content anywhere
        if isinstance(n, nodes.Name):
            return n.name not in _UNSAFE_NAMES and not (n.ctx != "load" and (n.name == "messages" or
                                                                          n.name in self.msg_vars))
        if isinstance(n, (nodes.FilterBlock, nodes.AssignBlock, nodes.CallBlock, nodes.Macro, nodes.Include,
                          nodes.Import, nodes.FromImport, nodes.Extends, nodes.Block)):
            return False  # output captured or changed, or other templates
        if isinstance(n, nodes.Getattr) and isinstance(n.node, nodes.Name) and n.node.name == "loop":
            return n.attr not in ("previtem", "nextitem", "cycle")
        if isinstance(n, nodes.Output):
            return all(self.ok(c, "print") for c in n.nodes)
        if isinstance(n, (nodes.Add, nodes.Concat, nodes.And, nodes.Or)):
            inner = use if use != "test" or not isinstance(n, (nodes.Add, nodes.Concat)) else "value"
            return all(self.ok(c, inner) for c in n.iter_child_nodes())
        if isinstance(n, nodes.CondExpr):
            return self.ok(n.test, "test") and self.ok(n.expr1, use) and (n.expr2 is None or self.ok(n.expr2, use))
        if isinstance(n, nodes.Not):
            return self.ok(n.node, "test")
        if isinstance(n, nodes.If):
            return self.ok(n.test, "test") and all(self.ok(c, "value") for c in (*n.body, *n.elif_, *n.else_))
        if isinstance(n, nodes.Test) and n.name in _SAFE_TESTS and not n.args and not n.kwargs:
            subject = n.node
            if self.field(subject) is not None or self.message(subject) or self.messages(subject):
                return True  # a str content and a message are of one type whatever their text
        if isinstance(n, nodes.Compare) and len(n.ops) == 1 and n.ops[0].op in ("in", "notin") \
                and self.message(n.ops[0].expr):
            return self.ok(n.expr, "value")  # 'tool_calls' in message: its keys are in the shape
        if isinstance(n, nodes.Filter) and n.name in ("length", "count") and n.node is not None \
                and self.messages(n.node) and not n.args:
            return True
        if isinstance(n, nodes.For):
            if self.messages(n.iter):
                if not isinstance(n.target, nodes.Name) or n.target.name not in self.msg_vars:
                    return False
                rest = [c for c in n.iter_child_nodes() if c is not n.iter and c is not n.target]
                return (n.test is None or self.ok(n.test, "test")) and all(
                    self.ok(c, "value") for c in rest if c is not n.test)
        return all(self.ok(c, "value") for c in n.iter_child_nodes())


@functools.lru_cache(maxsize=32)
def _contents_opaque(template: str) -> bool:
    """Whether ``template`` uses each message's content only by printing it as it is or testing its truth
    (so a chat's text is its shape's skeleton with the contents pasted in)."""
    from jinja2 import TemplateError, nodes

    try:
        ast = _compiled(template).environment.parse(template)
    except (TemplateError, TokenizerError):
        return False
    loops = [n for n in ast.find_all(nodes.For) if isinstance(n.target, nodes.Name)]
    check = _Opaque(set())
    check.msg_vars = {str(n.target.name) for n in loops if check.messages(n.iter)}
    return check.ok(ast, "value")


_Skeleton = tuple[tuple[str, ...], tuple[int, ...]]  # the text between contents, and whose content goes where


class ChatRenderer:
    """``apply_chat_template``'s text for one template (and its extra variables), from a skeleton per chat
    shape when :func:`_contents_opaque` says the template allows it, else by rendering. ``tools`` come as
    their JSON text (the request's; parsed only to render a skeleton). Equal to the full render for every
    chat (``tests/inference/test_chat_renderer.py``)."""

    __slots__ = ("template", "extra", "fast", "skeletons", "max_shapes")

    def __init__(self, template: str, max_shapes: int = 1024, **extra: Any) -> None:
        self.template, self.extra, self.max_shapes = template, extra, max_shapes
        self.fast = _contents_opaque(template) and not any(_MARK in str(x) for x in (template, *extra.values()))
        self.skeletons: dict[tuple[Any, ...], _Skeleton | None] = {}

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools_json: str | None = None) -> str:
        if not self.fast or (tools_json and _MARK in tools_json):
            return self._full(messages, add_generation_prompt, tools_json)
        shape: list[Any] = [add_generation_prompt, tools_json]
        contents: list[str] = []
        for m in messages:  # (the skeleton's text, but for the contents, holds no marker but theirs)
            c = m.get("content") if type(m) is dict else None
            if type(c) is not str:
                return self._full(messages, add_generation_prompt, tools_json)
            contents.append(c)
            if len(m) == 2:
                role = m.get("role")
                if type(role) is not str or _MARK in role:
                    return self._full(messages, add_generation_prompt, tools_json)
                shape.append(role)
            else:
                rest = json.dumps({k: v for k, v in m.items() if k != "content"}, sort_keys=True, default=repr,
                                  ensure_ascii=False)
                if _MARK in rest:
                    return self._full(messages, add_generation_prompt, tools_json)
                shape.append((rest,))  # (never equal to a role's str)
            shape.append(not c)
        key = tuple(shape)
        try:
            sk = self.skeletons[key]
        except KeyError:
            sk = self._skeleton(key, messages, add_generation_prompt, tools_json)
        if sk is None:
            return self._full(messages, add_generation_prompt, tools_json)
        lits, which = sk
        out = [lits[0]]
        for lit, i in zip(lits[1:], which, strict=True):
            out.append(contents[i])
            out.append(lit)
        return "".join(out)

    def _full(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, tools_json: str | None) -> str:
        tools = json.loads(tools_json) if tools_json else None
        return _render(self.template, messages, add_generation_prompt, tools=tools, **self.extra)

    def _skeleton(self, key: tuple[Any, ...], messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                  tools_json: str | None) -> _Skeleton | None:
        import re

        marked = [{**m, "content": f"{_MARK}{i}{_MARK_END}" if m["content"] else ""} for i, m in enumerate(messages)]
        sk: _Skeleton | None
        try:
            text = self._full(marked, add_generation_prompt, tools_json)
        except (TokenizerError, ValueError):  # (the full render says it again, for the caller)
            sk = None
        else:
            parts = re.split(f"{_MARK}([0-9]+){_MARK_END}", text)
            lits, which = tuple(parts[0::2]), tuple(int(x) for x in parts[1::2])
            clean = not any(_MARK in s or _MARK_END in s for s in lits)
            sk = (lits, which) if clean and all(i < len(messages) for i in which) else None
        if len(self.skeletons) >= self.max_shapes:
            self.skeletons.clear()
        self.skeletons[key] = sk
        return sk
