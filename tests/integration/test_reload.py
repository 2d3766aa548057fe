"""Reloading a running ``quicserve serve`` without losing a request (issue #28, item 5): SIGHUP
applies new models, rules and aliases -- a stream running on a removed model's worker finishes
whole, an added model starts its workers; a config that fails ``config check`` changes nothing and
says why (log, metric, /readyz); a changed config file is picked up without a signal."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.serve_process import serve_config
from tests.integration.test_gateway_e2e import stop_gateway

BEFORE = """
[workers]
engine = "synthetic"
synthetic_step_ms = 50

[[models]]
name = "old"

[[routes]]
name = "pinned"
when = { headers = { "x-pin" = "yes" } }
to = "old"
"""

AFTER = """
[workers]
engine = "synthetic"
synthetic_step_ms = 50

[[models]]
name = "new"

[[routes]]
name = "pinned"
when = { headers = { "x-pin" = "yes" } }
to = "new"
"""

pytestmark = pytest.mark.timeout(120)


def _models(url: str) -> set[str]:
    return {m["id"] for m in httpx.get(url + "/v1/models").json()["data"]}


def _wait(cond: object, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_sighup_swaps_models_and_rules_without_losing_a_stream(tmp_path: Path) -> None:
    g = serve_config(tmp_path, BEFORE, models=("old",))
    try:
        streamed: list[str] = []

        def stream() -> None:  # 40 tokens x 50 ms: still running when the reload lands
            with httpx.stream("POST", g.http + "/v1/completions", timeout=30,
                              json={"model": "old", "prompt": "x", "max_tokens": 40, "stream": True}) as r:
                streamed.extend(line for line in r.iter_lines() if line.startswith("data: "))

        t = threading.Thread(target=stream)
        t.start()
        time.sleep(0.5)
        (tmp_path / "config.toml").write_text(AFTER)
        g.proc.send_signal(signal.SIGHUP)
        _wait(lambda: "new" in _models(g.http), "the added model never became ready")
        t.join(30)
        events = [json.loads(line[6:]) for line in streamed if line != "data: [DONE]"]
        text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
        assert streamed[-1] == "data: [DONE]" and events[-1]["choices"][0]["finish_reason"] == "length"
        assert len(text) >= 40 and all(e.get("model") == "old" for e in events)  # whole, on the old worker
        r = httpx.post(g.http + "/v1/completions", json={"model": "anything", "prompt": "x", "max_tokens": 2},
                       headers={"x-pin": "yes"})
        assert r.status_code == 200 and r.headers["x-quicserve-route"] == "pinned" and r.json()["model"] == "new"
        _wait(lambda: httpx.post(g.http + "/v1/completions",
                                 json={"model": "old", "prompt": "x", "max_tokens": 2}).status_code == 404,
              "the removed model is still served")

        bad = AFTER.replace('to = "new"', 'to = "missing"')
        (tmp_path / "config.toml").write_text(bad)
        g.proc.send_signal(signal.SIGHUP)
        _wait(lambda: "refused" in httpx.get(g.http + "/readyz").json().get("config", ""), "no word of the refusal")
        ready = httpx.get(g.http + "/readyz")
        assert ready.status_code == 200 and "routes[0].to: 'missing'" in ready.json()["config"]
        time.sleep(1.5)  # the file watcher ticks (1 s): it must not read the same file again
        assert 'quicserve_config_reloads_total{result="failed"} 1.0' in httpx.get(g.http + "/metrics").text
        r = httpx.post(g.http + "/v1/completions", json={"model": "new", "prompt": "x", "max_tokens": 2},
                       headers={"x-pin": "yes"})
        assert r.status_code == 200 and r.json()["model"] == "new"  # still the last good configuration

        # the file changed, no signal: picked up by its modification time
        (tmp_path / "config.toml").write_text(AFTER.replace('name = "new"', 'name = "new"\naliases = ["fresh"]'))
        _wait(lambda: "fresh" in _models(g.http), "the changed file was never read")
        assert "config" not in httpx.get(g.http + "/readyz").json()
    finally:
        assert stop_gateway(g) == 0


def _with_extra(weight: int) -> str:
    return f"""
[workers]
engine = "synthetic"
synthetic_step_ms = 5

[[models]]
name = "base"

[[models]]
name = "extra"

[[routes]]
name = "ab"
when = {{ model = "base" }}
split = [{{ to = "base", weight = {100 - weight} }}, {{ to = "extra", weight = {weight} }}]
"""


BASE_ONLY = """
[workers]
engine = "synthetic"
synthetic_step_ms = 5

[[models]]
name = "base"
"""


def test_reload_under_load_loses_nothing(tmp_path: Path) -> None:
    """32 clients for 30 s while the config changes six times: a model added and removed three
    times, the split's weights changed each time it comes back: every request gets a 200."""
    import asyncio

    g = serve_config(tmp_path, BASE_ONLY, models=("base",))
    try:
        statuses: list[int] = []
        served: set[str] = set()
        stop = asyncio.Event()

        async def client(c: httpx.AsyncClient, k: int) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                r = await c.post("/v1/completions", json={"model": "base", "prompt": f"{k} {n}", "max_tokens": 8,
                                                          "stream": n % 2 == 0})
                statuses.append(r.status_code)
                if r.status_code == 200 and n % 2:
                    served.add(r.json()["model"])

        async def run() -> None:
            async with httpx.AsyncClient(base_url=g.http, timeout=30,
                                         limits=httpx.Limits(max_connections=32)) as c:
                tasks = [asyncio.create_task(client(c, k)) for k in range(32)]
                for weight in (10, 30, 50):  # 3 x 9.5 s + 1.5 s: 30 s of load
                    await asyncio.sleep(4.0)
                    (tmp_path / "config.toml").write_text(_with_extra(weight))
                    g.proc.send_signal(signal.SIGHUP)
                    await asyncio.sleep(5.5)
                    (tmp_path / "config.toml").write_text(BASE_ONLY)
                    g.proc.send_signal(signal.SIGHUP)
                await asyncio.sleep(1.5)
                stop.set()
                await asyncio.gather(*tasks)

        asyncio.run(run())
        failed = [s for s in statuses if s != 200]
        print(f"reload under load: {len(statuses)} requests, {len(failed)} failed, models {sorted(served)}")
        assert len(statuses) > 1000 and not failed, sorted(set(failed))
        assert served == {"base", "extra"}  # the split did send some to the added model
    finally:
        assert stop_gateway(g) == 0
