"""Structured output: a request's JSON Schema, regular expression, Lark grammar or choice list
turned into a token mask per decoding step (llguidance).

Why llguidance and not xgrammar (or outlines-core). All three are Rust/C++ cores on PyPI made for
exactly this. llguidance's wheel depends on nothing (xgrammar's pulls in torch, transformers and
triton: gigabytes on a CPU worker that has none of them); it computes a mask lazily from an Earley
parser over a lexer built on the token trie, ~50 us a step for JSON with no precompilation of the
whole grammar (xgrammar precomputes per-state token sets: fast masks after a compile that grows
with the schema; outlines-core builds a full DFA index, which explodes on large enums and bounded
repetitions); its JSON Schema coverage is the widest of the three (``$ref`` with recursion,
``anyOf``/``oneOf``, string formats, patterns, bounds on arrays, strings and numbers, and an error
naming the keyword it does not implement instead of silently ignoring it); it takes any tokenizer as
its list of token byte strings (our byte-level ``tiny`` one as well as a ``tokenizer.json``); and it
was built to face untrusted grammars: every compile and every mask step runs on a *fuel* budget
(:class:`llguidance.LLParserLimits`), so a hostile schema ends in an error, not in a stuck worker.

How it works. :class:`GrammarCompiler` compiles a (kind, text) pair once into a fresh matcher,
under :data:`LIMITS` (time: lexer fuel and Earley items; memory: lexer states, grammar size) on its
own thread, so neither the event loop nor the engine step waits for it, and caches the result by
content (a failure too: a hostile schema sent again costs a dict lookup). Each sequence gets a
:class:`Guide`, a copy of the cached matcher. Each step the runner calls :func:`fill_masks` for the
rows that have one (beside the model step, which is already dispatched), and the engine feeds every
sampled token back with :meth:`Guide.consume`. A request without a constraint has no guide and
nothing here runs for it.

Kinds (``SamplingParams.guide_kind``): ``json`` (a JSON Schema; ``{"type": "object"}`` for
``json_object``), ``regex``, ``lark`` (llguidance's Lark dialect, which can embed ``%json``
schemas: the gateway's tool-call grammars), ``choice`` (a JSON array of strings: exactly one of them).
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import llguidance as llg
import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par

from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = ["GUIDE_KINDS", "LIMITS", "GrammarError", "GrammarCompiler", "Guide", "fill_masks", "mask_words"]

GUIDE_KINDS = frozenset({"json", "regex", "lark", "choice"})

# Bounds on what one client's grammar may cost. Fuel is llguidance's unit of work (~50k/ms building
# the lexer, ~14k/ms per mask step): 2M is ~40 ms of lexer building at most, a mask step at most
# ~15 ms. 20k lexer states is at most ~40 MB; 200k grammar symbols bounds the parser's tables.
LIMITS = dict(max_items_in_row=2000, initial_lexer_fuel=2_000_000, step_lexer_fuel=200_000,
              step_max_items=50_000, max_lexer_states=20_000, max_grammar_size=200_000, verbose_errors=False)
# JSON as the model writes it: no free whitespace (a random or weak model would spin in it forever)
# and ", " / ": " between items, as json.dumps writes them.
_JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE_MAX = 512
_MAX_TEXT = 256 * 1024  # a grammar's text, bytes (the gateway's body limit is the usual bound)


class GrammarError(ValueError):
    """A constraint that cannot be compiled (bad, unsupported or too complex); the message says
    which, in words a client can act on."""


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's bit mask."""
    return (vocab_size + 31) // 32


def _lark_choice(text: str) -> str:
    try:
        choices = json.loads(text)
    except ValueError:
        raise GrammarError("choice: not a JSON array of strings") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("choice: expected a non-empty array of non-empty strings")
    return "start: " + " | ".join(json.dumps(c) for c in choices)


def grammar_text(kind: str, text: str) -> str:
    """llguidance's grammar for a (kind, text) pair (not yet compiled)."""
    if len(text) > _MAX_TEXT:
        raise GrammarError(f"the {_WHAT.get(kind, kind)} is {len(text)} bytes; at most {_MAX_TEXT} are allowed")
    if kind == "json":
        try:
            schema = json.loads(text)
        except ValueError as exc:
            raise GrammarError(f"the JSON Schema is not valid JSON: {exc}") from None
        except RecursionError:
            raise GrammarError("the JSON Schema is too complex to enforce: nested too deeply") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("a JSON Schema must be an object or a boolean")
        try:
            return str(llg.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS))
        except ValueError as exc:
            raise GrammarError(f"JSON Schema: {exc}") from None
    if kind == "regex":
        return str(llg.LLMatcher.grammar_from_regex(text))
    if kind == "lark":
        return str(llg.LLMatcher.grammar_from_lark(text))
    if kind == "choice":
        return str(llg.LLMatcher.grammar_from_lark(_lark_choice(text)))
    raise GrammarError(f"unknown constraint kind {kind!r} (one of {sorted(GUIDE_KINDS)})")


