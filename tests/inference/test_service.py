"""WorkerService (the worker's transport handler + engine loop) against a
recording ServerConnection test double, with the synthetic runner."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from inference.engine import Engine, EngineConfig
from inference.service import WorkerService
from inference.synthetic import SyntheticCost, SyntheticRunner
from inference.tokenizer import ByteTokenizer
from transport.messages import (
    Error,
    ErrorCode,
    Finish,
    FinishReason,
    Hello,
    SamplingParams,
    Stats,
    Submit,
    TokenBatch,
)


class RecordingConnection:
    """Test double for transport.api.ServerConnection: records every send and
    applies the credit rule (tokens sent use up credit)."""

    def __init__(self, credit: int = 256) -> None:
        self.peer_hello = Hello()
        self.closed = False
        self.sent: list[object] = []
        self.initial = credit
        self.used: dict[int, int] = {}

    def send_tokens(self, batch: TokenBatch) -> None:
        for e in batch.entries():
            self.used[e.request_id] = self.used.get(e.request_id, 0) + len(e.token_ids)
            assert self.used[e.request_id] <= self.initial, "sent past credit"
        self.sent.append(batch)

    def send_finish(self, finish: Finish) -> None:
        self.sent.append(finish)

    def send_error(self, error: Error) -> None:
        self.sent.append(error)

    def send_stats(self, stats: Stats) -> None:
        self.sent.append(stats)

    def credit(self, request_id: int) -> int:
        return self.initial - self.used.get(request_id, 0)

    def entries(self, rid: int) -> Iterator[object]:
        for m in self.sent:
            if isinstance(m, TokenBatch):
                yield from (e for e in m.entries() if e.request_id == rid)

    def text(self, rid: int) -> str:
        return b"".join(bytes(e.text) for e in self.entries(rid)).decode()  # type: ignore[attr-defined]

    def ends(self, rid: int) -> list[object]:
        return [m for m in self.sent if isinstance(m, Finish | Error) and m.request_id == rid]


def make_service(**kw: object) -> WorkerService:
    runner = SyntheticRunner(block_size=4, num_blocks=64)
    eng = Engine(runner, ByteTokenizer(), EngineConfig(max_batch=8))
    return WorkerService(eng, ByteTokenizer(), served_name="tiny", stats_interval=0.05, **kw)  # type: ignore[arg-type]


async def run_until(svc: WorkerService, cond: object, timeout: float = 5.0) -> None:
    task = asyncio.create_task(svc.run())
    try:
        async with asyncio.timeout(timeout):
            while not cond():  # type: ignore[operator]
                await asyncio.sleep(0.005)
    finally:
        svc.abort()
        await task


@pytest.mark.parametrize("threaded", [True, False])
async def test_requests_stream_one_batch_per_step_and_finish_once(threaded: bool) -> None:
    svc = make_service(threaded=threaded)
    conn = RecordingConnection()
    svc.on_submit(conn, Submit(1, "tiny", SamplingParams(max_tokens=5, seed=1, logprobs=True), prompt="hi"))
    svc.on_submit(conn, Submit(2, "tiny", SamplingParams(max_tokens=3, seed=2),
                               messages=({"role": "user", "content": "yo"},)))  # fmt: skip
    await run_until(svc, lambda: conn.ends(1) and conn.ends(2))
    batches = [m for m in conn.sent if isinstance(m, TokenBatch)]
    assert len(batches[0]) == 2  # both requests in the first step's one frame
    assert conn.ends(1) == [Finish(1, FinishReason.LENGTH, 3, 5, 0)]
    assert len(conn.ends(2)) == 1 and len(conn.text(2)) == 3 and len(conn.text(1)) == 5
    assert all(e.logprobs is not None and len(e.logprobs) == 1 for e in conn.entries(1))  # type: ignore[attr-defined]
    assert all(e.logprobs is None for e in conn.entries(2))  # type: ignore[attr-defined]


async def test_bad_submits_get_one_error_each() -> None:
    svc = make_service()
    conn = RecordingConnection()
    svc.on_submit(conn, Submit(1, "other-model", prompt="x"))
    svc.on_submit(conn, Submit(2, "tiny", prompt="x", prompt_token_ids=(1,)))
    svc.on_submit(conn, Submit(3, "tiny", SamplingParams(max_tokens=10_000), prompt="x"))
    svc.on_submit(conn, Submit(4, "tiny", messages=({"content": "no role"},)))
    codes = [m.code for m in conn.sent]  # type: ignore[attr-defined]
    assert codes == [ErrorCode.UNKNOWN_MODEL, ErrorCode.INVALID_REQUEST, ErrorCode.CONTEXT_LENGTH,
                     ErrorCode.INVALID_REQUEST]  # fmt: skip
    assert not svc.engine.has_unfinished()


async def test_cancel_and_disconnect() -> None:
    svc = make_service()
    svc.engine.runner.cost = SyntheticCost(step_s=0.002)  # type: ignore[attr-defined]
    a, b = RecordingConnection(), RecordingConnection()
    svc.on_submit(a, Submit(1, "tiny", SamplingParams(max_tokens=200), prompt="long"))
    svc.on_submit(b, Submit(1, "tiny", SamplingParams(max_tokens=200), prompt="long"))
    svc.on_submit(b, Submit(2, "tiny", SamplingParams(max_tokens=200), prompt="long"))
    task = asyncio.create_task(svc.run())
    async with asyncio.timeout(5):
        while len(list(a.entries(1))) < 3 or len(list(b.entries(2))) < 3:
            await asyncio.sleep(0.005)
    svc.on_cancel(a, 1)
    svc.on_cancel(a, 1)  # twice: still one end
    ends = a.ends(1)
    assert len(ends) == 1 and ends[0].reason is FinishReason.CANCELLED  # type: ignore[union-attr]
    n_sent = len(b.sent)
    svc.on_disconnect(b, [1, 2])
    assert not svc.engine.has_unfinished() and svc.engine.kv.num_free == 64
    await asyncio.sleep(0.05)
    svc.abort()
    await task
    assert len(a.ends(1)) == 1 and len(b.sent) == n_sent  # nothing more for the gone peer


async def test_credit_pauses_and_resumes() -> None:
    svc = make_service()
    conn = RecordingConnection(credit=4)
    svc.on_submit(conn, Submit(7, "tiny", SamplingParams(max_tokens=10, seed=3), prompt="p"))
    task = asyncio.create_task(svc.run())
    for _ in range(200):
        await asyncio.sleep(0.005)
        if conn.credit(7) == 0:
            break
    await asyncio.sleep(0.05)
    assert len(list(conn.entries(7))) == 4 and not conn.ends(7)  # paused at zero credit
    conn.initial += 10
    svc.on_credit(conn, 7, 10)
    for _ in range(200):
        await asyncio.sleep(0.005)
        if conn.ends(7):
            break
    svc.abort()
    await task
    assert len(conn.text(7)) == 10 and conn.ends(7)[0].reason is FinishReason.LENGTH  # type: ignore[union-attr]


async def test_stats_and_drain() -> None:
    svc = make_service()
    conn = RecordingConnection()
    svc.on_submit(conn, Submit(1, "tiny", SamplingParams(max_tokens=3), prompt="aaaaaaaaaaaa"))
    task = asyncio.create_task(svc.run())
    await asyncio.sleep(0.15)
    svc.on_submit(conn, Submit(2, "tiny", SamplingParams(max_tokens=3), prompt="aaaaaaaaaaaab"))
    svc.drain()
    svc.on_submit(conn, Submit(3, "tiny", prompt="late"))
    await asyncio.wait_for(task, 5)  # run() returns once drained
    stats = [m for m in conn.sent if isinstance(m, Stats)]
    assert stats and stats[-1].kv_blocks_total == 64
    assert conn.ends(3)[0].code is ErrorCode.SHUTTING_DOWN  # type: ignore[union-attr]
    assert conn.ends(2)[0].cached_tokens == 12  # type: ignore[union-attr]  # 3 blocks of "aaaa..." reused
    assert svc.stats().prefix_hit_rate > 0 and svc.stats().prefix_hashes
    # the engine counters ride along: 2 requests of 3 tokens -> at least 3 steps, 6 sequences
    final = svc.stats()
    assert final.steps >= 3 and final.step_sequences == 6 and final.step_seconds > 0
    assert final.preemptions == 0 and final.batch_window_s == svc.engine.window.window
