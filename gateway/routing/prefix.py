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

import hashlib
import logging
import sys
from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from transport.api import WorkerConnection
from transport.common.prefix import PREFIX_HASH_SCHEME
from transport.messages import Submit

from .policy import RouteRequest

__all__ = ["PrefixHasher", "PromptTokenizer", "prompt_token_ids", "ChainMemo"]

_BIG_ENDIAN = sys.byteorder == "big"
_Edge = tuple[tuple[int, ...], dict[bytes, Any]]  # (the chain hashes of an edge's blocks, the node below)


class ChainMemo:
    """:func:`transport.common.prefix.chain_hashes`, fast for prefixes seen before.

    How it works: a trie whose edges are ``edge_blocks`` blocks of token bytes (u32 LE, the
    scheme's) and carry those blocks' chain hashes. A prompt walks down it one dict lookup per
    edge while its bytes match a path seen before (a shared system prompt, a document, a
    conversation's history), then hashes the rest (BLAKE2b per block, as the scheme does) and
    adds its whole edges. Bounded: at ``max_edges`` the trie starts over empty."""

    __slots__ = ("edge_blocks", "max_edges", "edges", "_roots")

    def __init__(self, edge_blocks: int = 4, max_edges: int = 1 << 16) -> None:
        self.edge_blocks = edge_blocks
        self.max_edges = max_edges
        self.edges = 0
        self._roots: dict[int, dict[bytes, Any]] = {}  # block size -> trie

    def chain(self, ids: Sequence[int], block_size: int, limit: int) -> tuple[int, ...]:
        n = min(len(ids) // block_size, limit)
        if n <= 0:
            return ()
        a = array("I", ids[: n * block_size] if len(ids) > n * block_size else ids)
        if _BIG_ENDIAN:
            a.byteswap()
        buf = a.tobytes()
        blk = 4 * block_size
        step = blk * self.edge_blocks
        if self.edges >= self.max_edges:
            self._roots.clear()
            self.edges = 0
        node = self._roots.setdefault(block_size, {})
        out: list[int] = []
        pos, whole = 0, (n // self.edge_blocks) * step
        while pos < whole:
            edge: _Edge | None = node.get(buf[pos : pos + step])
            if edge is None:
                break
            out += edge[0]
            node = edge[1]
            pos += step
        parent = (out[-1] if out else 0).to_bytes(8, "little")
        blake2b, from_bytes, start = hashlib.blake2b, int.from_bytes, len(out)
        for o in range(pos, n * blk, blk):
            h = blake2b(parent, digest_size=8)
            h.update(buf[o : o + blk])
            parent = h.digest()
            out.append(from_bytes(parent, "little"))
            done = o + blk
            if done <= whole and not done % step:  # an edge complete: remember it
                child: dict[bytes, Any] = {}
                node[buf[done - step : done]] = (tuple(out[len(out) - self.edge_blocks :]), child)
                node = child
                self.edges += 1
        del start
        return tuple(out)

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
        self.memo = ChainMemo()

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
        return req._replace(prompt_tokens=len(ids), prefix_hashes=self.memo.chain(ids, hello.block_size, self.limit))
