"""Continuous-batching scheduler (pure logic: no JAX, no asyncio, clock passed in).

How it works. Requests wait in ``_waiting`` (FIFO) and run in ``_running``
(admission order). A step is two calls so the runner can execute off-thread:

  ``schedule(now)`` -> (StepPlan | None, events)
      1. fail requests past their deadline, and paused ones stalled past
         ``stall_timeout``;
      2. move resumed sequences that kept their KV back into free batch
         slots (they need no prefill), ahead of any waiting request;
      3. give every running sequence room for one more position; when the KV
         cache is full, drop the KV of a paused sequence first, then of a
         resumed one waiting for a slot, and only then preempt the *newest*
         running sequence (free its blocks, requeue it at the front; it is
         recomputed from its prompt + generated tokens later, usually from
         the prefix cache);
      4. with chunked prefill (``step_tokens`` > 0) the step carries at most
         ``step_tokens`` tokens: the decodes of step 3 first, then chunks of
         the prompts already admitted and still prefilling (admission order),
         then of new admissions (step 5); a chunk is as much of the prompt as
         the budget left allows (at least a block's worth per step, so the
         decodes never starve a prompt), and a sequence decodes only once
         its whole prompt is in the cache. Only the last chunk samples a
         token: the runner's sample for an earlier one is dropped;
      5. if the batch window says so, admit waiting requests in order while
         there are batch slots, free blocks (dropping paused sequences' KV
         if that makes room) and prefill-token budget (the prefill holds at
         most ``max_prefill_tokens`` new tokens, the chunk budget of step 4,
         and what the window's ``prefill_fits`` allows for this many decodes;
         the first request always fits). An admitted prompt gets blocks for
         all of its tokens at once.
  ``commit(plan, outputs, now)`` -> events
      feeds each sampled token to its sequence (text delta, stop checks),
      finishes the done ones, registers newly full blocks in the prefix cache
      and tells the batch window how long the step took. A runner that could
      not run one sequence returns a :class:`~inference.runner.SeqFault` for it:
      its request ends with an INTERNAL error, or (``hang``) it turns HUNG and
      stays in ``_running``, holding its slot and blocks, skipped by every later
      step until it is cancelled, times out or is aborted (or preempted like
      any running sequence when the cache runs short: then it is recomputed).

Cancelling frees a request's blocks at once; a result for it that arrives
later is dropped. Every request added ends exactly once: a :class:`Finished`
or :class:`Failed` event (or the return of :meth:`cancel`).

Pausing (the client stopped reading: the worker has no credit to send its
tokens) takes a sequence off the batch: RUNNING/WAITING -> PAUSED, in
``_paused`` (pause order). Its batch slot goes to other work at once. Its KV
blocks are *kept*, not swapped out: a stalled reader usually catches up within
a round trip, and keeping costs nothing until memory is short, while a swap
needs a device->host copy API no runner has and costs a transfer both ways
even when the client comes back a moment later. The blocks stay referenced,
so admission counts them (``kv.num_free`` excludes them); when the cache runs
short a paused sequence is the first whose KV is dropped (it is recomputed
after resuming, from prompt + generated tokens, often from the prefix cache).
:meth:`resume` makes it RESUMING (kept KV: back into the first free slot, no
prefill) or, without KV, WAITING at the front of the queue; either way ahead
of new work. A sequence paused for ``stall_timeout`` seconds ends with
``TIMEOUT`` and frees everything. Pausing while a step that includes the
sequence runs drops that step's token for it; it is sampled again, the same,
after resuming (seeded by position).
"""

from __future__ import annotations

import random
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transport.common.worker_options import WorkerOptions
from transport.messages import Continuation, ErrorCode, FinishReason, SamplingParams

from .batch_window import BatchWindow, FixedWindow
from .kv_cache import KVCache
from .runner import ModelRunner, SeqFault, SeqOutput, SeqWork, StepPlan
from .sequence import Delta, EngineEvent, Failed, Finished, SeqStatus, Sequence
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from .grammar import Guide

__all__ = ["Engine", "EngineConfig", "EngineError", "Delta", "Finished", "Failed", "EngineEvent"]


