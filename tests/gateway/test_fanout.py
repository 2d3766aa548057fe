"""Requests of several sequences (gateway.api.fanout) through the app, against scripted workers:
one response whatever happens to its sequences -- every choice indexed, one [DONE], usage over all,
one error when any fails, every worker request cancelled when the client goes away."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.api.fan_merge import sub_seed
from transport.messages import ErrorCode

from .doubles import RecordingSink, ScriptedWorkerConnection, sse_events
from .test_app import CHAT, call, make_app, req

COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 5}


async def test_whole_n_is_one_response_on_one_replica_with_distinct_seeds() -> None:
    a, b = ScriptedWorkerConnection(), ScriptedWorkerConnection()
    app = make_app(a, b)
    s = await call(app, req("/v1/completions", {**COMPLETION, "n": 3, "seed": 42}), RecordingSink())
    body: Any = s.json()
    assert s.status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["text"] == "abcde" and c["finish_reason"] == "length" for c in body["choices"])
    assert body["usage"]["prompt_tokens"] == 7 and body["usage"]["completion_tokens"] == 15
    submits = a.submits or b.submits
    assert len(submits) == 3 and not (a.submits and b.submits)  # pinned to one replica
    assert [x.params.seed for x in submits] == [42, sub_seed(42, 1), sub_seed(42, 2)]
    assert len({x.params.seed for x in submits}) == 3


async def test_streamed_n_interleaves_indexed_chunks_and_ends_once() -> None:
    app = make_app(ScriptedWorkerConnection())
    s = await call(app, req("/v1/chat/completions", {**CHAT, "n": 2, "stream": True,
                                                    "stream_options": {"include_usage": True}}), RecordingSink())
    events = sse_events(s.body)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks: list[Any] = events[:-1]
    assert len({c["id"] for c in chunks}) == 1
    text = {0: "", 1: ""}
    reasons = {}
    for c in chunks:
        for ch in c["choices"]:
            text[ch["index"]] += ch["delta"].get("content") or ""
            if ch["finish_reason"]:
                reasons[ch["index"]] = ch["finish_reason"]
    assert text == {0: "abcde", 1: "abcde"} and reasons == {0: "length", 1: "length"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10
    assert all(c["usage"] is None for c in chunks[:-1])  # as every chunk of a stream with include_usage
    assert chunks[-1]["usage"]["prompt_tokens"] == 7


async def test_batched_prompts_run_prompt_by_prompt() -> None:
    conn = ScriptedWorkerConnection()
    app = make_app(conn)
    s = await call(app, req("/v1/completions", {**COMPLETION, "prompt": ["x", "y"], "n": 2}), RecordingSink())
    body: Any = s.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [x.prompt for x in conn.submits] == ["x", "x", "y", "y"]
    assert body["usage"]["prompt_tokens"] == 14 and body["usage"]["completion_tokens"] == 20


async def test_best_of_asks_for_logprobs_and_bills_every_sequence() -> None:
    conn = ScriptedWorkerConnection()
    app = make_app(conn)
    s = await call(app, req("/v1/completions", {**COMPLETION, "best_of": 3}), RecordingSink())
    body: Any = s.json()
    assert len(body["choices"]) == 1 and body["choices"][0]["logprobs"] is None
    assert body["usage"]["completion_tokens"] == 15
    assert all(x.params.logprobs for x in conn.submits) and len(conn.submits) == 3


@pytest.mark.parametrize("stream", [False, True])
async def test_one_failed_sequence_ends_the_request_with_one_error(stream: bool) -> None:
    conn = ScriptedWorkerConnection(fail_after=2)
    app = make_app(conn)
    body = {**COMPLETION, "n": 3, "stream": stream}
    s = await call(app, req("/v1/completions", body), RecordingSink())
    if stream:
        events: list[Any] = sse_events(s.body)
        assert "[DONE]" not in events
        assert [e for e in events if "error" in e] == [events[-1]]  # one error, the last event
    else:
        assert s.status == 500 and "error" in s.json()  # type: ignore[operator]
    assert app.metrics.in_flight == 0


async def test_a_refused_sequence_before_the_first_token_is_one_error() -> None:
    conn = ScriptedWorkerConnection(fail_before_first=ErrorCode.INVALID_REQUEST)
    app = make_app(conn)
    s = await call(app, req("/v1/completions", {**COMPLETION, "n": 4, "stream": True}), RecordingSink())
    assert s.status == 400 and not s.streamed


async def test_the_client_going_away_cancels_every_sequence() -> None:
    conn = ScriptedWorkerConnection(hang_after=1)
    app = make_app(conn)
    sink = RecordingSink()
    done: list[int] = []
    c = app.handle(req("/v1/completions", {**COMPLETION, "n": 3, "stream": True}), sink, lambda: done.append(1))
    for _ in range(5):
        await asyncio.sleep(0)
    assert c.cancel()
    await asyncio.sleep(0)
    assert sorted(conn.cancels) == [x.request_id for x in conn.submits] and len(conn.submits) == 3
    assert done == [1] and app.metrics.in_flight == 0 and not c.cancel()


async def test_a_slow_client_gets_every_chunk_in_order_per_choice() -> None:
    app = make_app(ScriptedWorkerConnection())
    sink = RecordingSink(block_after_chunks=2)
    task = asyncio.ensure_future(call(app, req("/v1/completions", {**COMPLETION, "n": 3, "stream": True}), sink))
    await sink.blocked.wait()
    await asyncio.sleep(0.01)
    sink.unblock()
    s = await task
    events: list[Any] = sse_events(s.body)
    assert events[-1] == "[DONE]"
    text = {0: "", 1: "", 2: ""}
    for e in events[:-1]:
        for ch in e["choices"]:
            text[ch["index"]] += ch["text"]
    assert text == {0: "abcde", 1: "abcde", 2: "abcde"}


def test_admission_sees_the_whole_request() -> None:
    """Every prompt once and every sequence's max_tokens: what the token limits take (and settle by use)."""
    from gateway.api.params import parse_completion

    g = parse_completion({**COMPLETION, "prompt": ["abcd", "abcdefgh"], "n": 3}, default_max_tokens=16,
                         max_tokens_limit=100)
    assert g.fan is not None and g.params.max_tokens == 5 * 6 and g.prompt_estimate() == 2 + 3  # (4 bytes a token, + 1)
    one = parse_completion(COMPLETION, default_max_tokens=16, max_tokens_limit=100)
    assert one.fan is None and one.params.max_tokens == 5


