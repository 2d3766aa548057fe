"""Cache-aware routing through a real ``quicserve serve`` (#29): 4 synthetic workers publishing KV
events, ``[routing] policy = "cache_aware"``, real HTTP clients.

- Four long prompts sent at once land on four replicas (the load bound spreads them); each sent
  again, one at a time to an idle fleet, goes back to the replica that holds it: the answer's
  ``cached_tokens`` covers the whole shared prefix. (Least loaded would send all four to the
  first idle replica: one hit in four.)
- The same with chats (system prompt, then a user turn): hashed as the worker renders them.
- Every worker killed: the gateway drops each one's entries when its connection dies, before the
  restarted worker's Hello; the new one (a new epoch) starts empty.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.test_gateway_e2e import Gateway, stop_gateway, wait_ready

REPO = Path(__file__).resolve().parents[2]
PREFIX = 1200  # characters = tokens (the byte tokenizer)
CONFIG = """
[workers]
engine = "synthetic"
local = 4
synthetic_step_ms = 2.0
[routing]
policy = "cache_aware"
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, Path]]:
    state = tmp_path_factory.mktemp("cache_routing")
    (state / "config.toml").write_text(CONFIG)
    log = state / "gateway.log"
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(state / "config.toml"), "--port", "0",
           "--no-tls", "--grpc-port", "-1", "--quic-port", "-1", "--state-dir", str(state), "--progress", "lines",
           "--log-level", "info"]
    with log.open("w") as err:
        g = wait_ready(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True,
                                        env={**os.environ, "QUICSERVE_SHUTDOWN__GRACE_PERIOD": "0"}))
        try:
            _wait_for(lambda: len(_held_lines(log)) >= 4, "every worker's KV events")
            yield g, log
        finally:
            stop_gateway(g)


def _held_lines(log: Path) -> list[tuple[str, str, int]]:
    return [(m[1], m[2], int(m[3])) for m in re.finditer(r"cache index: (\S+) \(epoch (\w+)\) holds (\d+) blocks",
                                                          log.read_text())]


def _wait_for(cond: object, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def _prompt(i: int, tail: str) -> str:
    return "".join(chr(33 + (i * 7 + k * 13) % 90) for k in range(PREFIX)) + tail


async def _complete(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> int:
    r = await client.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt,
                                                         "max_tokens": max_tokens, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return int(r.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0))


def test_a_repeated_long_prefix_goes_back_to_the_replica_that_holds_it(served: tuple[Gateway, Path]) -> None:
    g, _ = served

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as client:
            # at once, each long enough to overlap the others: the load bound puts one on each replica
            await asyncio.gather(*(_complete(client, g.http, _prompt(i, " first"), 150) for i in range(4)))
            await asyncio.sleep(0.3)  # the last KV batches (and Stats) reach the gateway
            return [await _complete(client, g.http, _prompt(i, f" again {i}"), 4) for i in range(4)]

    cached = asyncio.run(run())
    assert all(c >= PREFIX - 16 for c in cached), cached  # the whole shared prefix, on every replica
    # the index's size and the feed's counters on /metrics: every prompt hashed, no gap, no reset
    assert g.metric("quicserve_cache_index_hashes") >= 4 * (PREFIX // 16)
    text = httpx.get(g.http + "/metrics").text
    for name in ("unhashed", "resyncs", "epochs"):
        assert f"quicserve_cache_routing_{name}_total 0.0" in text.splitlines()


async def _chat(client: httpx.AsyncClient, url: str, system: str, user: str, max_tokens: int) -> int:
    r = await client.post(url + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": max_tokens, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return int(r.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0))


def test_a_repeated_chat_goes_back_to_the_replica_that_holds_its_system_prompt(
        served: tuple[Gateway, Path]) -> None:
    """Chats are hashed as the worker renders them (the gateway's ChatRenderer: the template's text
    without jinja) and follow their system prompt like completions follow their prefix."""
    g, _ = served

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as client:
            await asyncio.gather(*(_chat(client, g.http, _prompt(i + 10, ""), "first", 150) for i in range(4)))
            await asyncio.sleep(0.3)
            return [await _chat(client, g.http, _prompt(i + 10, ""), f"again {i}", 4) for i in range(4)]

    cached = asyncio.run(run())
    assert all(c >= PREFIX - 16 for c in cached), cached


def _children(pid: int) -> list[int]:
    return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_a_restarted_worker_starts_empty_and_its_old_entries_go_first(served: tuple[Gateway, Path]) -> None:
    g, log = served
    before = _held_lines(log)
    workers = _children(g.proc.pid)
    assert len(workers) == 4
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    _wait_for(lambda: len(_held_lines(log)) >= len(before) + 4, "restarted workers' KV events")
    text = log.read_text()
    old_epochs = {e for _, e, _ in before}
    dropped = [(m.start(), m[1], int(m[2])) for m in re.finditer(r"cache index: (\S+) left, its (\d+) blocks dropped",
                                                                  text)]
    fresh = [(m.start(), m[1], m[2], int(m[3])) for m in re.finditer(
        r"cache index: (\S+) \(epoch (\w+)\) holds (\d+) blocks", text)][len(before):]
    assert len(dropped) == 4 and sum(n for *_, n in dropped) > 0  # the first test's prefixes were held
    assert len(fresh) == 4 and all(n == 0 and e not in old_epochs for _, _, e, n in fresh)
    assert max(at for at, *_ in dropped) < min(at for at, *_ in fresh)  # gone before any new Hello's set
    print(f"restarted and resubscribed {time.monotonic() - killed:.2f} s after the kill")
