"""The worker's answers about a prompt (#31): embeddings, tokenize, detokenize, and echo's prompt entry.

How it works: :meth:`PromptTasks.start` takes a Submit whose ``task`` is not a generation, or a
generation with ``echo`` (transport.wire: "Tasks"). Tokenize and detokenize are answered at once,
on the loop (the tokenizer's work: one entry, then FINISH). An embedding, and echo's prompt
logprobs, need the model: the prompt runs through it on its own (the runner's
:meth:`PromptRunner.prompt_pass`, on the engine's step thread, between steps, so it never races
a step), then, on the loop, the embedding's entry and FINISH are sent, or echo's prompt entry is
sent and the request goes on to the engine (``WorkerService.generate``) -- so the prompt entry is
always the stream's first. A cancel or a lost connection meanwhile ends it here. A request that
asks for none of this never comes here and pays nothing.

Embeddings are the mean (or the last) of the prompt's final hidden states, scaled to unit length
(as OpenAI's and vLLM's are), sent as the base64 of their float32 little-endian bytes.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import numpy as np

from transport.api import ServerConnection
from transport.messages import (
    Continuation,
    Error,
    ErrorCode,
    Finish,
    FinishReason,
    Pooling,
    Submit,
    Task,
    TokenBatch,
)

from .engine import EngineError
from .pending import Key, PendingWork
from .sequence import Delta
from .tokenizer import Tokenizer

__all__ = ["PromptTasks", "PromptRunner", "PromptResult", "PromptPassUnavailable", "pooled"]

log = logging.getLogger("inference.worker")


@dataclass(frozen=True, slots=True)
class PromptResult:
    """A prompt's pass through the model: final hidden states ``[T, hidden]`` (float32) and, when
    asked, each position's logprob ``[T]`` (position 0: NaN) and its top alternatives ``[T, 20]``
    (ids, logprobs; position 0: 0, NaN), all as the position's own token was predicted."""

    hidden: np.ndarray
    logprobs: np.ndarray | None = None
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None


class PromptPassUnavailable(Exception):
    """This runner cannot run a prompt pass as it is set up (the request is refused, the worker goes on)."""


@runtime_checkable
class PromptRunner(Protocol):
    """A runner that can run a prompt through its model on its own (an optional capability)."""

    def prepare_prompt_pass(self, length: int, logprobs: bool) -> None:
        """Compile what a prompt of ``length`` tokens needs (any thread: called off the step thread)."""
        ...

    def prompt_pass(self, ids: Sequence[int], logprobs: bool) -> PromptResult:
        """Run it (on the step thread, between steps)."""
        ...


def pooled(hidden: np.ndarray, pooling: Pooling) -> np.ndarray:
    """The prompt's embedding: its hidden states' mean (or last row), unit length, float32."""
    v = hidden[-1] if pooling == Pooling.LAST else hidden.mean(axis=0)
    v = np.asarray(v, np.float64)
    norm = float(np.linalg.norm(v))
    return (v / norm if norm > 0 else v).astype("<f4")


class _Service(Protocol):
    def generate(self, conn: ServerConnection, cid: int, submit: Submit, ids: list[int]) -> None: ...


