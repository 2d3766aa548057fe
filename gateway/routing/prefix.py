"""Prompt prefix hashes computed in the gateway, the way the worker's prefix cache names them.

A routing policy that wants to send a prompt where its prefix is already cached
(``uses_prefix_hashes``) needs the chain of block hashes the worker's KV cache
would give the prompt (:func:`transport.common.prefix.chain_hashes`). That takes the
worker's tokens, so :class:`PrefixHasher` tokenizes the prompt exactly as the
worker does (``inference.service``: ``prompt`` -> ``encode``, ``messages`` ->
``encode_chat``, token ids as given) with the same tokenizer files, and hashes
them with the replica's ``Hello.block_size`` when its ``Hello.prefix_hash``
names the scheme this gateway computes.

Only the pool of a policy that asks for hashes has a hasher: tokenizing and hashing cost
µs per request (a chat's text -- from a skeleton per chat shape where its template allows,
``inference.tokenizer.ChatRenderer``, else the template rendered -- the tokenizer, then the chain through
:class:`~gateway.routing.chain_memo.ChainMemo`), which least-loaded routing does not pay. The
chain is hashed from u32le bytes: token ids packed once, the byte tokenizer's straight from the
text; with ``held`` (cache_aware's index) it stops after the first block no replica holds.
Tokenizers are loaded on first sight of a worker's ``Hello.model_id`` (``"tiny"`` or a
checkpoint directory, which must be readable here: a remote worker's model that this host
lacks gets no hashes, once logged). ``inference.tokenizer`` is the one module of ``inference`` the
gateway imports: it has no JAX (``tests/gateway/test_no_jax.py``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Container, Mapping, Sequence
from typing import Any, Protocol

from transport.api import WorkerConnection
from transport.common.prefix import PREFIX_HASH_SCHEME
from transport.messages import Submit

from .chain_memo import ChainMemo, u32le
from .policy import RouteRequest

__all__ = ["PrefixHasher", "PromptTokenizer", "prompt_token_ids", "ChainMemo"]

log = logging.getLogger("quicserve.routing")


class PromptTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]: ...


def _tools(submit: Submit) -> Any:
    return json.loads(submit.params.tools) if submit.params.tools else None


def prompt_token_ids(tokenizer: PromptTokenizer, submit: Submit) -> Sequence[int]:
    """The prompt's token ids as the worker computes them from ``submit`` (``inference.service``)."""
    if submit.prompt_token_ids is not None:
        return submit.prompt_token_ids
    if submit.prompt is not None:
        return tokenizer.encode(submit.prompt)
    return tokenizer.encode_chat(submit.messages or (), tools=_tools(submit))


class _ChatRenderer(Protocol):  # inference.tokenizer.ChatRenderer
    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools_json: str | None = None) -> str: ...


class _RendersChats(PromptTokenizer, Protocol):  # the tokenizers of inference.tokenizer
    def chat_renderer(self) -> _ChatRenderer | None: ...

    def encode_rendered(self, text: str) -> list[int]: ...


class _Ids:
    """A prompt's token ids as u32le bytes (what the hash chain reads): the tokenizer's ids, packed."""

    __slots__ = ("tok",)

    def __init__(self, tok: PromptTokenizer) -> None:
        self.tok = tok

    def u32le(self, submit: Submit) -> bytes:
        ids = submit.prompt_token_ids
        return u32le(ids) if ids is not None else self.encode(submit)

    def encode(self, submit: Submit) -> bytes:
        """A text or chat prompt's ids."""
        return u32le(prompt_token_ids(self.tok, submit))


class _Rendered(_Ids):
    """A tokenizer of ``inference.tokenizer``'s: a chat is rendered by its ``chat_renderer()`` (the
    template's text without jinja for the templates that allow it: ``ChatRenderer``), then tokenized
    by its ``encode_rendered`` (what ``encode_chat`` does after rendering)."""

    __slots__ = ("chat", "rendered")

    def __init__(self, tok: _RendersChats) -> None:
        super().__init__(tok)
        self.chat = tok.chat_renderer()
        self.rendered = tok.encode_rendered

    def encode(self, submit: Submit) -> bytes:
        if submit.prompt is None and self.chat is not None:
            return u32le(self.rendered(self.chat.render(submit.messages or (), True, submit.params.tools or None)))
        return u32le(prompt_token_ids(self.tok, submit))


