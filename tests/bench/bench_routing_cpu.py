"""Routing CPU per request in the gateway's pool (issue #29: <= 30 us p50 at a 2,048-token prompt,
nothing with one replica), including tokenization and hashing.

``ModelPool.choose`` timed per call (the whole routing decision: describing the request, the
prompt's tokens and block hashes, the index lookup, the policy), over 4 replicas
(:class:`tests.gateway.kv_doubles.KvWorker`) whose caches hold 64 documents that follow a common
1,024-token system prompt (T2's shape), prompts of 2,048 tokens (common + 896 of a document + a
fresh 128-token query) given three ways: token ids, text (the built-in byte tokenizer) and a chat
(rendered by its template, then tokenized). Rows: least loaded (no hashing: the baseline),
cache_aware with its memo of prefixes seen before (warm: the documents were seen), and cold (no
memo: every block hashed); then one replica, where neither policy does anything. p50 of the
calls, the best of ``--rounds`` rounds (the host is shared).

    .venv/bin/python -m tests.bench.bench_routing_cpu [--requests 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
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


def _pool(policy: RoutingPolicy, replicas: int, memo: bool) -> ModelPool:
    pool = ModelPool(policy=policy)
    workers = [KvWorker(f"w{i}") for i in range(replicas)]
    for w in workers:
        pool.add(w)  # type: ignore[arg-type]
    for d, doc in enumerate(DOCS):  # each replica holds a quarter of the documents
        workers[d % replicas].store(chain_hashes(TOK.encode(COMMON + doc), BS))
    if pool.prefix is not None and not memo:
        pool.prefix.memo = ChainMemo(max_edges=0)  # starts over at every call: nothing is remembered
    return pool


def _requests(kind: str, n: int) -> list[SubmitFactory]:
    out: list[SubmitFactory] = []
    for _ in range(n):
        text = COMMON + rng.choice(DOCS) + _text(127)  # + BOS: 2,048 tokens
        if kind == "token ids":
            ids = tuple(TOK.encode(text))
            out.append(lambda rid, ids=ids: Submit(rid, "tiny", prompt_token_ids=ids))
        elif kind == "text":
            out.append(lambda rid, text=text: Submit(rid, "tiny", prompt=text))
        else:
            msgs = ({"role": "system", "content": text[:1024]}, {"role": "user", "content": text[1024:]})
            out.append(lambda rid, msgs=msgs: Submit(rid, "tiny", messages=msgs))
    return out


def _p50_us(pool: ModelPool, reqs: list[SubmitFactory]) -> float:
    times = []
    choose, clock = pool.choose, time.perf_counter_ns
    for mk in reqs:
        t0 = clock()
        choose("tiny", None, (), mk)
        times.append(clock() - t0)
    return statistics.median(times) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rows: list[tuple[str, int, Callable[[], RoutingPolicy], bool]] = [
        ("least_loaded", 4, LeastLoaded, True),
        ("cache_aware (memo)", 4, CacheAware, True),
        ("cache_aware (no memo)", 4, CacheAware, False),
        ("least_loaded", 1, LeastLoaded, True),
        ("cache_aware", 1, CacheAware, True),
    ]
    kinds = ("token ids", "text", "chat")
    reqs = {k: _requests(k, args.requests) for k in kinds}
    assert len(TOK.encode(COMMON + DOCS[0] + _text(127))) == 2048
    print(f"routing CPU per request, p50 us (best of {args.rounds} rounds of {args.requests}), 2,048-token prompts")
    print(f"{'policy':<24}{'replicas':>9}" + "".join(f"{k:>12}" for k in kinds))
    for name, n, make, memo in rows:
        best = {k: min(_p50_us(_pool(make(), n, memo), reqs[k]) for _ in range(args.rounds)) for k in kinds}
        print(f"{name:<24}{n:>9}" + "".join(f"{best[k]:>12.1f}" for k in kinds))


if __name__ == "__main__":
    main()
