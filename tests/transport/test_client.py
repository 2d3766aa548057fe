"""ClientStream consumption modes over real loopback sockets: ``next_events`` and ``collect``."""

from __future__ import annotations

import asyncio

import pytest

from tests.transport.doubles import EchoWorker
from tests.transport.test_integration import LOOPS, run, tokens_of
from transport.client import ClientStream, Collected, connect
from transport.messages import Error, ErrorCode, Finish, FinishReason, SamplingParams, Submit
from transport.server import serve


def _text(n: int, start: int = 0) -> bytes:
    return b"".join(f"t{i}".encode() for i in range(start, n))


def _submit(conn: object, max_tokens: int, model: str = "tiny", logprobs: bool = False) -> ClientStream:
    c = conn  # a ClientConnection
    return c.submit(Submit(c.next_request_id(), model,  # type: ignore[attr-defined]
                           SamplingParams(max_tokens=max_tokens, logprobs=logprobs), prompt="x"))


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_collect_grants_credit_and_returns_everything(loop_kind: str) -> None:
    """100 tokens through a 16-token window: collect() must keep granting credit or it stalls."""

    async def body() -> None:
        worker = EchoWorker()
        srv = await serve("tcp://127.0.0.1:0", worker)
        conn = await connect(srv.address, initial_credit=16)
        st = _submit(conn, 100)
        res = await st.collect()
        assert isinstance(res, Collected)
        assert res.text == _text(100) and res.tokens == 100
        assert res.first_token_at > 0
        assert isinstance(res.final, Finish) and res.final.completion_tokens == 100
        assert st.done  # without Credit grants the 16-token window would stall it (run() times out)
        with pytest.raises(StopAsyncIteration):
            await st.next_events()
        await conn.close()
        await srv.close()

    run(loop_kind, body)


def test_collect_after_next_events_keeps_unread_events_once() -> None:
    async def body() -> None:
        worker = EchoWorker(step_delay=0.001)
        srv = await serve("tcp://127.0.0.1:0", worker)
        conn = await connect(srv.address, initial_credit=8)
        st = _submit(conn, 40)
        first = await st.next_events()
        got = tokens_of(first)
        assert got and got == list(range(len(got)))
        while len(st._events) < 2:  # let a few more steps buffer before switching modes
            await asyncio.sleep(0.001)
        res = await st.collect()
        assert res.text == _text(40, len(got)) and res.tokens == 40 - len(got)
        assert isinstance(res.final, Finish)
        with pytest.raises(RuntimeError):
            st.collect()
        await conn.close()
        await srv.close()

    run("asyncio", body)


def test_collect_and_event_streams_share_batches() -> None:
    """One stream collects, another reads events; the same TokenBatch frames feed both."""

    async def body() -> None:
        worker = EchoWorker()
        srv = await serve("tcp://127.0.0.1:0", worker)
        conn = await connect(srv.address, initial_credit=4)
        a = _submit(conn, 30)
        b = _submit(conn, 30)
        fut = a.collect()
        events = []
        while True:
            try:
                events += await b.next_events()
            except StopAsyncIteration:
                break
        res = await fut
        assert res.text == _text(30) and tokens_of(events) == list(range(30))
        assert isinstance(events[-1], Finish)
        await conn.close()
        await srv.close()

    run("asyncio", body)


def test_collect_errors_and_refusals() -> None:
    async def body() -> None:
        worker = EchoWorker()
        srv = await serve("tcp://127.0.0.1:0", worker)
        conn = await connect(srv.address)
        bad = _submit(conn, 5, model="nope")
        res = await bad.collect()
        assert res.tokens == 0 and res.text == b"" and res.first_token_at == 0.0
        assert isinstance(res.final, Error) and res.final.code == ErrorCode.UNKNOWN_MODEL
        lp = _submit(conn, 5, logprobs=True)
        with pytest.raises(ValueError, match="logprobs"):
            lp.collect()
        lp.cancel()
        await conn.close()
        await srv.close()

    run("asyncio", body)