class _ByteLevel(_Rendered):
    """The byte tokenizer's (``"tiny"``): its ids are ``encode("")`` (the BOS) then the text's UTF-8
    bytes, so the bytes come from the text in C (Latin-1 maps a byte to the code point of its
    value, UTF-32 writes that as a u32), never a list of ints."""

    __slots__ = ("_bos",)

    def __init__(self, tok: _RendersChats) -> None:
        super().__init__(tok)
        self._bos = u32le(tok.encode(""))

    def encode(self, submit: Submit) -> bytes:
        text = submit.prompt
        if text is None:
            if self.chat is None:
                return super().encode(submit)
            text = self.chat.render(submit.messages or (), True, submit.params.tools or None)
        return self._bos + text.encode().decode("latin-1").encode("utf-32-le")


def _load(model_id: str) -> PromptTokenizer:
    from inference.tokenizer import load_tokenizer  # JAX-free; loaded only when a policy wants hashes

    tok: PromptTokenizer = load_tokenizer(model_id)
    return tok


def _ids_of(tok: PromptTokenizer) -> _Ids:
    from inference.tokenizer import ByteTokenizer, HFTokenizer  # (loaded already: _load's module)

    if isinstance(tok, ByteTokenizer):
        return _ByteLevel(tok)
    return _Rendered(tok) if isinstance(tok, HFTokenizer) else _Ids(tok)


class PrefixHasher:
    """Fills ``RouteRequest.prefix_hashes`` (and the exact ``prompt_tokens``) for a pool whose
    policy reads them; with ``held`` (the hashes some replica holds: ``cache_aware``'s index),
    the chain stops after the first block not in it (no replica could serve what follows)."""

    def __init__(self, limit: int = 64, load: Callable[[str], PromptTokenizer] = _load,
                 held: Container[int] | None = None) -> None:
        self.limit = limit  # blocks hashed from the start of the prompt
        self.held = held
        self._load = load
        self._tokenizers: dict[str, _Ids | None] = {}
        self.memo = ChainMemo()

    def tokenizer(self, model_id: str) -> PromptTokenizer | None:
        ids = self._ids(model_id)
        return None if ids is None else ids.tok

    def _ids(self, model_id: str) -> _Ids | None:
        if model_id in self._tokenizers:
            return self._tokenizers[model_id]
        ids: _Ids | None
        try:
            ids = _ids_of(self._load(model_id))
        except Exception as e:  # noqa: BLE001 (a bad or absent checkpoint: route without hashes)
            log.warning("no prefix hashes for model %r: its tokenizer cannot be loaded here (%s)", model_id, e)
            ids = None
        self._tokenizers[model_id] = ids
        return ids

    def annotate(self, req: RouteRequest, make_submit: Callable[[int], Submit],
                 replicas: Sequence[WorkerConnection]) -> RouteRequest:
        """``req`` with the prompt's block hashes for the first replica that has a prefix cache of
        this gateway's scheme (replicas of one model share the model, hence its tokenizer; they are
        expected to share a block size: a replica with another size sees hashes it cannot match).
        Unchanged when no replica qualifies or the prompt cannot be tokenized here (the worker
        reports that error)."""
        for conn in replicas:
            hello = conn.peer_hello
            if hello.prefix_hash == PREFIX_HASH_SCHEME and hello.block_size > 0:
                break
        else:
            return req
        ids = self._tokenizers.get(hello.model_id) or self._ids(hello.model_id)
        if ids is None:
            return req
        try:
            buf = ids.u32le(make_submit(0))
        except Exception:  # noqa: BLE001 (a prompt the template refuses, an id out of u32: the worker says why)
            return req
        return req._replace(prompt_tokens=len(buf) >> 2,
                            prefix_hashes=self.memo.chain_bytes(buf, hello.block_size, self.limit, self.held))
