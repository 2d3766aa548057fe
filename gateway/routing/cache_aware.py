"""``[routing] policy = "cache_aware"``: the cost-based policy over the pool's live replicas (#29).

How it works: the pool gives the policy's :class:`~gateway.routing.cache_feed.CacheFeed` every
replica it adds and removes; the feed keeps the exact index of which replica holds which prefix
blocks from the workers' KV events. :meth:`CacheAware.choose` reads the prompt's block-hash chain
(``RouteRequest.prefix_hashes``: the pool hashes prompts for this policy only, and only when it
has several replicas to choose from), each candidate's longest cached prefix, and its load as this
gateway knows it (its own requests in flight, the worker's last Stats, and a fluid estimate of the
prefill tokens it sent there that are still to compute), and lets
:class:`~gateway.routing.cache_policy.CostBased` pick the least estimated time to first token
under its load bound. A prompt without hashes (its tokenizer is not loadable here, a template
error) routes by load alone, counted in :attr:`CacheAware.unhashed`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar, Protocol

from transport.api import WorkerConnection

from .. import clock
from .cache_feed import CacheFeed
from .cache_index import CacheIndex
from .cache_policy import CacheRequest, CostBased, CostModel, ReplicaLoad

__all__ = ["CacheAware"]


class _Described(Protocol):  # policy.RouteRequest (which imports this module: no import back)
    @property
    def prompt_tokens(self) -> int: ...

    @property
    def prefix_hashes(self) -> tuple[int, ...]: ...


class CacheAware:
    """Least estimated TTFT from the exact cache index, under a bounded load (see the module)."""

    __slots__ = ("index", "feed", "core", "cost", "unhashed", "_now", "_backlog")
    uses_prefix_hashes: ClassVar[bool] = True
    hash_blocks: ClassVar[int] = 4096  # prompt blocks hashed (64k tokens at 16 a block)

    def __init__(self, cost: CostModel | None = None, bound: float = 1.3, max_blocks: int = 1 << 20,
                 now: Callable[[], float] = clock.now) -> None:
        self.cost = cost if cost is not None else CostModel()
        self.index = CacheIndex()
        self.feed = CacheFeed(self.index, max_blocks)
        self.core = CostBased(self.index, self.cost, bound)
        self.unhashed = 0  # requests routed by load alone: no prompt hashes
        self._now = now
        self._backlog: dict[int, tuple[float, float]] = {}  # slot -> (prefill tokens still queued, as of when)

    def choose(self, req: _Described, replicas: Sequence[WorkerConnection]) -> WorkerConnection | None:
        if not replicas:
            return None
        slots = self.feed.slots(replicas)
        chain = req.prefix_hashes
        if chain:
            held = self.index.longest_prefixes(chain)
            cached = [held[s] if s >= 0 else 0 for s in slots]
        else:
            self.unhashed += 1
            cached = [0] * len(replicas)
        now = self._now()
        rate = 1.0 / self.cost.prefill_s  # prefill tokens a second a replica computes
        loads = []
        for c, slot in zip(replicas, slots, strict=True):
            s = c.latest_stats
            queued, seen = self._backlog.get(slot, (0.0, now))
            queued = max(0.0, queued - (now - seen) * rate)
            n = c.in_flight if s is None else max(c.in_flight, s.running + s.queue_depth)
            loads.append(ReplicaLoad(n, 0 if s is None else s.queue_depth, int(queued), 0 if s is None else s.running))
        bs = replicas[0].peer_hello.block_size or 1
        r = self.core.pick(CacheRequest(chain, req.prompt_tokens, bs), loads, cached)
        slot = slots[r]
        if slot >= 0:
            self._backlog[slot] = (loads[r].queued_tokens + max(0, req.prompt_tokens - cached[r] * bs), now)
        return replicas[r]
