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
from .cache_policy import CostBased, CostModel

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
                 now: Callable[[], float] = clock.now, slack: float = 2.0) -> None:
        self.cost = cost if cost is not None else CostModel()
        self.index = CacheIndex()
        self.feed = CacheFeed(self.index, max_blocks)
        self.core = CostBased(self.index, self.cost, bound, slack)
        self.unhashed = 0  # requests routed by load alone: no prompt hashes
        self._now = now
        self._backlog: dict[int, tuple[float, float]] = {}  # slot -> (prefill tokens still queued, as of when)

    def choose(self, req: _Described, replicas: Sequence[WorkerConnection]) -> WorkerConnection | None:
        if not replicas:
            return None
        slots = self.feed.slots(replicas)
        chain = req.prefix_hashes
        if chain:
            held = self.index.held_prefixes(chain)
        else:
            self.unhashed += 1
            held = [0] * self.index.replicas
        now = self._now()
        rate = 1.0 / self.cost.prefill_s  # prefill tokens a second a replica computes
        backlog, wait = self._backlog, self.cost.prefill_wait_s
        prompt, bs = req.prompt_tokens, replicas[0].peer_hello.block_size or 1
        n: list[int] = []
        est: list[float] = []
        scores: list[int] = []
        todo: list[int] = []  # prefill tokens queued there, this one's uncached ones included
        warm: list[bool] = []  # holds warm_share of the prompt, nothing queued to prefill (see CostBased)
        need = self.core.warm_share * prompt
        for c, slot in zip(replicas, slots, strict=True):
            s = c.latest_stats
            tokens = prompt - held[slot] * bs if slot >= 0 else prompt
            if tokens < 0:
                tokens = 0
            hot = slot >= 0 and held[slot] * bs >= need and (s is None or s.queue_depth == 0)
            b = backlog.get(slot)
            if b is not None and (q := int(b[0] - (now - b[1]) * rate)) > 0:
                tokens += q
                hot = False
            warm.append(hot)
            k = c.in_flight
            if s is None:
                n.append(k)
                est.append(wait(tokens, 0))
                scores.append(k)
            else:
                if s.running + s.queue_depth > k:
                    k = s.running + s.queue_depth
                n.append(k)
                est.append(wait(tokens, s.running))
                scores.append(k + s.queue_depth)
            todo.append(tokens)
        r = self.core.pick(n, est, scores, warm)
        if slots[r] >= 0:
            backlog[slots[r]] = (todo[r], now)
        return replicas[r]
