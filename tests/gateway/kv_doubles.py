"""A worker connection double that publishes KV events (cache-aware routing tests and benches)."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence

from transport.common.prefix import PREFIX_HASH_SCHEME
from transport.flow import KV_EVENTS
from transport.messages import Hello, KvEvents, Stats, Submit


class KvWorker:
    """What the pool and the cache-aware policy read of a connection, and a worker's side of KV
    events: :meth:`store` / :meth:`evict` publish batches to the subscriber, :meth:`restart` is a
    new epoch. ``subscriptions`` counts KV_SUBSCRIBEs (the first, then every resync)."""

    def __init__(self, name: str, *, block_size: int = 16, kv_blocks: int = 1 << 16, epoch: int = 1,
                 kv_events: bool = True, model: str = "tiny") -> None:
        caps = ("logprobs", "text", "chat") + ((KV_EVENTS,) if kv_events else ())
        self.peer_hello = Hello(role="worker", identity=name, models=(model,), capabilities=caps,
                                kv_blocks=kv_blocks, block_size=block_size, model_id="tiny",
                                prefix_hash=PREFIX_HASH_SCHEME, kv_epoch=epoch)  # fmt: skip
        self.latest_stats: Stats | None = None
        self.closed = False
        self.draining = False
        self.in_flight = 0
        self.epoch, self.seq = epoch, 0
        self.held: dict[int, None] = {}
        self.listener: Callable[[KvEvents], None] | None = None
        self.subscriptions = 0

    def subscribe_kv(self, listener: Callable[[KvEvents], None]) -> None:
        self.listener = listener
        self.subscriptions += 1
        listener(KvEvents(self.epoch, self.seq, array("Q", self.held), full=True))

    def _publish(self, stored: Sequence[int], evicted: Sequence[int], skip: int = 0) -> None:
        self.seq += 1 + skip
        if self.listener is not None and not skip:
            self.listener(KvEvents(self.epoch, self.seq, array("Q", stored), array("Q", evicted)))

    def store(self, chain: Sequence[int], lost: bool = False) -> None:
        """The worker cached ``chain``; ``lost``: its batch never reaches the gateway (a gap)."""
        for h in chain:
            self.held[h] = None
        self._publish(chain, (), skip=1 if lost else 0)

    def evict(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self.held.pop(h, None)
        self._publish((), hashes)

    def restart_cache(self, epoch: int) -> None:
        """A cache reset: empty, a new epoch, said in the next Stats."""
        self.held.clear()
        self.epoch, self.seq = epoch, 0
        self.stats()

    def stats(self, running: int = 0, queued: int = 0) -> None:
        self.latest_stats = Stats(queued, running, 0, 0, kv_epoch=self.epoch, kv_seq=self.seq)

    # what the pool may call when it routes (the benches time choose(), not submit)
    def next_request_id(self) -> int:
        return 1

    def submit(self, submit: Submit) -> object:
        raise NotImplementedError