async def test_streamed_logprobs_name_their_choice() -> None:
    app = make_app(ScriptedWorkerConnection())
    s = await call(app, req("/v1/chat/completions", {**CHAT, "n": 2, "stream": True, "logprobs": True}),
                   RecordingSink())
    events: list[Any] = sse_events(s.body)
    got: dict[int, int] = {}
    for e in events[:-1]:
        for ch in e["choices"]:
            if ch["logprobs"]:
                got[ch["index"]] = got.get(ch["index"], 0) + len(ch["logprobs"]["content"])
    assert got == {0: 5, 1: 5} and events[-1] == "[DONE]"


@pytest.mark.parametrize("stream", [False, True])
async def test_the_deadline_ends_every_sequence_once(stream: bool) -> None:
    from gateway.api.config import ApiSettings

    conn = ScriptedWorkerConnection(hang_after=1)
    app = make_app(conn, api=ApiSettings(request_timeout=0.05))
    s = await call(app, req("/v1/completions", {**COMPLETION, "n": 3, "stream": stream}), RecordingSink())
    if stream:
        events: list[Any] = sse_events(s.body)
        assert [e["error"]["code"] for e in events if "error" in e] == ["timeout"] and "[DONE]" not in events
    else:
        assert s.status == 504
    assert sorted(conn.cancels) == sorted(x.request_id for x in conn.submits)


async def test_a_client_that_stops_reading_is_cut_off_once() -> None:
    from gateway.api.config import ApiSettings

    conn = ScriptedWorkerConnection()
    app = make_app(conn, api=ApiSettings(write_timeout=0.05))
    ends: list[int] = []
    inner = app.generations._on_call_end

    def hook(c: Any, status: int, tokens: int) -> None:
        ends.append(status)
        inner(c, status, tokens)

    app.generations._on_call_end = hook
    sink = RecordingSink(block_after_chunks=2)  # and never reads again
    await call(app, req("/v1/completions", {**COMPLETION, "n": 3, "stream": True}), sink)
    assert sink.aborted and ends == [408]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n", [2, 5])
@pytest.mark.parametrize("fault", [None, ("fail_after", 0), ("fail_after", 3), ("hang_after", 2),
                                   ("fail_before_first", ErrorCode.OVERLOADED),
                                   ("fail_before_first", ErrorCode.INTERNAL)])
async def test_every_fault_ends_the_request_once(stream: bool, n: int, fault: tuple[str, object] | None) -> None:
    """Whatever its sequences do, the request ends once (the helper checks done() and in_flight), with
    one answer: every choice and [DONE], or one error and nothing after it; no worker request stays open."""
    from gateway.api.config import ApiSettings

    conn = ScriptedWorkerConnection(**({fault[0]: fault[1]} if fault else {}))  # type: ignore[arg-type]
    app = make_app(conn, api=ApiSettings(request_timeout=0.2))
    s = await call(app, req("/v1/completions", {**COMPLETION, "n": n, "stream": stream}), RecordingSink())
    if s.streamed:
        events: list[Any] = sse_events(s.body)
        errors = [e for e in events if e != "[DONE]" and "error" in e]
        if fault is None:
            assert events[-1] == "[DONE]" and not errors
        else:
            assert errors == [events[-1]] and "[DONE]" not in events
    else:
        body: Any = s.json()
        assert (s.status == 200) == (fault is None)
        assert len(body["choices"]) == n if fault is None else set(body) == {"error"}
    assert conn.in_flight == 0  # every worker request finished or was cancelled