def test_cancel_while_collecting_reaches_the_worker() -> None:
    async def body() -> None:
        worker = EchoWorker(step_delay=0.01)
        srv = await serve("tcp://127.0.0.1:0", worker)
        conn = await connect(srv.address)
        st = _submit(conn, 10_000)
        task = asyncio.ensure_future(st.collect())
        while not worker.active:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.03)
        task.cancel()
        st.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert st.done
        for _ in range(200):
            if worker.cancelled:
                break
            await asyncio.sleep(0.005)
        assert len(worker.cancelled) == 1
        await conn.close()
        await srv.close()

    run("asyncio", body)


def test_connection_loss_ends_a_collecting_stream() -> None:
    async def body() -> None:
        worker = EchoWorker(step_delay=0.01)
        srv = await serve("tcp://127.0.0.1:0", worker)
        conn = await connect(srv.address)
        st = _submit(conn, 10_000)
        fut = st.collect()
        while not worker.active:
            await asyncio.sleep(0.005)
        await srv.close()
        res = await asyncio.wait_for(fut, 10)
        assert isinstance(res.final, Error) and res.final.code == ErrorCode.CONNECTION_LOST
        assert res.text == _text(res.tokens)
        await conn.close()

    run("asyncio", body)


def test_finish_reason_passes_through() -> None:
    async def body() -> None:
        worker = EchoWorker()
        srv = await serve("tcp://127.0.0.1:0", worker)
        conn = await connect(srv.address)
        res = await _submit(conn, 3).collect()
        assert isinstance(res.final, Finish) and res.final.reason == FinishReason.LENGTH
        assert res.final.prompt_tokens == 3 and res.text == b"t0t1t2"
        await conn.close()
        await srv.close()

    run("asyncio", body)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_listen_pushes_every_delta_in_order_and_grants_credit(loop_kind: str) -> None:
    async def body() -> None:
        worker = EchoWorker()
        srv = await serve("tcp://127.0.0.1:0", worker)
        conn = await connect(srv.address, initial_credit=4)
        st = _submit(conn, 50)
        got: list[bytes] = []
        first = await st.next_events()  # the usual start: first event through next_events
        got += [e.text for e in first]  # type: ignore[union-attr]
        fin = await st.listen(lambda t: got.append(t) is None)
        assert isinstance(fin, Finish) and fin.completion_tokens == 50
        assert b"".join(got) == _text(50)
        with pytest.raises(RuntimeError):
            st.listen(lambda t: True)
        await conn.close()
        await srv.close()

    run(loop_kind, body)


def test_listen_backpressure_resumes_without_loss() -> None:
    """on_text says "stop" every 5th delta; the consumer re-listens; nothing is lost or reordered."""

    async def body() -> None:
        worker = EchoWorker(step_delay=0.001)
        srv = await serve("tcp://127.0.0.1:0", worker)
        conn = await connect(srv.address, initial_credit=4)
        st = _submit(conn, 60)
        got: list[bytes] = []
        stops = 0

        def on_text(t: bytes) -> bool:
            got.append(t)
            return len(got) % 5 != 0

        while True:
            fin = await st.listen(on_text)
            if fin is not None:
                break
            stops += 1
            await asyncio.sleep(0.003)  # a slow client: more deltas buffer meanwhile
        assert stops >= 5 and b"".join(got) == _text(60)
        await conn.close()
        await srv.close()

    run("asyncio", body)


def test_listen_callback_error_reaches_the_consumer_not_the_connection() -> None:
    async def body() -> None:
        worker = EchoWorker(step_delay=0.001)
        srv = await serve("tcp://127.0.0.1:0", worker)
        conn = await connect(srv.address)
        bad = _submit(conn, 50)
        good = _submit(conn, 20)

        def boom(t: bytes) -> bool:
            raise KeyError("consumer bug")

        fut = bad.listen(boom)
        with pytest.raises(KeyError):
            await fut
        bad.cancel()
        res = await good.collect()  # the connection carries on
        assert res.text == _text(20) and not conn.closed
        lp = _submit(conn, 3, logprobs=True)
        with pytest.raises(ValueError, match="logprobs"):
            lp.listen(lambda t: True)
        lp.cancel()
        await conn.close()
        await srv.close()

    run("asyncio", body)
