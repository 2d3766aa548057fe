"""Prefix hashes computed in the gateway match the worker's prefix cache, and a policy routes by them.

Real in-process workers (the synthetic engine runs the real scheduler and KV cache with the
tiny model's byte tokenizer) over the real transport; the gateway side is the pool and App.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import orjson
import pytest

from gateway.app import App
from gateway.http.types import Request
from gateway.routing.config import RoutingSettings
from gateway.routing.policy import LeastLoaded, PrefixAffinity, RouteRequest
from gateway.routing.pool import ModelPool
from gateway.routing.prefix import PrefixHasher, prompt_token_ids
from gateway.settings import SettingsError, load_settings
from inference.kv_cache import KVCache
from inference.tokenizer import ByteTokenizer
from inference.worker import build_service, parse_args
from transport.api import WorkerConnection
from transport.client import ClientConnection, connect
from transport.common.prefix import PREFIX_HASH_SCHEME, ROOT_HASH, block_hash, chain_hashes
from transport.messages import Hello, SamplingParams, Stats, Submit
from transport.server import serve

from .doubles import RecordingSink, ScriptedWorkerConnection

SYSTEM = "You are a helpful assistant who answers in haiku. " * 3


def test_chain_hashes_are_the_kv_caches_block_hashes() -> None:
    tokens = list(range(1, 70))  # 4 full blocks of 16 and a partial one
    chain = chain_hashes(tokens, 16)
    assert len(chain) == 4 and chain[0] == block_hash(ROOT_HASH, tokens[:16])
    assert chain[1] == block_hash(chain[0], tokens[16:32])
    assert chain_hashes(tokens, 16, limit=2) == chain[:2] and chain_hashes(tokens[:15], 16) == ()
    kv = KVCache(num_blocks=16, block_size=16)
    assert kv.allocate(1, tokens) is not None
    kv.register(1, tokens, len(tokens))
    assert kv.prefix_hashes() == (chain[0],)  # the root a worker reports in Stats
    assert kv.cached_prefix_len(tokens[:64] + [9, 9]) == 64  # the same four blocks, found by these hashes
    with pytest.raises(ValueError):
        chain_hashes(tokens, 0)


@asynccontextmanager
async def workers(n: int) -> AsyncIterator[list[ClientConnection]]:
    """``n`` in-process synthetic workers (tiny model, prefix cache on, stats every 20 ms)."""
    args = parse_args(["--engine", "synthetic", "--num-blocks", "128", "--stats-interval", "0.02"])
    started = []
    for _ in range(n):
        svc = build_service(args)
        server = await serve("tcp://127.0.0.1:0", svc)
        svc.server = server
        started.append((svc, server, asyncio.create_task(svc.run()), await connect(server.address)))
    try:
        yield [c for _, _, _, c in started]
    finally:
        for svc, server, task, conn in started:
            await conn.close()
            svc.abort()
            await task
            await server.close()


async def stats_with(conn: WorkerConnection, root: int) -> Stats:
    for _ in range(250):
        s = conn.latest_stats
        if s is not None and root in s.prefix_hashes:
            return s
        await asyncio.sleep(0.02)
    raise AssertionError(f"the worker never reported root {root:x}: {conn.latest_stats}")


async def finish(stream: object) -> None:
    while True:
        try:
            await stream.next_events()  # type: ignore[attr-defined]
        except StopAsyncIteration:
            return


async def test_the_gateways_hashes_are_what_the_worker_reports_for_chat_and_text() -> None:
    hasher = PrefixHasher()
    async with workers(1) as (conn,):
        hello = conn.peer_hello
        assert hello.prefix_hash == PREFIX_HASH_SCHEME and hello.block_size == 16 and hello.model_id == "tiny"
        params = SamplingParams(max_tokens=2)
        chat = Submit(conn.next_request_id(), "tiny", params, messages=({"role": "system", "content": SYSTEM},
                                                                        {"role": "user", "content": "Hi"}))
        text = Submit(conn.next_request_id(), "tiny", params, prompt="Once upon a time, " * 4)
        for sub in (chat, text):
            req = hasher.annotate(RouteRequest("tiny"), lambda rid, s=sub: s, [conn])
            await finish(conn.submit(sub))
            assert len(req.prefix_hashes) >= 3
            await stats_with(conn, req.prefix_hashes[0])  # the worker caches exactly this root
        tok = ByteTokenizer()
        assert req.prompt_tokens == len(prompt_token_ids(tok, text)) == len(text.prompt or "") + 1  # bos


def test_no_hashes_without_a_matching_scheme_or_tokenizer() -> None:
    hasher = PrefixHasher()
    sub = Submit(1, "tiny", prompt="x" * 100)
    other = ScriptedWorkerConnection()
    other.peer_hello = Hello(role="worker", models=("tiny",), block_size=16, model_id="tiny", prefix_hash="md5/v0")
    assert hasher.annotate(RouteRequest("tiny"), lambda rid: sub, [other]) == RouteRequest("tiny")
    missing = ScriptedWorkerConnection()
    missing.peer_hello = Hello(role="worker", models=("m",), block_size=16, model_id="/no/such/checkpoint",
                               prefix_hash=PREFIX_HASH_SCHEME)
    assert hasher.annotate(RouteRequest("m"), lambda rid: sub, [missing]) == RouteRequest("m")
    assert hasher.tokenizer("/no/such/checkpoint") is None  # tried once, remembered


class Chosen(PrefixAffinity):
    """PrefixAffinity that remembers its picks (which worker each request went to)."""

    def __init__(self) -> None:
        super().__init__(slack=4)
        self.picks: list[WorkerConnection | None] = []

    def choose(self, req: RouteRequest, replicas: Sequence[WorkerConnection]) -> WorkerConnection | None:
        self.picks.append(super().choose(req, replicas))
        return self.picks[-1]


def chat_request(question: str) -> Request:
    body = {"model": "tiny", "max_tokens": 2,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}
    return Request("POST", "/v1/chat/completions", "", [], orjson.dumps(body), "http/1.1", "http")


async def test_prefix_affinity_sends_a_prompt_to_the_replica_that_caches_its_prefix() -> None:
    policy = Chosen()
    pool = ModelPool(policy=policy)
    assert pool.prefix is not None and ModelPool().prefix is None  # least-loaded never tokenizes
    app = App(pool)
    async with workers(2) as (first, second):
        pool.add(first)
        pool.add(second)
        # warm the second replica's cache with the shared system prompt, behind the gateway's back
        warm = Submit(second.next_request_id(), "tiny", SamplingParams(max_tokens=2),
                      messages=({"role": "system", "content": SYSTEM}, {"role": "user", "content": "Warm"}))
        root = PrefixHasher().annotate(RouteRequest("tiny"), lambda rid: warm, [second]).prefix_hashes[0]
        await finish(second.submit(warm))
        await stats_with(second, root)
        assert LeastLoaded().choose(RouteRequest("tiny"), [first, second]) is first  # idle: the first
        for q in ("What is a haiku?", "And a limerick?"):
            done = asyncio.get_running_loop().create_future()
            sink = RecordingSink()
            app.handle(chat_request(q), sink, lambda d=done: d.set_result(None))
            await done
            assert sink.status == 200, sink.body
        assert policy.picks == [second, second]


def test_a_busy_cache_hit_yields_to_an_idle_replica() -> None:
    hot, idle = ScriptedWorkerConnection(), ScriptedWorkerConnection()
    hot.latest_stats = Stats(queue_depth=0, running=9, kv_blocks_free=1, kv_blocks_total=8, prefix_hashes=(42,))
    req = RouteRequest("tiny", prefix_hashes=(42, 43))
    assert PrefixAffinity(slack=4).choose(req, [idle, hot]) is idle  # 9 running > 0 + 4
    assert PrefixAffinity(slack=16).choose(req, [idle, hot]) is hot
    assert PrefixAffinity().choose(RouteRequest("tiny"), [idle, hot]) is idle  # no hashes: least loaded


def test_routing_settings_are_checked() -> None:
    assert isinstance(RoutingSettings().build(), LeastLoaded)
    built = RoutingSettings(policy="prefix_affinity", prefix_slack=7).build()
    assert isinstance(built, PrefixAffinity) and built.slack == 7
    problems: list[str] = []
    RoutingSettings(policy="random", prefix_slack=-1)._validate(problems)
    assert problems == ["routing.policy: 'random' is not one of cache_aware, least_loaded, prefix_affinity, round_robin",
                        "routing.prefix_slack: must be >= 0"]
    with pytest.raises(SettingsError, match="routing.policy"):
        load_settings(None, environ={"QUICSERVE_ROUTING__POLICY": "random"})
