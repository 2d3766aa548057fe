"""Paged block allocator with prefix caching."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inference.kv_cache import ROOT_HASH, KVCache, block_hash


def test_shared_prefix_reuses_blocks_and_counts_hits() -> None:
    kv = KVCache(16, 4)
    a = list(range(1, 15))  # 14 tokens: 3 full blocks + 2
    alloc = kv.allocate(1, a)
    assert alloc is not None and alloc.num_cached_tokens == 0 and len(alloc.block_table) == 4
    kv.register(1, a, len(a))
    b = a[:12] + [99, 98, 97]
    alloc_b = kv.allocate(2, b)
    assert alloc_b is not None and alloc_b.num_cached_tokens == 12
    assert alloc_b.block_table[:3] == alloc.block_table[:3]
    assert alloc_b.block_table[3] != alloc.block_table[3]
    assert [kv.ref_count(x) for x in alloc.block_table] == [2, 2, 2, 1]
    assert kv.hit_rate == pytest.approx(12 / (14 + 15))
    kv.check_invariants()


def test_uncomputed_blocks_are_not_shared_and_one_token_is_always_left() -> None:
    kv = KVCache(16, 4)
    toks = list(range(8))
    kv.allocate(1, toks)
    assert kv.allocate(2, toks).num_cached_tokens == 0  # type: ignore[union-attr]  # 1's KV not computed yet
    kv.register(1, toks, 8)
    same = kv.allocate(3, toks)  # the whole aligned prompt is cached: every block shared, the last token rerun
    assert same is not None and same.num_cached_tokens == 7 and same.last_cached
    assert same.block_table == kv.block_table(1) and [kv.ref_count(b) for b in same.block_table] == [2, 2]
    assert kv.cached_prefix_len(toks) == 7 and kv.can_allocate(toks)
    longer = kv.allocate(4, [*toks, 8])  # one more token: its own block, every prompt block shared
    assert longer is not None and longer.num_cached_tokens == 8 and not longer.last_cached
    assert longer.block_table[:2] == same.block_table and kv.ref_count(longer.block_table[2]) == 1
    partial = kv.allocate(5, [*toks[:4], 9, 9, 9, 9])  # aligned, only its first block cached: as before
    assert partial is not None and partial.num_cached_tokens == 4 and not partial.last_cached
    kv.check_invariants()


def test_a_wholly_cached_aligned_prompt_takes_no_block_and_registers_nothing_new() -> None:
    kv = KVCache(4, 4)
    toks = list(range(8))
    kv.allocate(1, toks)
    kv.register(1, toks, 8)
    kv.allocate(2, [50] * 4)  # 3 of 4 blocks in use
    follower = kv.allocate(3, toks)  # needs no free block at all
    assert follower is not None and follower.last_cached and kv.num_free == 1
    kv.register(3, toks, 8)  # its rerun last token wrote nothing: the chain is already cached
    assert kv.ensure_capacity(3, 9) and kv.num_free == 0  # its first output opens its own block
    assert kv.block_table(3)[:2] == kv.block_table(1) and kv.block_table(3)[2] != kv.block_table(2)[0]
    kv.free(1)
    kv.free(3)
    assert kv.allocate(4, toks).last_cached  # type: ignore[union-attr]  # still cached after both are gone
    kv.check_invariants()


def test_freed_cached_blocks_are_evicted_lru_and_never_while_in_use() -> None:
    kv = KVCache(6, 2)
    kv.allocate(1, [1, 2, 3, 4, 5])  # 3 blocks
    kv.register(1, [1, 2, 3, 4, 5], 5)
    kv.free(1)
    assert kv.num_free == 6  # 2 cached-evictable + 4 free
    keep = kv.allocate(2, [1, 2, 3, 4, 9])  # reuses the 2 cached blocks
    assert keep is not None and keep.num_cached_tokens == 4
    used = set(keep.block_table)
    other = kv.allocate(3, [7, 7, 7, 7, 7, 7])  # needs 3 of the remaining 3 blocks
    assert other is not None and not (set(other.block_table) & used)
    assert kv.allocate(4, [8, 8]) is None  # nothing left; in-use blocks untouched
    assert kv.block_table(2) == keep.block_table
    kv.free(3)
    kv.register(2, [1, 2, 3, 4, 9], 5)
    kv.free(2)
    assert kv.evictions == 0
    big = kv.allocate(5, list(range(100, 111)))  # 6 blocks: evicts every cached one
    assert big is not None and kv.evictions == 2 and kv.prefix_hashes() == ()
    kv.check_invariants()


def test_prefix_hashes_report_chain_roots_newest_first() -> None:
    kv = KVCache(16, 2)
    for sid, toks in ((1, [1, 2, 3, 4]), (2, [5, 6, 7]), (3, [1, 2, 9, 9])):
        kv.allocate(sid, toks)
        kv.register(sid, toks, len(toks))
    r12, r56 = block_hash(ROOT_HASH, [1, 2]), block_hash(ROOT_HASH, [5, 6])
    assert kv.prefix_hashes() == (r56, r12)
    assert all(0 <= h < 2**64 for h in kv.prefix_hashes())


def test_disabled_prefix_cache_never_shares() -> None:
    kv = KVCache(8, 2, enable_prefix_cache=False)
    kv.allocate(1, [1, 2, 3])
    kv.register(1, [1, 2, 3], 3)
    assert kv.allocate(2, [1, 2, 3]).num_cached_tokens == 0  # type: ignore[union-attr]
    assert kv.hit_rate == 0.0


ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "grow", "compute", "free"]),
        st.integers(0, 5),
        st.lists(st.integers(0, 3), min_size=1, max_size=9),
    ),  # fmt: skip
    max_size=60,
)


@settings(max_examples=150, deadline=None, database=None)
@given(ops=ops, num_blocks=st.integers(1, 10))
def test_random_ops_keep_bookkeeping_consistent(ops: list, num_blocks: int) -> None:
    kv = KVCache(num_blocks, 2)
    live: dict[int, list[int]] = {}
    tables: dict[int, tuple[int, ...]] = {}
    for op, sid, toks in ops:
        if op == "alloc" and sid not in live:
            if kv.allocate(sid, toks) is not None:
                live[sid] = list(toks)
        elif op == "grow" and sid in live:
            if kv.ensure_capacity(sid, len(live[sid]) + 1):
                live[sid].append(toks[0])
        elif op == "compute" and sid in live:
            kv.register(sid, live[sid], len(live[sid]))
        elif op == "free":
            kv.free(sid)
            live.pop(sid, None)
            tables.pop(sid, None)
        kv.check_invariants()
        for s, t in tables.items():  # a live sequence's blocks never move or vanish
            assert kv.block_table(s)[: len(t)] == t
        tables = {s: kv.block_table(s) for s in live}
        owned = [b for s in live for b in kv.block_table(s)]
        shared = [b for b in set(owned) if owned.count(b) > 1]
        for b in shared:  # only cached (full, computed) blocks are ever shared
            assert kv._hash_of[b] is not None
    for s in list(live):
        kv.free(s)
    assert kv.num_free == num_blocks