def llg_tokenizer(tokenizer: Tokenizer, eos_ids: Sequence[int]) -> llg.LLTokenizer:
    """llguidance's view of the worker's tokenizer: every token's bytes, and which ends a sequence."""
    eos = list(eos_ids) or list(tokenizer.eos_token_ids)
    if isinstance(tokenizer, HFTokenizer):
        return llg.LLTokenizer(tokenizer.to_json(), n_vocab=tokenizer.vocab_size, eos_token=eos)
    if isinstance(tokenizer, ByteTokenizer):
        return llg.LLTokenizer(llg.TokenizerWrapper(_ByteTokens(tokenizer, eos[0])), n_vocab=tokenizer.vocab_size,
                               eos_token=eos)
    raise GrammarError(f"structured output does not know the tokenizer {type(tokenizer).__name__}")


class _ByteTokens:
    """The byte tokenizer as llguidance's TokenizerWrapper reads one."""

    def __init__(self, tok: ByteTokenizer, eos: int) -> None:
        self.eos_token_id = eos
        self.bos_token_id = tok.bos_token_id
        self.tokens = [bytes((i,)) for i in range(256)] + [b"<s>", b"</s>"]
        self.special_token_ids = [ByteTokenizer.BOS, ByteTokenizer.EOS]

    def __call__(self, s: str | bytes) -> list[int]:
        return list(s.encode() if isinstance(s, str) else s)


class GrammarCompiler:
    """Compiles constraints for one tokenizer, once per distinct (kind, text); thread-safe."""

    def __init__(self, tokenizer: Tokenizer, eos_ids: Sequence[int] = (), *, cache_size: int = _CACHE_MAX) -> None:
        self.tokenizer = llg_tokenizer(tokenizer, eos_ids)
        self.vocab_size: int = tokenizer.vocab_size
        self._limits = llg.LLParserLimits(**LIMITS)
        self._cache: OrderedDict[tuple[str, str], llg.LLMatcher | GrammarError] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compiled = 0  # compiles run (cache misses), for tests and metrics

    def guide(self, kind: str, text: str) -> Guide:
        """A new sequence's guide, or :class:`GrammarError`. May take as long as the limits allow:
        call it off the event loop and off the engine step."""
        key = (kind, text)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            hit = self._compile(kind, text)
            with self._lock:
                self._cache[key] = hit
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if isinstance(hit, GrammarError):
            raise hit
        return Guide(hit.deep_copy())

    def _compile(self, kind: str, text: str) -> llg.LLMatcher | GrammarError:
        self.compiled += 1
        try:
            grammar = grammar_text(kind, text)
        except GrammarError as exc:
            return exc
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            return GrammarError(_explain(kind, matcher.get_error()))
        return matcher


_WHAT = {"json": "JSON Schema", "regex": "regular expression", "lark": "grammar", "choice": "choice"}


def _explain(kind: str, error: str) -> str:
    what = _WHAT[kind]
    if "limit" in error or "too big" in error or "too complex" in error.lower():
        return f"the {what} is too complex to enforce: {error}"
    return f"the {what} cannot be enforced: {error}"


class Guide:
    """One sequence's constraint: where its output stands in the grammar."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: llg.LLMatcher) -> None:
        self.matcher = matcher

    def consume(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar cannot take it (the matcher is then in
        its error state, and the next mask allows nothing but ending)."""
        return bool(self.matcher.consume_token(token))

    @property
    def error(self) -> str:
        return str(self.matcher.get_error()) if self.matcher.is_error() else ""

    @property
    def accepting(self) -> bool:
        return bool(self.matcher.is_accepting())


_EXECUTOR: llg.LLExecutor | None = None
# llguidance's thread pool only pays where cores are many: handing 32 small masks to other threads
# cost 1.7 ms a step on a 2-core machine against 0.2-0.7 ms computing them here, one after another.
_PARALLEL = len(os.sched_getaffinity(0)) >= 8 if hasattr(os, "sched_getaffinity") else False


def fill_masks(rows: Sequence[tuple[Guide, int]], masks: np.ndarray) -> None:
    """Write the next-token bit mask of each (guide, row) into ``masks[row]`` (int32 [B, words],
    C-contiguous; the other rows are left as they are), GIL released: on this thread, or
    llguidance's pool on a machine with many cores."""
    global _EXECUTOR
    if _PARALLEL and len(rows) >= 4:
        if _EXECUTOR is None:
            _EXECUTOR = llg.LLExecutor()
        fill_next_token_bitmask_par(_EXECUTOR, [(g.matcher, row) for g, row in rows], masks)
        return
    if not masks.flags["C_CONTIGUOUS"] or masks.dtype != np.int32:
        raise ValueError("masks must be a C-contiguous int32 array")
    nbytes = masks.shape[1] * 4
    base = masks.ctypes.data
    for g, row in rows:
        g.matcher.unsafe_compute_mask_ptr(base + row * nbytes, nbytes)