class PromptTasks:
    """Prompt answers for one worker service (module docstring)."""

    def __init__(self, service: _Service, tokenizer: Tokenizer, runner: object, executor: Executor | None,
                 pack: Callable[[Sequence[tuple[int, Delta]]], TokenBatch], max_model_len: int) -> None:
        self._service = service
        self._pack = pack  # inference.service.pack_tokens (imported there: no circle)
        self._tok = tokenizer
        self._runner = runner if isinstance(runner, PromptRunner) else None
        self._executor = executor
        self._vocab = tokenizer.vocab_size
        self._max_len = max_model_len
        self._pending: PendingWork[PromptResult] = PendingWork()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def start(self, conn: ServerConnection, cid: int, submit: Submit, ids: list[int]) -> None:
        """Answer ``submit`` (or, for echo, send its prompt entry and hand it to the engine)."""
        rid = submit.request_id
        cont = submit.continuation
        if submit.echo and cont is not None:  # resumed after its prompt entry was delivered: not again
            self._service.generate(conn, cid, self._resumed(submit, ids), ids)
            return
        if submit.task == Task.TOKENIZE:
            self._answer(conn, Delta(rid, tuple(ids), ""), len(ids))
            return
        self._check(submit, ids)  # before anything is sent: an echo's prompt entry is never followed by a refusal
        if submit.task == Task.DETOKENIZE:
            self._answer(conn, Delta(rid, (), self._tok.decode(ids)), len(ids))
            return
        needs_pass = submit.task == Task.EMBED or bool(submit.params.logprobs or submit.params.top_logprobs)
        if not needs_pass:  # echo without logprobs: the prompt's ids and text, then the generation
            self._echo(conn, cid, submit, ids, None)
            return
        if self._runner is None:
            self._fail(conn, rid, ErrorCode.INVALID_REQUEST, "this worker's engine cannot run a prompt pass")
            return
        fut = asyncio.ensure_future(self._pass(ids, submit.task != Task.EMBED))
        key = (cid, rid)
        self._pending.add(key, fut)
        fut.add_done_callback(lambda f: self._passed(conn, cid, submit, ids, f))

    def _resumed(self, submit: Submit, ids: list[int]) -> Submit:
        """A resumed echo's Submit as a plain resumed generation: what the client has counts the prompt
        entry first (its tokens, and its text when asked), which the worker's output does not."""
        cont = submit.continuation
        assert cont is not None
        text = 0
        if submit.return_text:
            text = len((submit.prompt if submit.prompt is not None else self._tok.decode(ids)).encode())
        if cont.token_ids[: len(ids)] != tuple(ids) or cont.text_bytes < text:
            raise EngineError(ErrorCode.INVALID_REQUEST, "an echo's continuation must begin with its prompt")
        return replace(submit, echo=False, continuation=Continuation(cont.token_ids[len(ids):], cont.text_bytes - text))

    def _check(self, submit: Submit, ids: list[int]) -> None:
        """What the engine would refuse (the ids the model has, the context), refused before the pass."""
        if ids and (min(ids) < 0 or max(ids) >= self._vocab):
            raise EngineError(ErrorCode.INVALID_REQUEST, f"token ids must be in [0, {self._vocab})")
        if submit.task == Task.DETOKENIZE:
            return
        if not ids:
            raise EngineError(ErrorCode.INVALID_REQUEST, "the prompt is empty")
        need = len(ids) + (submit.params.max_tokens if submit.echo else 0)
        if need > self._max_len:
            raise EngineError(ErrorCode.CONTEXT_LENGTH, f"prompt ({len(ids)} tokens)"
                              + (f" + max_tokens ({submit.params.max_tokens})" if submit.echo else "")
                              + f" exceeds the context length ({self._max_len})")

    async def _pass(self, ids: list[int], logprobs: bool) -> PromptResult:
        """Compile on a thread of the loop's default pool (a new length costs a compile, which must not
        stall the running streams), then run on the step thread."""
        runner = self._runner
        assert runner is not None
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, runner.prepare_prompt_pass, len(ids), logprobs)
        return await loop.run_in_executor(self._executor, runner.prompt_pass, ids, logprobs)

    def cancel(self, key: Key) -> bool:
        """A cancel for a request whose pass is running: it ends here (True)."""
        return self._pending.cancel(key)

    def forget(self, cid: int) -> None:
        self._pending.forget(cid)

    def _passed(self, conn: ServerConnection, cid: int, submit: Submit, ids: list[int],
                fut: asyncio.Future[PromptResult]) -> None:
        rid = submit.request_id
        if not self._pending.take((cid, rid), fut):
            return  # cancelled, or its connection went
        if conn.closed:
            return
        try:
            res = fut.result()
        except PromptPassUnavailable as exc:
            self._fail(conn, rid, ErrorCode.INVALID_REQUEST, str(exc))
            return
        except ValueError as exc:  # e.g. a prompt longer than the model's context
            self._fail(conn, rid, ErrorCode.CONTEXT_LENGTH, str(exc))
            return
        except Exception as exc:
            log.exception("prompt pass failed")
            self._fail(conn, rid, ErrorCode.INTERNAL, f"prompt pass failed: {exc}")
            return
        if submit.task == Task.EMBED:
            vec = pooled(res.hidden, submit.pooling)
            self._answer(conn, Delta(rid, (), base64.b64encode(vec.tobytes()).decode("ascii")), len(ids))
        else:
            self._echo(conn, cid, submit, ids, res)

    def _echo(self, conn: ServerConnection, cid: int, submit: Submit, ids: list[int], res: PromptResult | None) -> None:
        p = submit.params
        text = ""
        if submit.return_text:
            text = submit.prompt if submit.prompt is not None else self._tok.decode(ids)
        d = Delta(submit.request_id, tuple(ids), text)
        if res is not None and res.logprobs is not None:
            if p.logprobs:
                d.logprobs = tuple(res.logprobs.tolist())
            n = p.top_logprobs
            if n and res.top_ids is not None and res.top_logprobs is not None:
                d.top_n = n
                d.top_ids = tuple(res.top_ids[:, :n].reshape(-1).tolist())
                d.top_logprobs = tuple(res.top_logprobs[:, :n].reshape(-1).tolist())
        conn.send_tokens(self._pack([(submit.request_id, d)]))
        if p.max_tokens == 0:  # the prompt alone (lm-eval-harness's loglikelihood requests)
            conn.send_finish(Finish(submit.request_id, FinishReason.LENGTH, len(ids), 0))
            return
        self._service.generate(conn, cid, submit, ids)

    def _answer(self, conn: ServerConnection, d: Delta, prompt_tokens: int) -> None:
        rid = d.key
        assert isinstance(rid, int)
        conn.send_tokens(self._pack([(rid, d)]))
        conn.send_finish(Finish(rid, FinishReason.STOP, prompt_tokens, 0))

    @staticmethod
    def _fail(conn: ServerConnection, rid: int, code: ErrorCode, message: str) -> None:
        conn.send_error(Error(rid, code, message))

