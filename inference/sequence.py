"""One request inside the engine, and the events the engine emits for it.

A :class:`Sequence` turns each sampled token into at most one :class:`Delta`
(token id, text delta, logprobs) and decides whether the request is done:
eos / stop token ids and stop strings -> STOP; ``max_tokens`` or the context
limit -> LENGTH. Text is detokenized incrementally and passed through a
:class:`~inference.stop.StopMatcher`, so a stop string split over tokens is
caught and never emitted. Eos and stop token ids are counted in
``completion_tokens`` but not streamed.

A request that sets a penalty, ``logit_bias`` or ``min_tokens`` carries a
:class:`~inference.penalties.LogitAdjust` (``adjust``; None otherwise) that
takes in the prompt at once and every token as it is accepted (or resumed),
so the runner reads the step's table without a pass over the context.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transport.messages import ErrorCode, FinishReason, SamplingParams

from .penalties import LogitAdjust, needs_adjust
from .runner import SeqOutput
from .stop import StopMatcher
from .tokenizer import IncrementalDecoder

if TYPE_CHECKING:
    from .grammar import Guide

__all__ = ["Delta", "Finished", "Failed", "EngineEvent", "Sequence", "SeqStatus"]


@dataclass(slots=True)  # not frozen, like SeqWork: one per sequence per step (see inference.runner)
class Delta:
    """What one step produced for one request (``token_ids`` holds 0 or 1 id)."""

    key: Hashable
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...] | None = None  # one per token iff params.logprobs
    top_ids: tuple[int, ...] = ()  # top_n per token, row-major
    top_logprobs: tuple[float, ...] = ()
    top_n: int = 0


@dataclass(frozen=True, slots=True)
class Finished:
    key: Hashable
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Failed:
    key: Hashable
    code: ErrorCode
    message: str


EngineEvent = Delta | Finished | Failed


class SeqStatus(enum.Enum):
    WAITING = 1  # queued for a prefill (no KV blocks)
    RUNNING = 2  # in the batch
    PAUSED = 3  # off the batch: its client is not reading (KV kept until memory is short)
    RESUMING = 4  # its client reads again; kept KV, waiting for a batch slot
    DONE = 5
    HUNG = 6  # a runner's SeqFault(hang=True): keeps its batch slot and KV, never stepped again


class Sequence:
    """Mutable per-request state owned by the engine."""

    __slots__ = (
        "key", "seq_id", "prompt_len", "tokens", "params", "seed", "arrival", "deadline",
        "return_text", "status", "paused_at", "num_computed", "cached_tokens", "admitted",
        "_decoder", "_stop", "_stop_ids", "_want_text", "guide", "_resync", "adjust",
    )  # fmt: skip

    def __init__(
        self,
        key: Hashable,
        seq_id: int,
        prompt: list[int],
        params: SamplingParams,
        seed: int,
        arrival: float,
        deadline: float | None,
        decoder: IncrementalDecoder,
        eos_ids: tuple[int, ...],
        return_text: bool,
        guide: Guide | None = None,
    ) -> None:
        self.key = key
        self.guide = guide  # structured output's grammar state (inference.grammar), fed every sampled token
        self.seq_id = seq_id
        self.prompt_len = len(prompt)
        self.tokens = prompt  # prompt followed by every sampled token
        self.params = params
        self.seed = seed
        self.arrival = arrival
        self.deadline = deadline
        self.return_text = return_text
        self.status = SeqStatus.WAITING
        self.paused_at = 0.0  # when it was last paused
        self.num_computed = 0  # positions whose K/V the runner has written
        self.cached_tokens = -1  # prefix-cache hit at first admission
        self.admitted = 0.0
        self._decoder = decoder
        self._stop = StopMatcher(params.stop)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(eos_ids)
        self._stop_ids = frozenset(stop_ids)
        self.adjust: LogitAdjust | None = None  # penalties, logit_bias, min_tokens (inference.penalties)
        if needs_adjust(params):
            self.adjust = LogitAdjust(params, len(prompt), stop_ids)
            self.adjust.fold(prompt)
        self._want_text = return_text or bool(params.stop)
        self._resync: tuple[str, int] | None = None  # a resumed request's text to add or bytes to drop (resume)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    def finished(self, reason: FinishReason) -> Finished:
        # cached tokens are the prompt's (a resumed request's prefill may find its generated ones cached too)
        cached = min(max(self.cached_tokens, 0), self.prompt_len)
        return Finished(self.key, reason, self.prompt_len, self.num_generated, cached)

    def resume(self, generated: tuple[int, ...], text_bytes: int) -> None:
        """Go on from where another replica stopped (mid-stream failover, ``Submit.continuation``).

        ``generated`` become this sequence's output so far, exactly as if sampled here: counted in
        ``max_tokens`` and usage, at the sampler's positions, fed to the guide, the detokenizer and
        the stop matcher -- which then hold what the lost replica's held (a partial UTF-8 character,
        text that may start a stop string). Its text so far is what that replica sent; should it
        differ in length from ``text_bytes`` (what the client has), the next delta makes up for it,
        so the client's text goes on byte for byte either way."""
        self.tokens.extend(generated)
        if self.adjust is not None:
            self.adjust.fold(self.tokens)
        if not self._want_text and self.guide is None:
            return
        parts: list[str] = []
        for tok in generated:  # as accept() takes each (no stop id can be among them: it would have ended)
            if tok in self._stop_ids:
                continue
            if self.guide is not None:
                self.guide.consume(tok)
            if self._want_text:
                parts.append(self._stop.push(self._decoder.push(tok))[0])
        sent = len("".join(parts).encode()) if self.return_text else 0
        if sent != text_bytes:
            carry = "".join(parts).encode()[text_bytes:].decode("utf-8", "replace") if sent > text_bytes else ""
            self._resync = (carry, max(0, text_bytes - sent))

    def _resynced(self, text: str) -> str:
        """A resumed request's first deltas: the text the client lacks first, or the bytes it has dropped."""
        carry, skip = self._resync  # type: ignore[misc]
        if carry:
            self._resync = None
            return carry + text
        data = text.encode()
        if len(data) < skip:
            self._resync = ("", skip - len(data))
            return ""
        self._resync = None
        return data[skip:].decode("utf-8", "replace")

    def accept(self, out: SeqOutput, max_model_len: int) -> tuple[Delta | None, FinishReason | None]:
        """Take one sampled token; return the delta to stream and a finish reason."""
        tok = out.token_id
        self.tokens.append(tok)
        if self.adjust is not None:
            self.adjust.fold(self.tokens)
        p = self.params
        if self.guide is not None and tok not in self._stop_ids:
            self.guide.consume(tok)
        reason: FinishReason | None = None
        text = ""
        emit = True
        if tok in self._stop_ids:
            reason = FinishReason.STOP
            emit = False
        elif self._want_text:
            text, hit = self._stop.push(self._decoder.push(tok))
            if hit:
                reason = FinishReason.STOP
        n_tokens = len(self.tokens)
        if reason is None and (n_tokens - self.prompt_len >= p.max_tokens or n_tokens >= max_model_len):
            reason = FinishReason.LENGTH
        if reason is not None and not self._stop.stopped and self._want_text:
            tail, _ = self._stop.push(self._decoder.flush())
            text += tail + self._stop.flush()
        if not self.return_text:
            text = ""
        elif self._resync is not None:
            text = self._resynced(text)
        if not emit and not text:
            return None, reason
        ids = (tok,) if emit else ()
        # As the wire wants them: a logprob per token iff ``logprobs``, and
        # ``top_logprobs`` alternatives per token whether or not it is set.
        lps: tuple[float, ...] | None = None
        if p.logprobs:
            lps = (out.logprob,) if emit else ()
        n = p.top_logprobs
        top_ids: tuple[int, ...] = ()
        top_lps: tuple[float, ...] = ()
        if n and emit:
            top_ids = tuple(out.top_ids[:n]) + (0,) * max(0, n - len(out.top_ids))
            top_lps = tuple(out.top_logprobs[:n]) + (float("-inf"),) * max(0, n - len(out.top_logprobs))
        return Delta(self.key, ids, text, lps, top_ids, top_lps, n), reason
