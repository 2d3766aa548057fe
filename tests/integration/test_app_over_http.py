"""The app behind the real HTTP listeners (h1, h2c, TLS h2) on 127.0.0.1, real clients,
with the ScriptedWorkerConnection double in place of a worker (no transport).

The end-to-end twin with a real worker process is test_gateway_e2e.py.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import orjson
import pytest

from gateway.http.server import HttpLimits
from tests.integration.app_gateway import AppGateway, app_gateway


@pytest.fixture
async def gw(tmp_path: Path) -> AsyncIterator[AppGateway]:
    async with app_gateway(limits=HttpLimits(max_body_bytes=4096, max_header_bytes=2048), tls_dir=tmp_path) as g:
        yield g


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}


async def test_openai_async_sdk(gw: AppGateway) -> None:
    client = openai.AsyncOpenAI(base_url=gw.http + "/v1", api_key="x", max_retries=0)
    r = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=6, seed=1, temperature=0.5)
    assert r.choices[0].message.content == "abcdef" and r.usage.completion_tokens == 6
    stream = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=6, stream=True,
                                                  stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "abcdef"
    assert chunks[-1].usage.total_tokens == 13
    c = await client.completions.create(model="tiny", prompt="x", max_tokens=3)
    assert c.choices[0].text == "abc" and c.choices[0].finish_reason == "length"
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    two = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2,
                                               max_tokens=3)
    assert [ch.index for ch in two.choices] == [0, 1] and two.usage.completion_tokens == 6
    with pytest.raises(openai.BadRequestError) as ei:
        await client.completions.create(model="tiny", prompt="x", suffix="y")
    assert "not supported" in ei.value.message
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    await client.close()


async def test_openai_sync_sdk(gw: AppGateway) -> None:
    def run() -> tuple[str, str]:
        with openai.OpenAI(base_url=gw.http + "/v1", api_key="x", max_retries=0) as client:
            r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4)
            s = client.completions.create(model="tiny", prompt="x", max_tokens=5, stream=True)
            return r.choices[0].message.content or "", "".join(c.choices[0].text for c in s)

    assert await asyncio.to_thread(run) == ("abcd", "abcde")


@pytest.mark.parametrize("proto", ["h1", "h2c", "tls-h1", "tls-h2"])
async def test_httpx_protocols(gw: AppGateway, proto: str) -> None:
    base = gw.https if proto.startswith("tls") else gw.http
    h2 = proto.endswith("h2") or proto == "h2c"
    async with httpx.AsyncClient(base_url=base, http1=not h2, http2=h2, verify=False) as c:
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.http_version == ("HTTP/2" if h2 else "HTTP/1.1")
        assert r.json()["choices"][0]["message"]["content"] == "abcdef"
        async with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as s:
            body = b"".join([chunk async for chunk in s.aiter_bytes()])
        assert body.endswith(b"data: [DONE]\n\n") and body.count(b"chat.completion.chunk") == 8
    text = gw.app.metrics.render().decode()
    label = "h2" if h2 else "http/1.1"
    assert (f'quicserve_requests_total{{model="tiny",protocol="{label}",route="/v1/chat/completions",status="200"}} 2.0'
            in text)


@pytest.mark.parametrize("h2", [False, True])
async def test_client_disconnect_mid_stream_sends_cancel(gw: AppGateway, h2: bool) -> None:
    gw.conn.hang_after = 2
    async with httpx.AsyncClient(base_url=gw.http, http1=not h2, http2=h2) as c:
        async with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as s:
            async for chunk in s.aiter_bytes():
                if b'"content":"b"' in chunk:
                    break
    for _ in range(200):
        if gw.conn.cancels:
            break
        await asyncio.sleep(0.01)
    assert gw.conn.cancels == [1]
    gw.conn.hang_after = None
    async with httpx.AsyncClient(base_url=gw.http) as c:  # still serving
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200


@pytest.mark.parametrize(
    "method, path, body, headers, status, code",
    [
        ("POST", "/v1/chat/completions", b"{not json", {}, 400, "invalid_json"),
        ("POST", "/v1/chat/completions", b'{"model":"tiny","messages":"\xff"}', {}, 400, "invalid_utf8"),
        ("POST", "/v1/chat/completions", orjson.dumps({**CHAT, "max_tokens": "9"}), {}, 400, "invalid_type"),
        ("POST", "/v1/chat/completions", orjson.dumps({**CHAT, "model": "gpt-x"}), {}, 404, "model_not_found"),
        ("GET", "/v2/nothing", b"", {}, 404, "unknown_url"),
        ("DELETE", "/v1/models", b"", {}, 405, "method_not_allowed"),
        ("POST", "/v1/chat/completions", b"x" * 5000, {}, 413, None),
        ("GET", "/healthz", b"", {"x-big": "y" * 3000}, 431, None),
    ],
)
async def test_bad_input_then_next_request(gw: AppGateway, method: str, path: str, body: bytes,
                                           headers: dict[str, str], status: int, code: str | None) -> None:
    async with httpx.AsyncClient(base_url=gw.http) as c:
        r = await c.request(method, path, content=body, headers=headers)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["message"] and "type" in err
        if code:
            assert err["code"] == code
    async with httpx.AsyncClient(base_url=gw.http) as c:
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "abcdef"


async def test_tls_alpn_offers_h2(gw: AppGateway) -> None:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    port = int(gw.https.rsplit(":", 1)[1])
    _, w = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
    assert w.get_extra_info("ssl_object").selected_alpn_protocol() == "h2"
    w.close()
