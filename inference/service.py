"""The worker's transport handler and engine loop (the asyncio adapter around
:class:`~inference.engine.Engine`).

How it works: transport callbacks (``on_submit``/``on_cancel``/``on_credit``/
``on_disconnect``) run on the event loop and only touch the engine, then wake
the loop. :meth:`WorkerService.run` repeats: schedule a step, run the runner
(in a one-thread executor so the loop keeps answering heartbeats during a
long step), commit, and send what the step produced — one ``TokenBatch`` per
connection for all its requests, then a ``Finish``/``Error`` per ended
request. A request whose credit reaches 0 (its client is not reading) is
paused off the engine's batch until the gateway grants more; past the
engine's ``stall_timeout`` it ends with a TIMEOUT error. Stats go to every
connection every ``stats_interval``. A gateway that subscribes to KV events
(:mod:`inference.kv_events`) gets the prefix cache's changes after every step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from array import array
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from transport.api import ServerConnection
from transport.messages import Error, ErrorCode, Finish, FinishReason, Hello, Stats, Submit, TokenBatch

from .engine import Delta, Engine, EngineError, EngineEvent, Failed, Finished
from .guided import GuideCompiles
from .kv_events import KvPublisher
from .tasks import PromptTasks
from .tokenizer import Tokenizer, TokenizerError
from .tracing import WorkerTracer

if TYPE_CHECKING:
    from .grammar import Guide

__all__ = ["WorkerService", "pack_tokens"]

log = logging.getLogger("inference.worker")
Key = tuple[int, int]  # (connection number, request id)


def pack_tokens(deltas: Sequence[tuple[int, Delta]]) -> TokenBatch:
    """One TokenBatch from (request id, delta) pairs, in order."""
    rids, counts, toks, tlens = array("I"), array("I"), array("I"), array("I")
    has_lp, top_ns = array("B"), array("B")
    lps, tids, tlps = array("f"), array("I"), array("f")
    text = bytearray()
    for rid, d in deltas:
        rids.append(rid)
        counts.append(len(d.token_ids))
        toks.extend(d.token_ids)
        t = d.text.encode()
        tlens.append(len(t))
        text += t
        has_lp.append(d.logprobs is not None)
        top_ns.append(d.top_n)
        if d.logprobs:
            lps.extend(d.logprobs)
        if d.top_ids:
            tids.extend(d.top_ids)
            tlps.extend(d.top_logprobs)
    return TokenBatch(rids, counts, toks, tlens, bytes(text), has_lp, top_ns, lps, tids, tlps)


class WorkerService:
    """Implements :class:`transport.api.WorkerHandler` over an :class:`Engine`."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        *,
        served_name: str,
        model_id: str = "",
        identity: str = "",
        stats_interval: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        threaded: bool = True,
        tracer: WorkerTracer | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.served_name = served_name
        self.model_id = model_id or served_name
        self.identity = identity or f"worker@{os.uname().nodename}:{os.getpid()}"
        self.stats_interval = stats_interval
        self._clock = clock
        self._conns: dict[int, ServerConnection] = {}
        self._conn_no: dict[int, int] = {}  # id(conn) -> connection number
        self._next_conn = 1
        self._wake = asyncio.Event()
        self._draining = False
        self._stopped = False
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step") if threaded else None
        self._tokens_window: list[tuple[float, int]] = []
        self.server: Any = None  # a transport server with ``connections``, if attached
        self.tracer = tracer if tracer is not None else WorkerTracer()  # off unless given an exporter
        # The Stats last sent, for the worker's own /metrics (read from its HTTP thread: one reference swap).
        self.last_stats: Stats | None = None
        self.grammars = GuideCompiles(self)  # structured output's compiles, off the loop and the step
        # embeddings, tokenize, detokenize, echo's prompt entry (#31); prompt passes on the step thread
        self.tasks = PromptTasks(self, tokenizer, engine.runner, self._executor, pack_tokens, engine.max_model_len)
        self.kv_events = KvPublisher(engine.kv)  # the prefix cache's changes, to gateways that subscribe
        self.startup: tuple[float, ...] = ()  # seconds of (load, compile, warm-up), set by the worker once it serves

    # -- WorkerHandler ------------------------------------------------------
    def hello(self) -> Hello:
        """Who we are and what we can hold: the gateway sizes and routes by these."""
        eng = self.engine
        caps = ("logprobs", "text", "chat", "continuation", "tasks") + (("kv_events",) if self.kv_events.capable else ())
        return Hello(role="worker", identity=self.identity, models=(self.served_name,),
                     capabilities=caps, max_batch=eng.config.max_batch,
                     kv_blocks=eng.kv.num_blocks, block_size=eng.kv.block_size, max_model_len=eng.max_model_len,
                     model_id=self.model_id, prefix_hash=eng.kv.hash_scheme, kv_epoch=self.kv_events.epoch,
                     startup=self.startup)  # fmt: skip

    def _key(self, conn: ServerConnection) -> int:
        cid = self._conn_no.get(id(conn))
        if cid is None:
            cid = self._conn_no[id(conn)] = self._next_conn
            self._next_conn += 1
            self._conns[cid] = conn
        return cid

    def on_submit(self, conn: ServerConnection, submit: Submit) -> None:
        rid = submit.request_id
        cid = self._key(conn)
        try:
            if self._draining:
                raise EngineError(ErrorCode.SHUTTING_DOWN, "the worker is shutting down")
            if submit.model != self.served_name:
                raise EngineError(ErrorCode.UNKNOWN_MODEL, f"model {submit.model!r} is not served here "
                                                           f"(serving {self.served_name!r})")  # fmt: skip
            ids = self._prompt_ids(submit)
            if submit.task or submit.echo:  # an answer about the prompt; echo: its entry, then generate()
                self.tasks.start(conn, cid, submit, ids)
                return
        except EngineError as exc:
            conn.send_error(Error(rid, exc.code, exc.message))
            return
        self.generate(conn, cid, submit, ids)

    def generate(self, conn: ServerConnection, cid: int, submit: Submit, ids: list[int]) -> None:
        """A generation whose prompt is tokenized: to the engine (structured output: its grammar first)."""
        try:
            if submit.continuation is not None and self._resumed_at_its_end(conn, submit, len(ids)):
                return
            if submit.params.guide_kind:  # structured output: its grammar compiles first, off the loop
                self.grammars.submit(conn, cid, submit, ids)
                return
            self._add(cid, submit, ids, None)
        except EngineError as exc:
            conn.send_error(Error(submit.request_id, exc.code, exc.message))
            return
        self._wake.set()

    def _add(self, cid: int, submit: Submit, ids: list[int], guide: Guide | None) -> None:
        now = self._clock()
        deadline = now + submit.deadline_ms / 1e3 if submit.deadline_ms > 0 else None
        self.engine.add((cid, submit.request_id), ids, submit.params, now, deadline=deadline,
                        return_text=submit.return_text, guide=guide, continuation=submit.continuation)  # fmt: skip
        self.tracer.submitted((cid, submit.request_id), submit.trace)

    def eos_ids(self) -> tuple[int, ...]:
        """What ends a sequence here (the runner's eos, else the tokenizer's): grammars allow them at the end."""
        return tuple(self.engine.runner.eos_token_ids) or tuple(self.tokenizer.eos_token_ids)

    def guided(self, conn: ServerConnection, cid: int, submit: Submit, ids: list[int], guide: Guide) -> None:
        """A constrained request whose grammar compiled (:class:`~inference.guided.GuideCompiles`): to the engine."""
        if self._conns.get(cid) is not conn or conn.closed:
            return
        try:
            if self._draining:
                raise EngineError(ErrorCode.SHUTTING_DOWN, "the worker is shutting down")
            self._add(cid, submit, ids, guide)
        except EngineError as exc:
            conn.send_error(Error(submit.request_id, exc.code, exc.message))
            return
        self._wake.set()

    def _resumed_at_its_end(self, conn: ServerConnection, submit: Submit, prompt_len: int) -> bool:
        """A resumed request (``Submit.continuation``) whose tokens are all valid; True (and its
        Finish sent) when it already has all its ``max_tokens`` (its first replica was lost between
        its last token and its end)."""
        cont = submit.continuation
        assert cont is not None
        if cont.token_ids and max(cont.token_ids) >= self.tokenizer.vocab_size:
            raise EngineError(ErrorCode.INVALID_REQUEST,
                              f"continuation token ids must be in [0, {self.tokenizer.vocab_size})")
        if len(cont.token_ids) < submit.params.max_tokens:
            return False
        conn.send_finish(Finish(submit.request_id, FinishReason.LENGTH, prompt_len, len(cont.token_ids)))
        return True

    def _prompt_ids(self, s: Submit) -> list[int]:
        given = [x is not None for x in (s.prompt, s.prompt_token_ids, s.messages)]
        if sum(given) != 1:
            raise EngineError(ErrorCode.INVALID_REQUEST, "exactly one of prompt, prompt_token_ids, messages")
        try:
            if s.prompt is not None:
                return self.tokenizer.encode(s.prompt)
            if s.messages is not None:
                return self.tokenizer.encode_chat(s.messages, tools=json.loads(s.params.tools) if s.params.tools
                                                  else None)
        except (TokenizerError, ValueError) as exc:  # ValueError: tools that are not JSON
            raise EngineError(ErrorCode.INVALID_REQUEST, str(exc)) from exc
        return list(s.prompt_token_ids or ())

    def on_cancel(self, conn: ServerConnection, request_id: int) -> None:
        key = (self._key(conn), request_id)
        if self.grammars.cancel(key) or self.tasks.cancel(key):  # still compiling its grammar, or in its prompt pass
            conn.send_finish(Finish(request_id, FinishReason.CANCELLED, 0, 0))
            return
        fin = self.engine.cancel(key)
        self.tracer.ended(key, error="cancelled")
        if fin is not None:
            conn.send_finish(self._finish(request_id, fin))

    def on_credit(self, conn: ServerConnection, request_id: int, available: int) -> None:
        self.engine.resume((self._key(conn), request_id))
        self._wake.set()

    def on_kv_subscribe(self, conn: ServerConnection) -> None:
        self.kv_events.subscribe(conn)

    def on_disconnect(self, conn: ServerConnection, open_requests: Sequence[int]) -> None:
        self.kv_events.unsubscribe(conn)
        cid = self._conn_no.pop(id(conn), None)
        if cid is None:
            return
        self._conns.pop(cid, None)
        self.grammars.forget(cid)
        self.tasks.forget(cid)
        for rid in open_requests:
            self.engine.cancel((cid, rid))
            self.tracer.ended((cid, rid), error="gateway disconnected")
        for key in [k for k in self.engine.keys() if isinstance(k, tuple) and k[0] == cid]:
            self.engine.cancel(key)
            self.tracer.ended(key, error="gateway disconnected")

    # -- loop -----------------------------------------------------------------
    async def run(self) -> None:
        """Serve steps until :meth:`stop` (or a drain finishes)."""
        loop = asyncio.get_running_loop()
        stats = asyncio.create_task(self._stats_loop())
        try:
            while not self._stopped:
                if self._draining and not self.engine.has_unfinished() and not self.grammars.pending \
                        and not self.tasks.pending:
                    break
                plan, events = self.engine.schedule(self._clock())
                self._dispatch(events)
                if plan is None:
                    self._wake.clear()
                    wake_at = self.engine.next_wakeup()
                    # A due time that is already past means admission is blocked
                    # (no free blocks): sleep a little rather than spin.
                    timeout = None if wake_at is None else max(0.002, wake_at - self._clock())
                    try:
                        await asyncio.wait_for(self._wake.wait(), timeout)
                    except TimeoutError:
                        pass
                    continue
                self.tracer.step_started()
                try:
                    if self._executor is not None:
                        outputs = await loop.run_in_executor(self._executor, self.engine.runner.execute, plan)
                    else:
                        outputs = self.engine.runner.execute(plan)
                    events = self.engine.commit(plan, outputs, self._clock())
                except Exception as exc:  # a runner failure ends every request, not the worker
                    log.exception("engine step failed")
                    events = list(self.engine.abort_all(ErrorCode.INTERNAL, f"engine step failed: {exc}"))
                self._dispatch(events)
                self.kv_events.publish()
                await asyncio.sleep(0)
        finally:
            stats.cancel()
            if self._executor is not None:
                self._executor.shutdown(wait=False)

    def wake(self) -> None:
        self._wake.set()

    def drain(self) -> None:
        """Refuse new requests; :meth:`run` returns once in-flight ones end."""
        self._draining = True
        self._wake.set()

    def abort(self, code: ErrorCode = ErrorCode.SHUTTING_DOWN, message: str = "worker stopped") -> None:
        """End every request now with an error and stop the loop."""
        self._dispatch(list(self.engine.abort_all(code, message)))
        self._stopped = True
        self._wake.set()

    def _dispatch(self, events: Sequence[EngineEvent]) -> None:
        if not events:
            return
        per_conn: dict[int, list[tuple[int, Delta]]] = {}
        ends: list[Finished | Failed] = []
        ntok = 0
        traced = self.tracer.open  # empty unless traced requests run: then one lookup per event
        for ev in events:
            if isinstance(ev, Delta):
                per_conn.setdefault(ev.key[0], []).append((ev.key[1], ev))  # type: ignore[index]
                ntok += len(ev.token_ids)
                if traced:
                    self.tracer.token(ev.key)
            else:
                ends.append(ev)
                if traced:
                    if isinstance(ev, Finished):
                        self.tracer.ended(ev.key, completion_tokens=ev.completion_tokens,
                                          cached_tokens=ev.cached_tokens)
                    else:
                        self.tracer.ended(ev.key, error=ev.message)
        now = self._clock()
        for cid, deltas in per_conn.items():
            conn = self._conns.get(cid)
            if conn is None or conn.closed:
                continue
            conn.send_tokens(pack_tokens(deltas))
            for rid, _ in deltas:
                if conn.credit(rid) <= 0:
                    self.engine.pause((cid, rid), now)
        for ev in ends:
            cid, rid = ev.key  # type: ignore[misc]
            conn = self._conns.get(cid)
            if conn is None or conn.closed:
                continue
            if isinstance(ev, Finished):
                conn.send_finish(self._finish(rid, ev))
            else:
                conn.send_error(Error(rid, ev.code, ev.message))
        if ntok:
            self._tokens_window.append((now, ntok))

    @staticmethod
    def _finish(rid: int, f: Finished) -> Finish:
        return Finish(rid, f.reason, f.prompt_tokens, f.completion_tokens, f.cached_tokens)

    def stats(self) -> Stats:
        eng = self.engine
        now = self._clock()
        win = self._tokens_window = [(t, n) for t, n in self._tokens_window if now - t <= 5.0]
        span = now - win[0][0] if len(win) > 1 else 0.0
        rate = sum(n for _, n in win) / span if span > 0 else 0.0
        self.kv_events.publish()  # so that kv_seq names a batch already sent
        return Stats(eng.num_waiting, eng.num_running, eng.kv.num_free, eng.kv.num_blocks,
                     eng.kv.hit_rate, eng.kv.prefix_hashes(), rate, eng.steps, eng.step_seconds,
                     eng.step_sequences, eng.num_preemptions, eng.window.window,
                     kv_epoch=self.kv_events.epoch, kv_seq=self.kv_events.seq)  # fmt: skip

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(self.stats_interval)
            st = self.last_stats = self.stats()
            conns = {id(c): c for c in self._conns.values()}
            conns.update((id(c), c) for c in getattr(self.server, "connections", ()))
            for conn in conns.values():
                if not conn.closed:
                    conn.send_stats(st)
