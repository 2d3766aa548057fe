"""Admission in the pipeline, over the real HTTP listener with real clients (httpx over HTTP/1.1 and
HTTP/2, the openai SDK): API keys, per-key models, rate limits with OpenAI's headers, load shedding,
and compiled schema validation; the ScriptedWorkerConnection double stands in for the worker."""

from __future__ import annotations

import asyncio
import logging
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import httpx
import openai
import pytest

from gateway.admission.config import AdmissionSettings
from gateway.admission.keys import hash_key
from tests.gateway.doubles import ScriptedWorkerConnection
from tests.integration.app_gateway import AppGateway, app_gateway
from transport.messages import Finish, FinishReason

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
GOOD, OTHER = "sk-good-0123456789", "sk-other-9876543210"


def _gateway(settings: AdmissionSettings, conn: ScriptedWorkerConnection | None = None
             ) -> AbstractAsyncContextManager[AppGateway]:
    return app_gateway(conn or ScriptedWorkerConnection(models=("tiny", "big")), admission=settings)


def _keyfile(path: Path, *entries: str) -> Path:
    path.write_text("".join(entries))
    return path


def _entry(kid: str, key: str, models: str = '["tiny", "big"]') -> str:
    return f'[[keys]]\nid = "{kid}"\nsha256 = "{hash_key(key)}"\nmodels = {models}\n\n'


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
async def test_keys_missing_bad_restricted_revoked_and_reloaded(tmp_path: Path, http2: bool,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    kf = _keyfile(tmp_path / "keys.toml", _entry("alice", GOOD), _entry("bob", OTHER, '["tiny"]'))
    async with _gateway(AdmissionSettings(keys_file=str(kf), queue_limit=1000)) as gw:
        async with httpx.AsyncClient(base_url=gw.url, http1=not http2, http2=http2) as c:
            async def chat(key: str | None, model: str = "tiny") -> httpx.Response:
                headers = {"authorization": f"Bearer {key}"} if key else {}
                return await c.post("/v1/chat/completions", json={**CHAT, "model": model}, headers=headers)

            r = await chat(None)
            assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key" or \
                r.json()["error"]["type"] == "invalid_request_error"
            r = await chat("sk-wrong")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert (await chat(GOOD)).status_code == 200
            assert (await chat(OTHER)).status_code == 200
            r = await chat(OTHER, "big")
            assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_allowed"
            assert (await chat(GOOD, "big")).status_code == 200
            _keyfile(kf, _entry("alice", GOOD))  # bob revoked
            assert gw.app.generations.admission is not None
            gw.app.generations.admission.admission.reload_keys()  # what SIGHUP does
            assert (await chat(OTHER)).status_code == 401
            assert (await chat(GOOD)).status_code == 200
            assert (await c.get("/healthz")).status_code == 200  # health needs no key
        text = (await httpx.AsyncClient().get(gw.url + "/metrics")).text
    assert len(gw.conn.submits) == 4  # refused requests never reached the worker
    for secret in (GOOD, OTHER, hash_key(GOOD), hash_key(OTHER)):  # never logged, never a metric label
        assert secret not in caplog.text and secret not in text


async def test_rate_limit_429_with_openai_headers_then_recovers() -> None:
    s = AdmissionSettings(limits=["client requests 3/1s"], queue_limit=1000)
    async with _gateway(s) as gw:
        async with httpx.AsyncClient(base_url=gw.url) as c:
            ok = [await c.post("/v1/chat/completions", json=CHAT) for _ in range(3)]
            assert [r.status_code for r in ok] == [200] * 3
            assert ok[0].headers["x-ratelimit-limit-requests"] == "3"
            assert [r.headers["x-ratelimit-remaining-requests"] for r in ok] == ["2", "1", "0"]
            r = await c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
            assert int(r.headers["retry-after"]) >= 1 and r.headers["x-ratelimit-remaining-requests"] == "0"
            await asyncio.sleep(1.05)
            assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert len(gw.conn.submits) == 4


async def test_shedding_refuses_at_once_while_admitted_requests_finish() -> None:
    conn = ScriptedWorkerConnection(models=("tiny",), hang_after=1)  # a saturated worker: nothing finishes
    async with _gateway(AdmissionSettings(queue_limit=4, priority_classes=1), conn) as gw:
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
            held = [asyncio.create_task(c.post("/v1/chat/completions", json={**CHAT, "stream": True}))
                    for _ in range(4)]
            for _ in range(100):
                if len(conn.submits) == 4:
                    break
                await asyncio.sleep(0.01)
            t0 = asyncio.get_running_loop().time()
            r = await c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
            assert r.headers["retry-after"] and asyncio.get_running_loop().time() - t0 < 0.5
            assert len(conn.submits) == 4
            for rid in list(conn.streams):  # the worker catches up: the admitted ones finish
                conn.streams[rid].put([Finish(rid, FinishReason.STOP, 7, 1)])
            done = await asyncio.gather(*held)
            assert all(r.status_code == 200 and r.text.endswith("data: [DONE]\n\n") for r in done)
            conn.hang_after = None
            assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200  # room again
        assert gw.app.metrics.in_flight == 0


async def test_schema_errors_name_the_path_and_keyword_and_sdk_sees_400() -> None:
    async with _gateway(AdmissionSettings(queue_limit=1000)) as gw:
        async with httpx.AsyncClient(base_url=gw.url) as c:
            r = await c.post("/v1/chat/completions", json={**CHAT, "temperature": "hot"})
            err = r.json()["error"]
            assert r.status_code == 400 and "temperature" in (err["param"] or "") + err["message"]
            r = await c.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": 5}]})
            err = r.json()["error"]
            assert r.status_code == 400 and "messages" in (err["param"] or "") + err["message"]
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=-1)
        ok = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=3)
        assert ok.choices[0].message.content == "abc"
        await client.close()
