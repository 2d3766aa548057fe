"""Routing CPU per request in the gateway's pool (issue #29: <= 30 us p50 at a 2,048-token prompt,
nothing with one replica), including tokenization and hashing.

``ModelPool.choose`` timed per call in this thread's CPU time (the whole routing decision:
describing the request, the prompt's tokens and block hashes, the index lookup, the policy; a
shared host's other processes do not count), over 4 replicas
(:class:`tests.gateway.kv_doubles.KvWorker`) whose caches hold 64 documents that follow a common
1,024-token system prompt (T2's shape), a quarter each, prompts of 2,048 tokens (common + 896 of
a document + a fresh query) given three ways: token ids, text (the built-in byte tokenizer) and
a chat (system: the common prompt, user: the document and query; rendered by its template, then
tokenized; the replicas hold the rendered chats). Rows: least loaded (no hashing: the baseline),
cache_aware with its memo of prefixes seen before (warm: the documents were seen), and cold (no
memo: every held block hashed); then one replica, where neither policy does anything. Every
cache_aware pick is checked to be the document's replica (an idle fleet: the policy's clock
moves a second a call). p50 of the calls, the best of ``--rounds`` rounds.

    .venv/bin/python -m tests.bench.bench_routing_cpu [--requests 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from collections.abc import Callable

from gateway.routing.cache_aware import CacheAware
from gateway.routing.policy import LeastLoaded, RoutingPolicy
from gateway.routing.pool import ModelPool
from gateway.routing.prefix import ChainMemo
from gateway.routing.routed import SubmitFactory
from inference.tokenizer import ByteTokenizer
from tests.gateway.kv_doubles import KvWorker
from transport.common.prefix import chain_hashes
from transport.messages import Submit

BS = 16
TOK = ByteTokenizer()
rng = random.Random(0)
LETTERS = "abcdefghijklmnopqrstuvwxyz     .,"


def _text(n: int) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(n))


COMMON = _text(1024)
DOCS = [_text(896) for _ in range(64)]


def _chat(doc: str, query: str) -> tuple[dict[str, str], ...]:
    return {"role": "system", "content": COMMON}, {"role": "user", "content": doc + query}


QUERY = {"token ids": 127, "text": 127, "chat": 127 - (len(TOK.encode_chat(_chat(DOCS[0], "x"))) - 1921 - 1)}


def _ids(kind: str, doc: str, query: str) -> list[int]:
    return TOK.encode_chat(_chat(doc, query)) if kind == "chat" else TOK.encode(COMMON + doc + query)


def _pool(policy: RoutingPolicy, replicas: int, memo: bool, kind: str) -> ModelPool:
    pool = ModelPool(policy=policy)
    workers = [KvWorker(f"w{i}") for i in range(replicas)]
    for w in workers:
        pool.add(w)  # type: ignore[arg-type]
    for d, doc in enumerate(DOCS):  # each replica holds a quarter of the documents (and the common prefix)
        workers[d % replicas].store(chain_hashes(_ids(kind, doc, ""), BS))
    if pool.prefix is not None and not memo:
        pool.prefix.memo = ChainMemo(max_edges=0)  # starts over at every call: nothing is remembered
    return pool


def _requests(kind: str, n: int) -> list[tuple[int, SubmitFactory]]:
    """(the document's index, the request) ``n`` times."""
    out: list[tuple[int, SubmitFactory]] = []
    for _ in range(n):
        d = rng.randrange(len(DOCS))
        doc, query = DOCS[d], _text(QUERY[kind])
        assert len(_ids(kind, doc, query)) == 2048
        if kind == "token ids":
            ids = tuple(_ids(kind, doc, query))
            out.append((d, lambda rid, ids=ids: Submit(rid, "tiny", prompt_token_ids=ids)))
        elif kind == "text":
            out.append((d, lambda rid, text=COMMON + doc + query: Submit(rid, "tiny", prompt=text)))
        else:
            out.append((d, lambda rid, msgs=_chat(doc, query): Submit(rid, "tiny", messages=msgs)))
    return out


def _p50_us(pool: ModelPool, reqs: list[tuple[int, SubmitFactory]]) -> float:
    """p50 of the calls' CPU time (this thread's: another process's turn on a shared core is not ours)."""
    times = []
    choose, clock = pool.choose, time.thread_time_ns
    replicas = pool.replicas()["tiny"]
    hits = 0
    for d, mk in reqs:
        t0 = clock()
        pick = choose("tiny", None, (), mk)
        times.append(clock() - t0)
        hits += pick is replicas[d % len(replicas)]
    if isinstance(pool.policy, CacheAware) and len(replicas) > 1:  # (idle replicas: the holder wins)
        assert hits == len(reqs), f"{hits} of {len(reqs)} went to their document's replica"
    return statistics.median(times) / 1e3


def _idle() -> CacheAware:
    """The policy on a clock that moves a second a call: every replica's backlog is done by the next."""
    t = itertools.count()
    return CacheAware(now=lambda: float(next(t)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rows: list[tuple[str, int, Callable[[], RoutingPolicy], bool]] = [
        ("least_loaded", 4, LeastLoaded, True),
        ("cache_aware (memo)", 4, _idle, True),
        ("cache_aware (no memo)", 4, _idle, False),
        ("least_loaded", 1, LeastLoaded, True),
        ("cache_aware", 1, _idle, True),
    ]
    kinds = ("token ids", "text", "chat")
    reqs = {k: _requests(k, args.requests) for k in kinds}
    print(f"routing CPU per request, p50 us (best of {args.rounds} rounds of {args.requests}), 2,048-token prompts")
    print(f"{'policy':<24}{'replicas':>9}" + "".join(f"{k:>12}" for k in kinds))
    for name, n, make, memo in rows:
        best = {k: min(_p50_us(_pool(make(), n, memo, k), reqs[k]) for _ in range(args.rounds)) for k in kinds}
        print(f"{name:<24}{n:>9}" + "".join(f"{best[k]:>12.1f}" for k in kinds))


if __name__ == "__main__":
    main()