class EngineError(Exception):
    """A request the engine refuses; ``code`` is the wire error code."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


_DEFAULTS = WorkerOptions()  # one default per option, shared with `quicserve worker` and the gateway


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_batch: int = _DEFAULTS.max_batch
    max_prefill_tokens: int = _DEFAULTS.max_prefill_tokens  # per step (one longer prompt may run alone)
    max_waiting: int = 4096
    # Admissions that make a full prefill (the window stops waiting): the runner's max_prefill_batch.
    prefill_batch: int = _DEFAULTS.max_prefill_batch
    enable_prefix_cache: bool = _DEFAULTS.prefix_cache
    stall_timeout: float = _DEFAULTS.stall_timeout  # seconds a paused request may wait (0 = no limit)
    step_tokens: int = _DEFAULTS.step_tokens  # chunked prefill's budget per step (0 = prompts prefill whole)
    seed: int = 0  # draws the seeds of unseeded requests


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        config: EngineConfig = EngineConfig(),
        window: BatchWindow | None = None,
    ) -> None:
        if min(config.max_batch, config.max_prefill_tokens, config.prefill_batch) < 1:
            raise ValueError("max_batch, max_prefill_tokens and prefill_batch must be >= 1")
        if config.step_tokens < 0:
            raise ValueError("step_tokens must be >= 0 (0 = no chunked prefill)")
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.window: BatchWindow = window if window is not None else FixedWindow(0.0)
        self.kv = KVCache(
            runner.num_blocks, runner.block_size, enable_prefix_cache=config.enable_prefix_cache,
            window=runner.sliding_window,
        )
        # A lone sequence must always fit in the cache, so cap the context there.
        self.max_model_len = min(runner.max_model_len, runner.num_blocks * runner.block_size)
        self._eos = tuple(runner.eos_token_ids) or tuple(tokenizer.eos_token_ids)
        self._rng = random.Random(config.seed)
        self._by_key: dict[Hashable, Sequence] = {}
        self._by_id: dict[int, Sequence] = {}
        self._waiting: list[Sequence] = []
        self._running: list[Sequence] = []
        self._paused: dict[Hashable, Sequence] = {}  # PAUSED, in pause order (oldest first)
        self._resuming: list[Sequence] = []  # RESUMING: kept KV, waiting for a batch slot
        self._next_id = 1
        self._step_started: float | None = None
        self._last_admit = float("-inf")
        self.num_preemptions = 0
        self.tokens_generated = 0
        # Step counters for the worker's Stats (cumulative: rates are the scraper's business).
        self.steps = 0
        self.step_seconds = 0.0
        self.step_sequences = 0

    # -- intake --------------------------------------------------------------
    def add(
        self,
        key: Hashable,
        prompt_ids: list[int] | tuple[int, ...],
        params: SamplingParams,
        now: float,
        *,
        deadline: float | None = None,
        return_text: bool = True,
        guide: Guide | None = None,
        continuation: Continuation | None = None,
    ) -> None:
        """Queue a request or raise :class:`EngineError` (nothing is queued). ``guide``: its
        structured output's grammar, compiled (inference.grammar); ``continuation``: the output so
        far of a request another replica began (:meth:`Sequence.resume`)."""
        if key in self._by_key:
            raise EngineError(ErrorCode.INVALID_REQUEST, f"duplicate request id {key!r}")
        _validate(params)
        prompt = list(prompt_ids)
        if not prompt:
            raise EngineError(ErrorCode.INVALID_REQUEST, "the prompt is empty")
        vocab = self.tokenizer.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise EngineError(ErrorCode.INVALID_REQUEST, f"prompt token ids must be in [0, {vocab})")
        for tok, _ in params.logit_bias:
            if not 0 <= tok < vocab:
                raise EngineError(ErrorCode.INVALID_REQUEST, f"logit_bias: token id {tok} is outside this "
                                  f"model's vocabulary [0, {vocab})")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise EngineError(
                ErrorCode.CONTEXT_LENGTH,
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"context length ({self.max_model_len})",
            )
        if len(self._waiting) >= self.config.max_waiting:
            raise EngineError(ErrorCode.OVERLOADED, "the worker queue is full")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(31)
        dec = self.tokenizer.incremental_decoder(prompt)
        seq = Sequence(key, self._next_id, prompt, params, seed, now, deadline, dec, self._eos, return_text, guide)
        if continuation is not None:
            seq.resume(continuation.token_ids, continuation.text_bytes)
        self._next_id += 1
        self._by_key[key] = seq
        self._by_id[seq.seq_id] = seq
        self._waiting.append(seq)

    def cancel(self, key: Hashable) -> Finished | None:
        """Stop a request now and free its blocks; None if unknown or done."""
        seq = self._by_key.get(key)
        if seq is None:
            return None
        self._retire(seq)
        return seq.finished(FinishReason.CANCELLED)

    def abort_all(self, code: ErrorCode, message: str) -> list[Failed]:
        """End every request with an error (shutdown)."""
        out = [Failed(s.key, code, message) for s in list(self._by_key.values())]
        for s in list(self._by_key.values()):
            self._retire(s)
        return out

    def pause(self, key: Hashable, now: float) -> None:
        """Take a request off the batch (its client is not reading); it keeps its KV blocks."""
        s = self._by_key.get(key)
        if s is None or s.status is SeqStatus.PAUSED or s.status is SeqStatus.HUNG:
            return
        if s.status is SeqStatus.RUNNING:
            self._running.remove(s)
        elif s.status is SeqStatus.WAITING:
            self._waiting.remove(s)
        elif s.status is SeqStatus.RESUMING:
            self._resuming.remove(s)
        s.status = SeqStatus.PAUSED
        s.paused_at = now
        self._paused[key] = s

    def resume(self, key: Hashable) -> None:
        """Its client reads again: back into the batch ahead of new work."""
        s = self._paused.pop(key, None)
        if s is None:
            return
        if self.kv.has_seq(s.seq_id):
            s.status = SeqStatus.RESUMING
            self._resuming.append(s)
        else:
            s.status = SeqStatus.WAITING
            self._waiting.insert(0, s)

    # -- queries -------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_paused(self) -> int:
        """Requests off the batch because their client is not reading (resumed ones waiting included)."""
        return len(self._paused) + len(self._resuming)

    def has_unfinished(self) -> bool:
        return bool(self._by_key)

    def keys(self) -> list[Hashable]:
        """Keys of every unfinished request."""
        return list(self._by_key)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._by_key

    def next_wakeup(self) -> float | None:
        """When a step could next do something if nothing else happens."""
        times = [s.deadline for s in self._by_key.values() if s.deadline is not None]
        if self.config.stall_timeout > 0 and self._paused:
            times.append(next(iter(self._paused.values())).paused_at + self.config.stall_timeout)
        ready = self._waiting
        free = self.config.max_batch - len(self._running)
        if ready and free > 0:
            times.append(self._admit_at(ready, free, self._prefill_budget(self._num_decoding())))
        return min(times) if times else None

    def _admit_at(self, ready: list[Sequence], free_slots: int, budget: tuple[int, int]) -> float:
        start = max(ready[0].arrival, self._last_admit)
        full = min(self.config.prefill_batch, self.config.max_batch)
        batch = min(len(ready), free_slots)
        # When this step's prefill bound (token cap, the window's cost bound)
        # stops short of the ready requests, or would refuse one more like the
        # last, waiting cannot make the prefill any bigger: count it as full.
        lengths: list[int] = []
        for s in ready[:batch]:
            lengths.append(len(s.tokens))
            if len(lengths) > 1 and not self._prefill_fits(lengths, budget):
                return self.window.admit_at(start, full, full)
        if batch < full and not self._prefill_fits([*lengths, lengths[-1]], budget):
            batch = full
        return self.window.admit_at(start, batch, full)

    def _prefill_fits(self, lengths: list[int], budget: tuple[int, int]) -> bool:
        tokens, decodes = budget
        return sum(lengths) <= tokens and self.window.prefill_fits(lengths, decodes=decodes)

    def _prefill_budget(self, decodes: int) -> tuple[int, int]:
        """(prompt tokens a step with ``decodes`` decodes may prefill, ``decodes``)."""
        tokens = self.config.max_prefill_tokens
        if self.config.step_tokens:
            tokens = min(tokens, max(self.config.step_tokens - decodes, self.kv.block_size))
        return tokens, decodes

    def _num_decoding(self) -> int:
        return sum(1 for s in self._running if s.status is SeqStatus.RUNNING and not _prefilling(s))

    # -- one step ------------------------------------------------------------
    def schedule(self, now: float) -> tuple[StepPlan | None, list[EngineEvent]]:
        events: list[EngineEvent] = []
        for s in [s for s in self._by_key.values() if s.deadline is not None and now >= s.deadline]:
            self._retire(s)
            events.append(Failed(s.key, ErrorCode.TIMEOUT, "deadline exceeded"))
        limit = self.config.stall_timeout
        if limit > 0:
            for s in [s for s in self._paused.values() if now - s.paused_at >= limit]:
                self._retire(s)
                events.append(Failed(s.key, ErrorCode.TIMEOUT, f"client stopped reading for {limit:g} s"))
        while self._resuming and len(self._running) < self.config.max_batch:
            s = self._resuming.pop(0)
            s.status = SeqStatus.RUNNING
            self._running.append(s)
        decodes = self._plan_decodes()
        prefills = self._plan_prefills(now, self._prefill_budget(len(decodes)))
        if not decodes and not prefills:
            return None, events
        self._step_started = now
        return StepPlan(tuple(prefills), tuple(decodes)), events

    def _plan_decodes(self) -> list[SeqWork]:
        work: list[SeqWork] = []
        for s in list(self._running):
            if s.status is not SeqStatus.RUNNING or _prefilling(s):
                continue
            while not self.kv.ensure_capacity(s.seq_id, len(s.tokens)):
                if self._drop_idle_kv(resuming_too=True):
                    continue
                victim = self._running[-1]
                self._preempt(victim)
                if victim is s:
                    break
            if s.status is SeqStatus.RUNNING:
                pos = len(s.tokens) - 1
                work.append(
                    SeqWork(s.seq_id, (s.tokens[-1],), pos, self.kv.block_table(s.seq_id), s.params, s.seed,
                            s.num_generated, s.guide, s.adjust)
                )  # fmt: skip
        return work

    def _plan_prefills(self, now: float, step_budget: tuple[int, int]) -> list[SeqWork]:
        budget, decodes = step_budget
        chunked = self.config.step_tokens > 0
        work: list[SeqWork] = []
        lengths: list[int] = []
        for s in self._running:  # prompts part-way through their prefill go on first
            if s.status is not SeqStatus.RUNNING or not _prefilling(s):
                continue
            n = min(len(s.tokens) - s.num_computed, budget) if chunked else len(s.tokens) - s.num_computed
            if work and (n > budget or not self.window.prefill_fits([*lengths, n], decodes=decodes)):
                return work
            if chunked and budget <= 0:
                return work
            budget -= n
            lengths.append(n)
            work.append(SeqWork(s.seq_id, tuple(s.tokens[s.num_computed : s.num_computed + n]), s.num_computed,
                                self.kv.block_table(s.seq_id), s.params, s.seed, s.num_generated, s.guide,
                                s.adjust))
        free_slots = self.config.max_batch - len(self._running)
        ready = list(self._waiting)
        if free_slots <= 0 or not ready or (chunked and budget <= 0):
            return work
        if now < self._admit_at(ready, free_slots, step_budget):
            return work
        leaders = ([s for s in self._running if s.status is SeqStatus.RUNNING and _prefilling(s)]
                   if self.kv.enable_prefix_cache else [])
        for s in ready:
            if len(self._running) >= self.config.max_batch or (chunked and budget <= 0):
                break
            if leaders and self._follows(s, leaders):
                continue  # admitted with a cache hit once its leader's blocks are registered
            cached = self.kv.cached_prefix_len(s.tokens)
            n = min(len(s.tokens) - cached, budget) if chunked else len(s.tokens) - cached
            if work and (n > budget or not self.window.prefill_fits([*lengths, n], decodes=decodes)):
                break
            alloc = self.kv.allocate(s.seq_id, s.tokens)
            while alloc is None and self._drop_idle_kv(resuming_too=False):
                alloc = self.kv.allocate(s.seq_id, s.tokens)
            if alloc is None:
                break
            cached = alloc.num_cached_tokens
            n = min(len(s.tokens) - cached, budget) if chunked else len(s.tokens) - cached
            budget -= n
            lengths.append(n)
            if s.cached_tokens < 0:
                s.cached_tokens = alloc.num_cached_tokens
            self._waiting.remove(s)
            self._running.append(s)
            s.status = SeqStatus.RUNNING
            s.admitted = now
            s.num_computed = alloc.num_cached_tokens
            self._last_admit = now
            work.append(SeqWork(s.seq_id, tuple(s.tokens[cached : cached + n]), cached, alloc.block_table, s.params,
                                s.seed, s.num_generated, s.guide, s.adjust, int(alloc.last_cached)))
            if self.kv.enable_prefix_cache and _prefilling(s):
                leaders.append(s)
        return work

    def _follows(self, s: Sequence, leaders: list[Sequence]) -> bool:
        """Whether ``s`` waits for a prompt being prefilled now: it shares more leading full blocks with
        one (a leader) than the prefix cache holds for it yet, and they are more than half its prompt
        (for less, prefilling at once costs the follower less than a step's wait).

        This is how ``n`` > 1 (the gateway's sub-generations of one request, pinned to one replica) and
        concurrent identical prompts share their prompt's KV without a prefill each: the followers
        wait until the leader's commit registered its blocks, then are admitted with a prefix-cache
        hit (reference counts: the blocks are shared, read-only; only the block holding the prompt's
        last token is computed per follower, or for a block-aligned prompt just that token again,
        unwritten). The wait is bounded by the leader's own prefill: a leader that is preempted,
        paused, cancelled or done prefilling is no longer one, and its followers go on."""
        kv = self.kv
        bs = kv.block_size
        usable = (len(s.tokens) - 1) // bs  # the blocks a cache hit spares computing (kv.cached_prefix_len)
        if 2 * usable * bs <= len(s.tokens):
            return False  # waiting a step pays only when the leader would save most of its prefill
        first = s.tokens[:bs]
        cached = -1
        for lead in leaders:
            if lead is s or lead.tokens[:bs] != first:
                continue
            if cached < 0:
                cached = kv.cached_prefix_len(s.tokens) // bs
            shared = kv.common_blocks(s.tokens, lead.tokens, usable)
            if shared > cached and 2 * shared * bs > len(s.tokens):
                return True
        return False

    def commit(self, plan: StepPlan, outputs: list[SeqOutput], now: float) -> list[EngineEvent]:
        """Apply a step's sampled tokens; returns deltas and finishes."""
        works = plan.prefills + plan.decodes
        if len(outputs) != len(works):
            raise RuntimeError(f"runner returned {len(outputs)} outputs for {len(works)} sequences")
        events: list[EngineEvent] = []
        for work, out in zip(works, outputs, strict=True):
            if out.seq_id != work.seq_id:
                raise RuntimeError("runner outputs are not in plan order")
            s = self._by_id.get(work.seq_id)
            if s is None or s.status is not SeqStatus.RUNNING:
                continue  # cancelled while the step ran
            if out.fault is not None:
                self._fault(s, out.fault, events)
                continue
            s.num_computed = work.start_pos + len(work.token_ids)
            self.kv.register(s.seq_id, s.tokens, s.num_computed)
            self.kv.release_out_of_window(s.seq_id, s.num_computed)
            if s.num_computed < len(s.tokens):
                continue  # a chunk short of the prompt's end: its sample is not a token of the request
            delta, reason = s.accept(out, self.max_model_len)
            self.tokens_generated += 1
            if delta is not None:
                events.append(delta)
            if reason is not None:
                self._retire(s)
                events.append(s.finished(reason))
        if self._step_started is not None:
            load = min(1.0, (len(self._running) + len(self._waiting)) / self.config.max_batch)
            lengths = [len(w.token_ids) for w in plan.prefills]
            self.window.observe(now - self._step_started, load, prefill_lengths=lengths, decodes=len(plan.decodes))
            self.steps += 1
            self.step_seconds += now - self._step_started
            self.step_sequences += len(works)
            self._step_started = None
        return events

    def step(self, now: float) -> list[EngineEvent]:
        """schedule + execute + commit in one call (tests and benchmarks)."""
        plan, events = self.schedule(now)
        if plan is not None:
            events += self.commit(plan, self.runner.execute(plan), now)
        return events

    # -- internals -----------------------------------------------------------
    def _drop_idle_kv(self, *, resuming_too: bool) -> bool:
        """Free the KV of the longest-paused sequence that holds any (or, with ``resuming_too``,
        of the newest resumed one still waiting for a slot); False if none holds KV."""
        for s in self._paused.values():
            if self.kv.has_seq(s.seq_id):
                self.kv.free(s.seq_id)
                s.num_computed = 0
                self.num_preemptions += 1
                return True
        if resuming_too and self._resuming:
            s = self._resuming.pop()
            self.kv.free(s.seq_id)
            s.num_computed = 0
            s.status = SeqStatus.WAITING
            self._waiting.insert(0, s)
            self.num_preemptions += 1
            return True
        return False

    def _fault(self, s: Sequence, fault: SeqFault, events: list[EngineEvent]) -> None:
        if fault.hang:
            s.status = SeqStatus.HUNG  # stays in _running: _plan_decodes skips it
            return
        self._retire(s)
        events.append(Failed(s.key, ErrorCode.INTERNAL, fault.message))

    def _preempt(self, s: Sequence) -> None:
        self.kv.free(s.seq_id)
        self._running.remove(s)
        s.status = SeqStatus.WAITING
        s.num_computed = 0
        self._waiting.insert(0, s)
        self.num_preemptions += 1

    def _retire(self, s: Sequence) -> None:
        self.kv.free(s.seq_id)
        if s.status is SeqStatus.RUNNING or s.status is SeqStatus.HUNG:
            self._running.remove(s)
        elif s.status is SeqStatus.WAITING:
            self._waiting.remove(s)
        elif s.status is SeqStatus.PAUSED:
            del self._paused[s.key]
        elif s.status is SeqStatus.RESUMING:
            self._resuming.remove(s)
        s.status = SeqStatus.DONE
        self._by_key.pop(s.key, None)
        self._by_id.pop(s.seq_id, None)


def _prefilling(s: Sequence) -> bool:
    """Part of its prompt (or, after a preemption, of its context) is not in the cache yet."""
    return s.num_computed < len(s.tokens) - 1


def _validate(p: SamplingParams) -> None:
    bad = None
    if p.max_tokens < 1:
        bad = "max_tokens must be >= 1"
    elif p.temperature < 0:
        bad = "temperature must be >= 0"
    elif not (0.0 < p.top_p <= 1.0):
        bad = "top_p must be in (0, 1]"
    elif p.top_k < 0:
        bad = "top_k must be >= 0"
    elif not (0 <= p.top_logprobs <= 20):
        bad = "top_logprobs must be in [0, 20]"
    elif any(not s for s in p.stop):
        bad = "stop strings must be non-empty"
    elif not (-2.0 <= p.presence_penalty <= 2.0 and -2.0 <= p.frequency_penalty <= 2.0):
        bad = "presence_penalty and frequency_penalty must be in [-2, 2]"
    elif not 0.0 < p.repetition_penalty <= 100.0:  # also refuses NaN
        bad = "repetition_penalty must be in (0, 100]"
    elif not 0 <= p.min_tokens <= p.max_tokens:
        bad = "min_tokens must be in [0, max_tokens]"
    elif any(not -100.0 <= b <= 100.0 for _, b in p.logit_bias):
        bad = "logit_bias values must be in [-100, 100]"
    if bad:
        raise EngineError(ErrorCode.INVALID_REQUEST, bad)
