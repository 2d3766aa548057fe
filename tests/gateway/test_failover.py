"""Mid-stream failover in the gateway (#30), sans sockets: a replica lost after the first token and
the request resumes on another from what the client has (``Submit.continuation``); the client
sees one stream with one end, in every way a call reads its stream. What is not resumed: a client
that went away, a deadline, an error that would repeat, a replica that cannot resume, no retry left.

The double: every replica writes token ``i`` of a request as ``ALPHABET[i]`` (so a resumed request
that went on from the wrong place shows in its text), and a replica "dies" -- it closes, and every
open stream of it ends with CONNECTION_LOST -- once a stream of it has ``lose_after`` tokens."""

from __future__ import annotations

import asyncio
from array import array
from dataclasses import dataclass, field

import pytest

from gateway.api.config import ApiSettings
from gateway.app import App
from gateway.routing.pool import ModelPool
from transport.api import Received
from transport.errors import ConnectionClosed
from transport.messages import Error, ErrorCode, Finish, FinishReason, Hello, Stats, Submit, TokenEntry

from .doubles import RecordingSink, ScriptedStream, ScriptedWorkerConnection, sse_events
from .test_app import call, req

ALPHABET = b"abcdefghijklmnopqrstuvwxyz"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@dataclass(eq=False)
class Replica(ScriptedWorkerConnection):
    lose_after: int | None = None  # dies once one of its streams has this many tokens
    error_after: tuple[int, ErrorCode] | None = None  # or ends that stream with this error
    resumes: bool = True  # lists the "continuation" capability
    got: dict[int, list[int]] = field(default_factory=dict)  # tokens each stream received

    def __post_init__(self) -> None:
        super().__post_init__()
        self.peer_hello = Hello(role="worker", identity=f"replica-{id(self):x}", models=self.models,
                                capabilities=("continuation",) if self.resumes else ())

    def received(self, rid: int, mark: int) -> Received | None:
        ids = self.got.get(rid, [])
        return Received(array("I", ids), len(ids)) if self.closed or self.error_after else None

    def submit(self, submit: Submit) -> ScriptedStream:
        if self.closed:
            raise ConnectionClosed("closed")
        self.submits.append(submit)
        rid = submit.request_id
        s = self.streams[rid] = ScriptedStream(self, rid)
        self._open.add(rid)
        self.got[rid] = []
        cont = submit.continuation
        start = len(cont.token_ids) if cont is not None else 0
        if cont is not None:  # what the client has: exactly the tokens before
            assert bytes(cont.token_ids) == ALPHABET[:start] and cont.text_bytes == start
        steps: list[object] = []
        for i in range(start, submit.params.max_tokens + 1):
            if i == submit.params.max_tokens:
                steps.append(Finish(rid, FinishReason.LENGTH, self.prompt_tokens, i))
                break
            if self.lose_after is not None and i - start >= self.lose_after:
                steps.append("die")
                break
            if self.hang_after is not None and i - start >= self.hang_after:
                break  # no end: the stream stays open
            if self.error_after is not None and i - start >= self.error_after[0]:
                steps.append(Error(rid, self.error_after[1], "scripted"))
                break
            steps.append(i)
        asyncio.get_running_loop().call_soon(self._run, s, steps, submit.params.logprobs)
        return s

    def _run(self, s: ScriptedStream, steps: list[object], logprobs: bool) -> None:
        if not steps or s._final_queued or self.closed:
            return
        step, rest = steps[0], steps[1:]
        if step == "die":
            self.closed = True
            for rid in list(self._open):
                self.streams[rid].put([Error(rid, ErrorCode.CONNECTION_LOST, "worker died")])
            return
        if isinstance(step, int):
            tok = ALPHABET[step]
            self.got[s.request_id].append(tok)
            lp = memoryview(array("f", [-0.5])) if logprobs else None
            s.put([TokenEntry(s.request_id, memoryview(array("I", [tok])), bytes([tok]), lp, None, None)])
        else:
            s.put([step])
        asyncio.get_running_loop().call_soon(self._run, s, rest, logprobs)


def app_of(*replicas: Replica, retries: int = 1) -> App:
    pool = ModelPool(retries=retries)
    for i, r in enumerate(replicas):  # the first looks idlest: the policy picks it first
        r.latest_stats = Stats(queue_depth=0, running=i, kv_blocks_free=1, kv_blocks_total=1)
        pool.add(r)
    return App(pool)


def text_of(events: list[object]) -> str:
    out = ""
    for ev in events:
        if isinstance(ev, dict) and ev.get("choices"):
            out += ev["choices"][0]["delta"].get("content") or ""
    return out


@pytest.mark.parametrize("body", [{"stream": True}, {"stream": True, "logprobs": True, "top_logprobs": 0},
                                  {"stream": True, "stream_options": {"include_usage": True}}],
                         ids=["push", "pull (logprobs)", "with usage"])
async def test_a_stream_whose_replica_dies_goes_on_from_another(body: dict[str, object]) -> None:
    a, b = Replica(lose_after=3), Replica()
    app = app_of(a, b)
    s = await call(app, req("/v1/chat/completions", {**CHAT, **body}), RecordingSink())
    ev = sse_events(s.body)
    assert s.status == 200 and s.ended
    assert text_of(ev) == "abcdefgh"  # one stream: nothing twice, nothing missing
    assert ev[-1] == "[DONE]" and ev.count("[DONE]") == 1 and not any("error" in e for e in ev if isinstance(e, dict))
    assert [x.continuation for x in a.submits] == [None]
    (resumed,) = b.submits
    assert resumed.continuation is not None and bytes(resumed.continuation.token_ids) == b"abc"
    if "stream_options" in body:
        assert ev[-2]["usage"]["completion_tokens"] == 8  # type: ignore[index]
    assert app.pool.budget.failovers == 1


