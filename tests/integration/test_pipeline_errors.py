"""One failure, one rendering: the same error reaches an HTTP/1.1 and an HTTP/2 client the same way,
streaming or not (the one pipeline and its one error model; real listener, real httpx clients, the
ScriptedWorkerConnection double as the worker).

Before a response starts an error is a whole JSON response (status, OpenAI error body,
``retry-after`` where the error has one); once a stream has started it is the stream's terminal SSE
event, carrying the status it would have had.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx
import orjson
import pytest

from gateway.app import App
from gateway.http.server import HttpLimits, start_server
from gateway.routing.pool import ModelPool
from gateway.settings import ApiSettings
from tests.gateway.doubles import ScriptedWorkerConnection, sse_events
from transport.messages import ErrorCode

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}


@dataclass(frozen=True)
class Case:
    """A failure: how to provoke it, and what the client must see."""

    conn: Callable[[], ScriptedWorkerConnection | None]  # None: no worker at all
    body: bytes
    status: int
    code: str
    retry_after: bytes | None = None
    timeout: float = 600.0
    mid_stream: bool = False  # streaming: the error comes after tokens, as an SSE event


def _chat(**kw: object) -> bytes:
    return orjson.dumps({**CHAT, **kw})


def _closed() -> ScriptedWorkerConnection:
    c = ScriptedWorkerConnection()
    c.closed = True
    return c


CASES = {
    "bad-json": Case(ScriptedWorkerConnection, b'{"model": "tiny", "messages": [', 400, "invalid_json"),
    "unknown-model": Case(ScriptedWorkerConnection, _chat(model="gpt-9"), 404, "model_not_found"),
    "no-worker": Case(_closed, _chat(), 503, "no_worker_available", b"1"),
    "overloaded": Case(lambda: ScriptedWorkerConnection(fail_before_first=ErrorCode.OVERLOADED), _chat(), 503,
                       "overloaded", b"1"),
    "deadline-before-first-token": Case(lambda: ScriptedWorkerConnection(hang_after=0), _chat(), 504, "timeout",
                                        timeout=0.1),
    "deadline-mid-stream": Case(lambda: ScriptedWorkerConnection(hang_after=2), _chat(), 504, "timeout",
                                timeout=0.1, mid_stream=True),
    "worker-error-mid-stream": Case(lambda: ScriptedWorkerConnection(fail_after=2), _chat(), 500, "internal_error",
                                    mid_stream=True),
    "body-too-large": Case(ScriptedWorkerConnection, _chat(pad="x" * 8192), 413, "request_too_large"),
}


@dataclass(frozen=True)
class Seen:
    """What a client saw of one failure, in protocol-neutral terms."""

    status: int
    code: str
    type: str
    retry_after: bytes | None
    streamed: bool


async def _serve(case: Case) -> AsyncIterator[str]:
    pool = ModelPool(retries=1)
    conn = case.conn()
    if conn is not None:
        pool.add(conn)
    app = App(pool, api=ApiSettings(request_timeout=case.timeout))
    server = await start_server(app.handle, host="127.0.0.1", port=0, limits=HttpLimits(max_body_bytes=4096),
                                on_event=app.on_http_event)
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        await server.close()


async def _see(base: str, http2: bool, case: Case, stream: bool) -> Seen:
    body = case.body
    if stream and body.startswith(b'{"model":"tiny"') and case.code != "request_too_large":
        body = body[:-1] + b',"stream":true}'
    async with httpx.AsyncClient(http1=not http2, http2=http2, base_url=base, timeout=10) as client:
        r = await client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            events = sse_events(r.content)
            err = events[-1]["error"]  # type: ignore[index]
            assert "[DONE]" not in events
            return Seen(err["status"], err["code"], err["type"], None, True)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        return Seen(r.status_code, err["code"], err["type"], r.headers.get("retry-after", "").encode() or None,
                    False)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("name", list(CASES))
async def test_one_failure_one_rendering_on_h1_and_h2(name: str, stream: bool) -> None:
    case = CASES[name]
    seen = []
    for http2 in (False, True):
        async for base in _serve(case):
            seen.append(await _see(base, http2, case, stream))
    h1, h2 = seen
    assert h1 == h2, f"{name}: HTTP/1.1 saw {h1}, HTTP/2 saw {h2}"
    assert (h1.status, h1.code, h1.retry_after) == (case.status, case.code, case.retry_after)
    assert h1.type == ("server_error" if case.status >= 500 else "invalid_request_error")
    assert h1.streamed == (stream and case.mid_stream)
