"""Which replica holds which prefix-cache blocks: an index fed by stored / evicted events.

How it works: every replica's KV cache names a prompt's full blocks by the hash chain of
:mod:`transport.common.prefix` (``h_i = H(h_{i-1}, block i)``), so one hash names a whole prefix. The
index keeps one map ``hash -> bitmask of replicas holding it`` and, per replica, that
replica's hashes in LRU order. A prompt's longest cached prefix on every replica is one walk
down its chain, and-ing the masks until none is left (:meth:`CacheIndex.longest_prefixes`).

Events are what workers publish (:class:`BlocksStored`, :class:`BlocksEvicted`,
:class:`ReplicaReset` on a restart or cache reset); the simulator feeds them, and in the gateway
:mod:`gateway.routing.cache_feed` does from each connection's KV events, one slot per replica
(:meth:`CacheIndex.add_replica`; a freed slot is reused). Memory is bounded by each slot's
capacity in blocks (a worker's KV cache size, capped): a replica that reports more than it can
hold (or an event lost on the way) costs its least recently stored entries, never the index's
bound. The same class models an LRU prefix cache: :meth:`store` returns what it evicted, which
is the event a worker would send, and the approximate (event-less) policy keeps its guesses
in one.

Blocks are touched leaf first, so the LRU victim is the tail of the least recently used
chain, as in vLLM's free queue: evicting a root would orphan every block below it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass

__all__ = ["BlocksStored", "BlocksEvicted", "ReplicaReset", "CacheEvent", "CacheIndex"]


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """A replica now holds these blocks (chain order; a step's batch)."""

    replica: int
    hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BlocksEvicted:
    """A replica dropped these blocks."""

    replica: int
    hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ReplicaReset:
    """A replica's cache is empty (a restart, a new epoch, a resync)."""

    replica: int


CacheEvent = BlocksStored | BlocksEvicted | ReplicaReset


class CacheIndex:
    """Per replica, the block hashes it holds (LRU, at most ``capacity`` each); longest cached
    prefix of a chain per replica in one walk."""

    __slots__ = ("capacity", "_holders", "_lru", "_cap", "_unused")

    def __init__(self, replicas: int = 0, capacity: int = 1) -> None:
        if replicas < 0 or capacity < 1:
            raise ValueError("replicas must be >= 0 and capacity >= 1")
        self.capacity = capacity
        self._holders: dict[int, int] = {}  # hash -> bitmask of replicas
        self._lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(replicas)]
        self._cap = [capacity] * replicas  # per slot
        self._unused: list[int] = []  # slots given back, reused first

    @property
    def replicas(self) -> int:
        """Slots (including unused ones)."""
        return len(self._lru)

    def add_replica(self, capacity: int) -> int:
        """A slot for one more replica holding at most ``capacity`` blocks (empty)."""
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        if self._unused:
            slot = self._unused.pop()
            self._cap[slot] = capacity
            return slot
        self._lru.append(OrderedDict())
        self._cap.append(capacity)
        return len(self._lru) - 1

    def remove_replica(self, slot: int) -> None:
        """The replica is gone: its entries now, its slot for the next one."""
        self.reset(slot)
        if slot not in self._unused:
            self._unused.append(slot)

    def __len__(self) -> int:
        """Distinct hashes held anywhere (the map's size)."""
        return len(self._holders)

    def blocks(self, replica: int) -> int:
        """How many blocks ``replica`` holds."""
        return len(self._lru[replica])

    def holds(self, replica: int, h: int) -> bool:
        return h in self._lru[replica]

    def apply(self, event: CacheEvent) -> None:
        """Feed one worker event."""
        if isinstance(event, BlocksStored):
            self.store(event.replica, event.hashes)
        elif isinstance(event, BlocksEvicted):
            self.evict(event.replica, event.hashes)
        else:
            self.reset(event.replica)

    def store(self, replica: int, chain: Sequence[int]) -> list[int]:
        """``replica`` holds ``chain`` (new or touched, most recent now); returns the hashes the
        capacity pushed out, least recent first."""
        lru = self._lru[replica]
        bit = 1 << replica
        holders = self._holders
        for h in reversed(chain):  # leaf first: the root ends most recent
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                holders[h] = holders.get(h, 0) | bit
        evicted: list[int] = []
        cap = self._cap[replica]
        while len(lru) > cap:
            h, _ = lru.popitem(last=False)
            self._drop(h, bit)
            evicted.append(h)
        return evicted

    def touch(self, replica: int, chain: Sequence[int]) -> None:
        """A hit: the held blocks of ``chain`` become most recent (none is added)."""
        lru = self._lru[replica]
        for h in reversed(chain):
            if h in lru:
                lru.move_to_end(h)

    def evict(self, replica: int, hashes: Iterable[int]) -> None:
        lru = self._lru[replica]
        bit = 1 << replica
        for h in hashes:
            if lru.pop(h, 0) is None:
                self._drop(h, bit)

    def reset(self, replica: int) -> None:
        bit = 1 << replica
        for h in self._lru[replica]:
            self._drop(h, bit)
        self._lru[replica].clear()

    def _drop(self, h: int, bit: int) -> None:
        mask = self._holders[h] & ~bit
        if mask:
            self._holders[h] = mask
        else:
            del self._holders[h]

    def longest_prefixes(self, chain: Sequence[int]) -> list[int]:
        """Per replica, how many leading blocks of ``chain`` it holds."""
        n = len(self._lru)
        out = [0] * n
        alive = (1 << n) - 1
        holders = self._holders
        for i, h in enumerate(chain):
            mask = alive & holders.get(h, 0)
            if mask != alive:
                gone = alive & ~mask
                for r in range(n):
                    if gone >> r & 1:
                        out[r] = i
                alive = mask
                if not alive:
                    return out
        for r in range(n):
            if alive >> r & 1:
                out[r] = len(chain)
        return out

    @property
    def held(self) -> Container[int]:
        """Every hash some replica holds (read-only: a membership test)."""
        return self._holders

    def held_prefixes(self, chain: Sequence[int]) -> list[int]:
        """:meth:`longest_prefixes` in O(log n) lookups per distinct holder set along ``chain``, for a
        cache that holds a block's parent whenever it holds the block: an LRU one that frees a
        sequence's blocks tail first (:mod:`inference.kv_cache`, and this index's own order). Then
        the set of holders only shrinks along a chain, and a binary search finds each place it does.
        (A hole in a replica's chain, which such a cache never makes, may count the blocks past it.)"""
        out = [0] * len(self._lru)
        get = self._holders.get
        last = len(chain) - 1
        lo = 0
        alive = get(chain[0], 0) if chain else 0
        while alive:
            if get(chain[last], 0) & alive == alive:
                lo = last
            else:  # alive all hold block lo, not all hold block hi: the last block they all hold
                hi = last
                while hi - lo > 1:
                    mid = (lo + hi) >> 1
                    if get(chain[mid], 0) & alive == alive:
                        lo = mid
                    else:
                        hi = mid
            lo += 1
            rest = alive & get(chain[lo], 0) if lo <= last else 0
            gone = alive & ~rest
            while gone:
                bit = gone & -gone
                out[bit.bit_length() - 1] = lo
                gone ^= bit
            alive = rest
        return out

    def longest_prefix(self, replica: int, chain: Sequence[int]) -> int:
        """How many leading blocks of ``chain`` ``replica`` holds."""
        lru = self._lru[replica]
        for i, h in enumerate(chain):
            if h not in lru:
                return i
        return len(chain)
