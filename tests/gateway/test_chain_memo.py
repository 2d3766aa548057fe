"""The gateway's fast prompt hashing (#29): the radix memo, the bytes a tokenizer's ids become, and
the index's binary-searched longest prefixes all give what the worker's definitions give."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing.cache_index import CacheIndex
from gateway.routing.chain_memo import ChainMemo, u32le
from gateway.routing.policy import RouteRequest
from gateway.routing.prefix import PrefixHasher, prompt_token_ids
from inference.tokenizer import ByteTokenizer
from tests.gateway.kv_doubles import KvWorker
from transport.common.prefix import chain_hashes
from transport.messages import SamplingParams, Submit

rng = random.Random(11)
DOCS = [[rng.randrange(1 << 32) for _ in range(rng.randrange(16, 300))] for _ in range(6)]


def _prompt(r: random.Random) -> list[int]:
    """Prompts that share prefixes of every length with each other (and fresh tails)."""
    base = r.choice(DOCS)
    return base[: r.randrange(len(base) + 1)] + [r.randrange(1 << 32) for _ in range(r.randrange(0, 60))]


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 1 << 30))
def test_the_memo_hashes_as_the_worker_does_whatever_the_order(seed: int) -> None:
    r = random.Random(seed)
    memo = ChainMemo(max_blocks=r.choice([8, 200, 1 << 18]))
    for _ in range(60):
        ids, bs, limit = _prompt(r), r.choice([1, 4, 16]), r.choice([1, 3, 40, 4096])
        assert memo.chain(ids, bs, limit) == chain_hashes(ids, bs, limit)
    assert memo.blocks <= memo.max_blocks + 4096  # it starts over once past its bound


def test_with_held_it_stops_after_the_first_block_nobody_holds_and_remembers_only_held_ones() -> None:
    bs = 4
    ids = DOCS[0][:200]
    full = chain_hashes(ids, bs)
    memo = ChainMemo()
    held = set(full[:10])
    assert memo.chain_bytes(u32le(ids), bs, 4096, held) == full[:11]
    assert memo.blocks == 10
    held |= set(full[10:30])  # a replica stored more: the memo walks its 10, hashes on to block 30
    assert memo.chain_bytes(u32le(ids), bs, 4096, held) == full[:31] and memo.blocks == 30
    other = ids[:20 * bs] + [1, 2, 3, 4] * 20  # leaves the remembered run inside it: split there
    want = chain_hashes(other, bs)
    assert memo.chain_bytes(u32le(other), bs, 4096, set(want)) == want
    assert memo.chain(ids, bs, 4096) == full and memo.chain(other, bs, 4096) == want


def test_ids_become_u32le_bytes_or_the_prompt_routes_unhashed() -> None:
    assert u32le([1, 256, 2**32 - 1]) == b"\x01\0\0\0\0\x01\0\0\xff\xff\xff\xff"
    hasher = PrefixHasher()
    w = KvWorker("w")
    for bad in ([-1], [2**32]):
        sub = Submit(1, "tiny", prompt_token_ids=tuple(bad) * 40)
        assert hasher.annotate(RouteRequest("tiny"), lambda rid, s=sub: s, [w]) == RouteRequest("tiny")  # type: ignore[list-item]


@pytest.mark.parametrize("kind", ["text", "chat", "chat+tools", "ids"])
def test_the_byte_tokenizers_bytes_are_its_ids(kind: str) -> None:
    tok = ByteTokenizer()
    text = "Grüße, 世界! " * 30 + "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(100))
    tools = '[{"type": "function", "function": {"name": "f", "parameters": {}}}]'
    msgs = ({"role": "system", "content": text}, {"role": "user", "content": "hi"})
    sub = {"text": Submit(1, "tiny", prompt=text),
           "chat": Submit(1, "tiny", messages=msgs),
           "chat+tools": Submit(1, "tiny", SamplingParams(tools=tools), messages=msgs),
           "ids": Submit(1, "tiny", prompt_token_ids=tuple(tok.encode(text)))}[kind]
    req = PrefixHasher().annotate(RouteRequest("tiny"), lambda rid: sub, [KvWorker("w")])  # type: ignore[list-item]
    ids = prompt_token_ids(tok, sub)
    assert req.prompt_tokens == len(ids) and req.prefix_hashes == chain_hashes(ids, 16)[: len(req.prefix_hashes)]
    assert len(req.prefix_hashes) == len(ids) // 16  # (no index: every block)
    if kind == "chat+tools":  # the worker renders the tools into the prompt: so does the gateway
        assert ids != prompt_token_ids(tok, Submit(1, "tiny", messages=msgs))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["store", "evict", "reset"]), st.integers(0, 3), st.integers(0, 5),
                          st.integers(1, 12)), max_size=40))
def test_binary_searched_prefixes_are_the_walks_on_caches_without_holes(ops: list[tuple[str, int, int, int]]) -> None:
    """Caches that evict a chain's tail first (as the worker's and this index's LRU do) have no holes;
    there held_prefixes, O(log n) lookups, answers as longest_prefixes, the walk."""
    chains = [chain_hashes(d[:12 * 4], 4) for d in DOCS]
    ix = CacheIndex(4, 30)
    for op, r, c, k in ops:
        if op == "store":
            ix.store(r, chains[c][:k])
        elif op == "evict":
            held = ix.longest_prefix(r, chains[c])
            ix.evict(r, chains[c][min(k, held):held])  # a tail
        else:
            ix.reset(r)
        for q in chains + [chains[0][:3] + chains[1][3:]]:
            assert ix.held_prefixes(q) == ix.longest_prefixes(q)
    assert ix.held_prefixes(()) == [0, 0, 0, 0]