@pytest.mark.parametrize("code", [ErrorCode.SHUTTING_DOWN, ErrorCode.INTERNAL], ids=["drained", "failed step"])
async def test_a_stream_its_live_replica_gives_up_on_goes_on_from_another(code: ErrorCode) -> None:
    """The replica lives on but ends the stream: drained (its drain timed out) or a failed engine
    step (budgeted like a retry)."""
    a, b = Replica(error_after=(4, code)), Replica()
    app = app_of(a, b)
    s = await call(app, req("/v1/chat/completions", {**CHAT, "stream": True}), RecordingSink())
    ev = sse_events(s.body)
    assert text_of(ev) == "abcdefgh" and ev[-1] == "[DONE]"
    assert bytes(b.submits[0].continuation.token_ids) == b"abcd"  # type: ignore[union-attr]
    assert app.pool.budget.failovers == 1 and app.pool.budget.in_flight == 0  # its budget token given back


async def test_a_whole_response_starts_over_on_another_replica() -> None:
    """Nothing was sent to the client: the request runs again elsewhere, from its prompt."""
    a, b = Replica(lose_after=3), Replica()
    app = app_of(a, b)
    s = await call(app, req("/v1/chat/completions", CHAT), RecordingSink())
    assert s.status == 200 and s.json()["choices"][0]["message"]["content"] == "abcdefgh"  # type: ignore[index]
    assert s.json()["usage"]["completion_tokens"] == 8  # type: ignore[index]
    assert b.submits[0].continuation is None and app.pool.budget.failovers == 0


async def test_it_fails_over_again_within_its_retries_and_joins_what_each_sent() -> None:
    a, b, c = Replica(lose_after=2), Replica(lose_after=3), Replica()
    app = app_of(a, b, c, retries=2)
    s = await call(app, req("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 8, "stream": True}),
                   RecordingSink())
    ev = sse_events(s.body)
    assert "".join(e["choices"][0]["text"] for e in ev if isinstance(e, dict) and e.get("choices")) == "abcdefgh"
    assert bytes(c.submits[0].continuation.token_ids) == b"abcde"  # type: ignore[union-attr]
    assert app.pool.budget.failovers == 2


@pytest.mark.parametrize("case", ["no retry left", "no replica that resumes", "no other replica",
                                  "an error that would repeat"])
async def test_otherwise_the_stream_ends_with_its_error_as_before(case: str) -> None:
    a = Replica(lose_after=3) if case != "an error that would repeat" else Replica(
        error_after=(3, ErrorCode.INVALID_REQUEST))
    others = {"no retry left": [Replica()], "no replica that resumes": [Replica(resumes=False)],
              "no other replica": [], "an error that would repeat": [Replica()]}[case]
    app = app_of(a, *others, retries=0 if case == "no retry left" else 1)
    s = await call(app, req("/v1/chat/completions", {**CHAT, "stream": True}), RecordingSink())
    ev = sse_events(s.body)
    assert text_of(ev) == "abc" and "error" in ev[-1] and "[DONE]" not in ev  # type: ignore[operator]
    assert all(not o.submits for o in others)  # nothing resumed (the older worker never asked)
    assert app.pool.budget.failovers == 0


async def test_a_client_that_went_away_or_a_deadline_is_not_resumed() -> None:
    a, b = Replica(lose_after=50), Replica()
    app = app_of(a, b)
    done: list[int] = []
    c = app.handle(req("/v1/chat/completions", {**CHAT, "max_tokens": 100, "stream": True}), RecordingSink(),
                   lambda: done.append(1))
    for _ in range(10):
        await asyncio.sleep(0)
    assert c.cancel()  # what the adapter does when the client goes away
    for _ in range(80):
        await asyncio.sleep(0)
    assert done == [1] and a.cancels == [1] and not b.submits
    a, b = Replica(hang_after=2), Replica()  # hangs: the deadline ends it, not a failover
    app = app_of(a, b)
    app = App(app.pool, api=ApiSettings(request_timeout=0.05))
    s = await call(app, req("/v1/chat/completions", {**CHAT, "stream": True}), RecordingSink())
    assert sse_events(s.body)[-1]["error"]["code"] == "timeout"  # type: ignore[index]
    assert not b.submits and app.pool.budget.failovers == 0


async def test_a_client_that_reads_slowly_gets_every_token_once() -> None:
    """The lost stream's tokens wait for the client (held, then buffered in the old stream) and are
    written before the resumed stream's."""
    a, b = Replica(lose_after=6), Replica()
    app = app_of(a, b)
    sink = RecordingSink(block_after_chunks=3)
    done: list[int] = []
    app.handle(req("/v1/chat/completions", {**CHAT, "stream": True, "max_tokens": 12}), sink, lambda: done.append(1))
    await sink.blocked.wait()
    for _ in range(30):  # the replica dies while the client is not reading
        await asyncio.sleep(0)
    assert a.closed
    sink.unblock()
    for _ in range(100):
        await asyncio.sleep(0)
    assert done == [1]
    ev = sse_events(sink.body)
    assert text_of(ev) == "abcdefghijkl" and ev[-1] == "[DONE]"
    assert bytes(b.submits[0].continuation.token_ids) == b"abcdef"  # type: ignore[union-attr]
