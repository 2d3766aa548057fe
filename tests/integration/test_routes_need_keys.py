"""With API keys required, every route but /healthz, /readyz and /metrics needs one (vLLM's
``--api-key`` guards every /v1 route): over the real HTTP listener, HTTP/1.1 and HTTP/2."""

from __future__ import annotations

import httpx
import pytest

from gateway.admission.config import AdmissionSettings
from gateway.admission.keys import hash_key
from tests.integration.app_gateway import app_gateway

KEY = "sk-routes-0123456789"
KEYS = AdmissionSettings(keys=[f"ops:{hash_key(KEY)}"], queue_limit=100)
GUARDED = [("GET", "/v1/models"), ("HEAD", "/v1/models"), ("GET", "/v1/models/tiny"), ("GET", "/v1/completions"),
           ("GET", "/v1/no-such-route"), ("GET", "/admin/rollouts")]
OPEN = ["/healthz", "/readyz", "/metrics"]


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
async def test_every_route_but_the_probes_and_the_scrape_needs_a_key(http2: bool) -> None:
    async with app_gateway(admission=KEYS) as gw, httpx.AsyncClient(base_url=gw.url, http1=not http2,
                                                                     http2=http2) as c:
        for method, path in GUARDED:
            r = await c.request(method, path)
            assert r.status_code == 401, (method, path, r.status_code)
            if method == "GET":
                assert r.json()["error"]["type"] == "invalid_request_error"
                assert "didn't provide an API key" in r.json()["error"]["message"]
            r = await c.request(method, path, headers={"authorization": "Bearer sk-wrong"})
            assert r.status_code == 401 and (method == "HEAD" or r.json()["error"]["code"] == "invalid_api_key")
        good = {"authorization": f"Bearer {KEY}"}
        r = await c.get("/v1/models", headers=good)
        assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["tiny"]
        assert (await c.get("/v1/models/tiny", headers=good)).status_code == 200
        assert (await c.get("/v1/completions", headers=good)).status_code == 405  # the route's own answer, past the key
        assert (await c.get("/v1/no-such-route", headers=good)).status_code == 404
        assert (await c.get("/admin/rollouts", headers=good)).status_code == 200
        for path in OPEN:
            assert (await c.get(path)).status_code == 200, path
        # generation routes were guarded already (admission); still so
        body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
        assert (await c.post("/v1/completions", json=body)).status_code == 401
        assert (await c.post("/v1/completions", json=body, headers=good)).status_code == 200


@pytest.mark.parametrize("settings", [AdmissionSettings(queue_limit=100),
                                      AdmissionSettings(keys=[f"ops:{hash_key(KEY)}"], auth="off", queue_limit=100),
                                      None], ids=["no keys", "auth off", "no admission"])
async def test_without_required_keys_the_routes_stay_open(settings: AdmissionSettings | None) -> None:
    async with app_gateway(admission=settings) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        assert (await c.get("/v1/models")).status_code == 200
        assert (await c.get("/v1/models/tiny")).status_code == 200
        assert (await c.get("/admin/rollouts")).status_code == 200
