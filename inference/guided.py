"""The worker's structured-output compiles: a constrained request's grammar is compiled on a thread
of its own before the request joins the engine, so neither the event loop (heartbeats, other
requests' tokens) nor the engine step waits for a client's schema.

How it works: :meth:`GuideCompiles.submit` hands the (kind, text) pair to a one-thread pool
(``grammar``) and keeps the future under the request's key; when it is done, on the loop, the
request goes to the engine with its :class:`~inference.grammar.Guide` (``WorkerService.guided``),
or ends with INVALID_REQUEST naming what could not be compiled. A cancel or a lost connection while
it compiles ends it here. The compiler (and llguidance) is loaded on the first constrained request:
a worker that never sees one never imports it. At most :data:`MAX_PENDING` compiles wait at once;
beyond that a request is refused as OVERLOADED, so a flood of hostile schemas queues nothing
unbounded (each compile is bounded in time and memory by :data:`inference.grammar.LIMITS`).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from transport.api import ServerConnection
from transport.messages import Error, ErrorCode, Submit

from .engine import EngineError
from .pending import Key, PendingWork

if TYPE_CHECKING:
    from .grammar import GrammarCompiler, Guide
    from .tokenizer import Tokenizer

__all__ = ["GuideCompiles", "MAX_PENDING"]

log = logging.getLogger("inference.worker")
MAX_PENDING = 64


class _Service(Protocol):
    tokenizer: Tokenizer

    def eos_ids(self) -> tuple[int, ...]: ...

    def guided(self, conn: ServerConnection, cid: int, submit: Submit, ids: list[int], guide: Guide) -> None: ...


class GuideCompiles:
    """Constrained requests whose grammar is compiling, for one worker service."""

    def __init__(self, service: _Service) -> None:
        self._service = service
        self._compiler: GrammarCompiler | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pending: PendingWork[Guide] = PendingWork()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def submit(self, conn: ServerConnection, cid: int, submit: Submit, ids: list[int]) -> None:
        """Start compiling (on the event loop); raises :class:`EngineError` when too many wait."""
        if len(self._pending) >= MAX_PENDING:
            raise EngineError(ErrorCode.OVERLOADED, f"{MAX_PENDING} structured-output grammars are compiling")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        key = (cid, submit.request_id)
        p = submit.params
        fut = asyncio.get_running_loop().run_in_executor(self._pool, self._guide, p.guide_kind, p.guide)
        self._pending.add(key, fut)
        fut.add_done_callback(partial(self._done, conn, key, submit, ids))

    def _guide(self, kind: str, text: str) -> Guide:
        if self._compiler is None:  # on the grammar thread: loading llguidance stalls no one
            from .grammar import GrammarCompiler

            self._compiler = GrammarCompiler(self._service.tokenizer, self._service.eos_ids())
        return self._compiler.guide(kind, text)

    def _done(self, conn: ServerConnection, key: Key, submit: Submit, ids: list[int],
              fut: asyncio.Future[Guide] | Future[Any]) -> None:
        if not self._pending.take(key, fut):
            return  # cancelled, or its connection went away
        exc = fut.exception()
        if exc is None:
            self._service.guided(conn, key[0], submit, ids, fut.result())
            return
        from .grammar import GrammarError

        if conn.closed:
            return
        if isinstance(exc, GrammarError):
            conn.send_error(Error(submit.request_id, ErrorCode.INVALID_REQUEST, f"structured output: {exc}"))
        else:
            log.error("compiling a structured-output grammar failed", exc_info=exc)
            conn.send_error(Error(submit.request_id, ErrorCode.INTERNAL, f"structured output: {exc}"))

    def cancel(self, key: Key) -> bool:
        """Drop a request that is still compiling; False if it is not."""
        return self._pending.cancel(key)

    def forget(self, cid: int) -> None:
        """A connection went away: drop its requests still compiling."""
        self._pending.forget(cid)
