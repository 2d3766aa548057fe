"""Prompt prefix hashes computed in the gateway, the way the worker's prefix cache names them.

A routing policy that wants to send a prompt where its prefix is already cached
(``uses_prefix_hashes``) needs the chain of block hashes the worker's KV cache
would give the prompt (:func:`transport.common.prefix.chain_hashes`). That takes the
worker's tokens, so :class:`PrefixHasher` tokenizes the prompt exactly as the
worker does (``inference.service``: ``prompt`` -> ``encode``, ``messages`` ->
``encode_chat``, token ids as given) with the same tokenizer files, and hashes
them with the replica's ``Hello.block_size`` when its ``Hello.prefix_hash``
names the scheme this gateway computes.

Only the pool of a policy that asks for hashes has a hasher: tokenizing costs
tens of µs per request (a chat template render plus the tokenizer), which
least-loaded routing does not pay. Tokenizers are loaded on first sight of a
worker's ``Hello.model_id`` (``"tiny"`` or a checkpoint directory, which must
be readable here: a remote worker's model that this host lacks gets no hashes,
once logged). ``inference.tokenizer`` is the one module of ``inference`` the
gateway imports: it has no JAX (``tests/gateway/test_no_jax.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from transport.api import WorkerConnection
from transport.common.prefix import PREFIX_HASH_SCHEME, chain_hashes
from transport.messages import Submit

from .policy import RouteRequest

__all__ = ["PrefixHasher", "PromptTokenizer", "prompt_token_ids"]

log = logging.getLogger("quicserve.routing")


class PromptTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]: ...


def prompt_token_ids(tokenizer: PromptTokenizer, submit: Submit) -> Sequence[int]:
    """The prompt's token ids as the worker computes them from ``submit``."""
    if submit.prompt_token_ids is not None:
        return submit.prompt_token_ids
    if submit.prompt is not None:
        return tokenizer.encode(submit.prompt)
    return tokenizer.encode_chat(submit.messages or ())


def _load(model_id: str) -> PromptTokenizer:
    from inference.tokenizer import load_tokenizer  # JAX-free; loaded only when a policy wants hashes

    tok: PromptTokenizer = load_tokenizer(model_id)
    return tok


class PrefixHasher:
    """Fills ``RouteRequest.prefix_hashes`` (and the exact ``prompt_tokens``) for a pool whose
    policy reads them."""

    def __init__(self, limit: int = 64, load: Callable[[str], PromptTokenizer] = _load) -> None:
        self.limit = limit  # blocks hashed from the start of the prompt
        self._load = load
        self._tokenizers: dict[str, PromptTokenizer | None] = {}

    def tokenizer(self, model_id: str) -> PromptTokenizer | None:
        if model_id in self._tokenizers:
            return self._tokenizers[model_id]
        tok: PromptTokenizer | None
        try:
            tok = self._load(model_id)
        except Exception as e:  # noqa: BLE001 (a bad or absent checkpoint: route without hashes)
            log.warning("no prefix hashes for model %r: its tokenizer cannot be loaded here (%s)", model_id, e)
            tok = None
        self._tokenizers[model_id] = tok
        return tok

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
        tok = self.tokenizer(hello.model_id)
        if tok is None:
            return req
        try:
            ids = prompt_token_ids(tok, make_submit(0))
        except Exception:  # noqa: BLE001 (a prompt the template refuses: the worker says why)
            return req
        return req._replace(prompt_tokens=len(ids), prefix_hashes=chain_hashes(ids, hello.block_size, self.limit))
