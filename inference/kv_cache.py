"""Paged KV-cache bookkeeping with prefix caching (no arrays; the runner owns them).

How it works: physical blocks ``0..num_blocks-1`` each hold ``block_size``
positions. A sequence owns a list of block ids (its block table). Once a block
is *full and computed*, it gets a content hash chained over its parent's hash,
``h_i = H(h_{i-1}, tokens of block i)``, and goes into ``_cached`` so that a
later prompt with the same first ``i+1`` blocks of tokens can share it
(reference count +1) instead of recomputing it.

A block is in exactly one of three places:
  * ``_free``      — never computed or its hash was dropped; ref 0;
  * ``_evictable`` — cached (has a hash), ref 0, in LRU order;
  * in use         — ref >= 1 (maybe also cached, then shared read-only).
Allocation takes from ``_free`` first, then evicts the least recently used
evictable block (dropping its hash). A block with ref >= 1 is never handed out.
Only full blocks are shared, and a sequence only ever writes into its own
last, partial block, so shared blocks are immutable.

With a sliding ``window`` (the model attends to a query's last ``window``
keys), :meth:`KVCache.release_out_of_window` gives back a sequence's blocks
that lie wholly before the window of its next query: no later step reads them.
Its table keeps its length (positions still index it); the released entries
name the first block it still holds, so a kernel that reads one in passing
reads finite values it then masks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# One definition for workers and gateways (a gateway computes the same chain to route by prefix).
from transport.common.prefix import PREFIX_HASH_SCHEME, ROOT_HASH, block_hash

__all__ = ["KVCache", "Allocation", "block_hash", "ROOT_HASH", "PREFIX_HASH_SCHEME"]


@dataclass(frozen=True, slots=True)
class Allocation:
    block_table: tuple[int, ...]
    # Prompt positions the runner need not compute: a multiple of block_size, always < len(tokens) (the last
    # position is computed for the first sample's logits), or len(tokens) - 1 with ``last_cached``.
    num_cached_tokens: int
    # The cache held the whole (block-aligned) prompt: every block is shared, and the last position is computed
    # again for its logits without writing its K/V (the shared last block holds it: SeqWork.shared_tokens).
    last_cached: bool = False


class _SeqBlocks:
    __slots__ = ("blocks", "hashes", "released")

    def __init__(self) -> None:
        self.blocks: list[int] = []
        self.hashes: list[int] = []  # chain hashes of the leading full, registered blocks
        self.released = 0  # leading blocks given back (out of the window); their entries name blocks[released]


class KVCache:
    """Block allocator with reference counts, prefix hashing and LRU eviction."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_cache: bool = True,
                 window: int | None = None) -> None:
        if num_blocks < 1 or block_size < 1 or (window is not None and window < 1):
            raise ValueError("num_blocks, block_size and window must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.window = window
        self._ref = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # chain hash -> block id
        self._tokens_of: dict[int, tuple[int, ...]] = {}  # block id -> tokens (collision check)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._roots: OrderedDict[int, None] = OrderedDict()  # cached first-block hashes
        self._seqs: dict[int, _SeqBlocks] = {}
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evictions = 0
        self.window_releases = 0  # blocks given back because they fell out of a sliding window
        # KV events (inference.kv_events): hashes cached or dropped since the last take_changes, when tracked
        self.changes: dict[int, None] | None = None

    # -- queries -----------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free + evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def hash_scheme(self) -> str:
        """:data:`PREFIX_HASH_SCHEME`, or "" when prefix caching is off (no hashes to match)."""
        return PREFIX_HASH_SCHEME if self.enable_prefix_cache else ""

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: int) -> tuple[int, ...]:
        return tuple(self._seqs[seq_id].blocks)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def _match(self, tokens: Sequence[int]) -> tuple[list[int], list[int]]:
        """Cached blocks covering a prefix of ``tokens``: up to all of its full blocks (a block-aligned prompt
        may be wholly cached; its last token is still computed, unwritten: :class:`Allocation`)."""
        blocks: list[int] = []
        hashes: list[int] = []
        if not self.enable_prefix_cache:
            return blocks, hashes
        bs = self.block_size
        parent = ROOT_HASH
        for i in range(len(tokens) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = block_hash(parent, chunk)
            b = self._cached.get(h)
            if b is None or self._tokens_of.get(b) != chunk:
                break
            blocks.append(b)
            hashes.append(h)
            parent = h
        return blocks, hashes

    def common_blocks(self, a: Sequence[int], b: Sequence[int], limit: int) -> int:
        """How many leading full blocks (at most ``limit``) hold the same tokens in ``a`` and ``b``: what
        one prompt could take from the other's prefix-cache entries once they are registered."""
        bs = self.block_size
        n = min(limit, len(a) // bs, len(b) // bs)
        if type(a) is not type(b):  # a list never equals a tuple
            a, b = list(a[: n * bs]), list(b[: n * bs])
        lo = 0
        if a[: n * bs] == b[: n * bs]:  # the usual case (identical prompts): one compare in C
            return n
        while lo < n and a[lo * bs : (lo + 1) * bs] == b[lo * bs : (lo + 1) * bs]:
            lo += 1
        return lo

    def cached_prefix_len(self, tokens: Sequence[int]) -> int:
        """How many leading positions of ``tokens`` need not be computed: those the cache holds, at most
        ``len(tokens) - 1`` (the last is always computed, for its logits)."""
        return min(len(self._match(tokens)[0]) * self.block_size, len(tokens) - 1)

    def can_allocate(self, tokens: Sequence[int]) -> bool:
        return self._blocks_short(tokens) <= 0

    def _blocks_short(self, tokens: Sequence[int]) -> int:
        hit, _ = self._match(tokens)
        idle_hits = sum(1 for b in hit if self._ref[b] == 0)
        need = self.blocks_needed(len(tokens)) - len(hit)
        return need - (self.num_free - idle_hits)

    # -- mutations ---------------------------------------------------------
    def allocate(self, seq_id: int, tokens: Sequence[int]) -> Allocation | None:
        """Give ``seq_id`` blocks for ``tokens``, sharing cached prefix blocks.
        Returns None (and changes nothing) when there are not enough blocks."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already has blocks")
        if not tokens:
            raise ValueError("cannot allocate an empty sequence")
        hit, hashes = self._match(tokens)
        idle_hits = sum(1 for b in hit if self._ref[b] == 0)
        need = self.blocks_needed(len(tokens)) - len(hit)
        if need > self.num_free - idle_hits:
            return None
        sb = _SeqBlocks()
        for b in hit:
            self._acquire(b)
        sb.blocks = list(hit)
        sb.hashes = list(hashes)
        for _ in range(need):
            sb.blocks.append(self._take())
        self._seqs[seq_id] = sb
        cached = len(hit) * self.block_size
        last_cached = cached == len(tokens)
        cached -= last_cached
        self.queried_tokens += len(tokens)
        self.hit_tokens += cached
        return Allocation(tuple(sb.blocks), cached, last_cached)

    def ensure_capacity(self, seq_id: int, num_tokens: int) -> bool:
        """Grow the block table to cover ``num_tokens`` positions; False if short."""
        sb = self._seqs[seq_id]
        need = -(-num_tokens // self.block_size) - len(sb.blocks)
        if need <= 0:
            return True  # the common case (every step but one per block)
        if need > self.num_free:
            return False
        for _ in range(need):
            sb.blocks.append(self._take())
        return True

    def register(self, seq_id: int, tokens: Sequence[int], num_computed: int) -> None:
        """Mark the full blocks among the first ``num_computed`` positions of
        ``tokens`` (whose KV the runner has now written) as cached."""
        if not self.enable_prefix_cache:
            return
        sb = self._seqs[seq_id]
        bs = self.block_size
        full = min(num_computed // bs, len(sb.blocks))
        parent = sb.hashes[-1] if sb.hashes else ROOT_HASH
        for i in range(len(sb.hashes), full):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = block_hash(parent, chunk)
            b = sb.blocks[i]
            if h not in self._cached and self._hash_of[b] is None:
                self._cached[h] = b
                self._hash_of[b] = h
                self._tokens_of[b] = chunk
                if self.changes is not None:
                    self.changes[h] = None
            if i == 0 and h in self._cached:
                self._roots[h] = None
                self._roots.move_to_end(h)
            sb.hashes.append(h)
            parent = h

    def release_out_of_window(self, seq_id: int, num_computed: int) -> int:
        """With a sliding window, give back the blocks of ``seq_id`` that lie wholly before the window of
        its next query (position ``num_computed``: it sees ``num_computed - window + 1`` on); how many.
        Call after :meth:`register` (a released block keeps its prefix-cache entry)."""
        if self.window is None:
            return 0
        sb = self._seqs[seq_id]
        keep = min(max(num_computed - self.window + 1, 0) // self.block_size, len(sb.blocks) - 1)
        if keep <= sb.released:
            return 0
        for b in sb.blocks[sb.released : keep]:
            self._release(b)
        n = keep - sb.released
        sb.blocks[:keep] = [sb.blocks[keep]] * keep
        sb.released = keep
        self.window_releases += n
        return n

    def free(self, seq_id: int) -> None:
        """Release a sequence's blocks (cached ones stay reusable until evicted)."""
        sb = self._seqs.pop(seq_id, None)
        if sb is None:
            return
        # Release the tail first so LRU eviction takes deep blocks before roots.
        for b in reversed(sb.blocks[sb.released :]):
            self._release(b)

    def _release(self, b: int) -> None:
        self._ref[b] -= 1
        assert self._ref[b] >= 0, "block reference count went negative"
        if self._ref[b] == 0:
            if self._hash_of[b] is not None:
                self._evictable[b] = None
            else:
                self._free.append(b)

    def _acquire(self, b: int) -> None:
        if self._ref[b] == 0:
            self._evictable.pop(b, None)
        self._ref[b] += 1

    def _take(self) -> int:
        if self._free:
            b = self._free.pop()
        else:
            b, _ = self._evictable.popitem(last=False)
            h = self._hash_of[b]
            if h is not None:
                del self._cached[h]
                self._roots.pop(h, None)
                self._hash_of[b] = None
                self._tokens_of.pop(b, None)
                if self.changes is not None:
                    self.changes[h] = None
            self.evictions += 1
        assert self._ref[b] == 0, "handed out a block in use"
        self._ref[b] = 1
        return b

    def take_changes(self) -> tuple[list[int], list[int]]:
        """(cached, dropped): the hashes whose presence changed since the last call, as they are now
        (disjoint; a hash cached then dropped counts once). Tracking is on while ``changes`` is a dict."""
        changed = self.changes
        if not changed:
            return [], []
        self.changes = {}
        cached = self._cached
        return [h for h in changed if h in cached], [h for h in changed if h not in cached]

    def cached_hashes(self) -> list[int]:
        """Every hash the prefix cache holds now."""
        return list(self._cached)

    def prefix_hashes(self, limit: int = 32) -> tuple[int, ...]:
        """Hashes of cached chain roots (first blocks), newest first."""
        roots: list[int] = []
        for h in reversed(self._roots):
            roots.append(h)
            if len(roots) >= limit:
                break
        return tuple(roots)

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests)."""
        refs = [0] * self.num_blocks
        for sb in self._seqs.values():
            assert all(b == sb.blocks[sb.released] for b in sb.blocks[: sb.released]), "a released entry moved"
            for b in sb.blocks[sb.released :]:
                refs[b] += 1
        assert refs == self._ref, "reference counts disagree with block tables"
        free = set(self._free)
        ev = set(self._evictable)
        assert len(free) == len(self._free) and not (free & ev)
        for b in range(self.num_blocks):
            in_use = self._ref[b] > 0
            assert in_use + (b in free) + (b in ev) == 1, f"block {b} in {in_use, b in free, b in ev}"
            if b in ev:
                assert self._hash_of[b] is not None
        for h, b in self._cached.items():
            assert self._hash_of[b] == h
