"""Test doubles: an echo worker handler that streams tokens under credit."""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Sequence

from transport.api import ServerConnection
from transport.messages import Error, ErrorCode, Finish, FinishReason, Hello, Submit, TokenBatch

__all__ = ["EchoWorker"]


class EchoWorker:
    """Test double worker: request ``r`` streams tokens ``0..max_tokens-1`` (text ``"t<i>"``).

    One "engine step" per loop tick emits one token for every runnable request
    in a single TokenBatch, honouring credit; Cancel ends with Finish(CANCELLED).
    """

    def __init__(self, models: tuple[str, ...] = ("tiny",), step_delay: float = 0.0) -> None:
        self.models = models
        self.step_delay = step_delay
        self.active: dict[tuple[int, int], tuple[ServerConnection, Submit, int]] = {}
        self.cancelled: list[int] = []
        self.disconnected: list[tuple[int, ...]] = []
        self.ended: list[int] = []
        self.stalled_on_credit = 0
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    def hello(self) -> Hello:
        return Hello(role="worker", identity="echo", models=self.models, capabilities=("text",))

    def on_submit(self, conn: ServerConnection, submit: Submit) -> None:
        if submit.model not in self.models:
            conn.send_error(Error(submit.request_id, ErrorCode.UNKNOWN_MODEL, f"no model {submit.model}"))
            self.ended.append(submit.request_id)
            return
        self.active[(id(conn), submit.request_id)] = (conn, submit, 0)
        self._kick()

    def on_cancel(self, conn: ServerConnection, request_id: int) -> None:
        key = (id(conn), request_id)
        if key in self.active:
            c, s, done = self.active.pop(key)
            self.cancelled.append(request_id)
            self.ended.append(request_id)
            c.send_finish(Finish(request_id, FinishReason.CANCELLED, 1, done))

    def on_credit(self, conn: ServerConnection, request_id: int, available: int) -> None:
        self._kick()

    def on_disconnect(self, conn: ServerConnection, open_requests: Sequence[int]) -> None:
        self.disconnected.append(tuple(open_requests))
        for rid in open_requests:
            self.active.pop((id(conn), rid), None)

    def _kick(self) -> None:
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while self.active:
            self._wake.clear()
            by_conn: dict[int, list[tuple[int, int]]] = {}
            conns: dict[int, ServerConnection] = {}
            for (cid, rid), (conn, _sub, done) in list(self.active.items()):
                if conn.closed:
                    continue
                if conn.credit(rid) < 1:
                    self.stalled_on_credit += 1
                    continue
                by_conn.setdefault(cid, []).append((rid, done))
                conns[cid] = conn
            for cid, items in by_conn.items():
                conn = conns[cid]
                texts = [f"t{done}".encode() for _, done in items]
                batch = TokenBatch(
                    array("I", [rid for rid, _ in items]),
                    array("I", [1]) * len(items),
                    array("I", [done for _, done in items]),
                    array("I", [len(t) for t in texts]),
                    b"".join(texts),
                )
                conn.send_tokens(batch)
                for rid, done in items:
                    c, sub, _ = self.active[(cid, rid)]
                    done += 1
                    if done >= sub.params.max_tokens:
                        del self.active[(cid, rid)]
                        self.ended.append(rid)
                        c.send_finish(Finish(rid, FinishReason.LENGTH, 3, done))
                    else:
                        self.active[(cid, rid)] = (c, sub, done)
            if not by_conn:
                await self._wake.wait()
            elif self.step_delay:
                await asyncio.sleep(self.step_delay)
            else:
                await asyncio.sleep(0)
