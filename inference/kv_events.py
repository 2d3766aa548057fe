"""The worker's KV events: its prefix cache's changes, published to the gateways that subscribed.

How it works: a gateway that routes by cache (#29) sends KV_SUBSCRIBE; :meth:`KvPublisher.subscribe`
answers with the whole cache (a full :class:`~transport.messages.KvEvents` at the current ``seq``)
and turns on the cache's change tracking (:attr:`inference.kv_cache.KVCache.changes`: one dict
insert per block cached or dropped). After every engine step :meth:`KvPublisher.publish` sends what
changed as one batch, ``seq`` one more, to every subscriber (several gateways see the same batches,
so they build the same index). With no subscriber nothing is tracked and a step costs one test.

``epoch`` names this cache: random at start, so a restarted worker (an empty cache) is a new epoch
wherever it is seen (Hello, Stats, every batch).
"""

from __future__ import annotations

import secrets
from array import array

from transport.api import ServerConnection
from transport.messages import KvEvents

from .kv_cache import KVCache

__all__ = ["KvPublisher"]


class KvPublisher:
    """Batches of a :class:`KVCache`'s stored/evicted hashes for the connections that subscribed."""

    __slots__ = ("kv", "epoch", "seq", "_subscribers")

    def __init__(self, kv: KVCache, epoch: int | None = None) -> None:
        self.kv = kv
        self.epoch = epoch if epoch is not None else secrets.randbits(63) | 1  # never 0 ("not told")
        self.seq = 0  # the last batch published
        self._subscribers: dict[int, ServerConnection] = {}

    @property
    def capable(self) -> bool:
        """Whether there is a prefix cache to publish (the ``kv_events`` capability)."""
        return bool(self.kv.hash_scheme)

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    def subscribe(self, conn: ServerConnection) -> None:
        """``conn`` asked (again, for a resync): the whole cache now, every change after it."""
        if self._subscribers:
            self.publish()  # the others' pending batch first: the full set is at the seq it follows
        else:
            self.kv.changes = {}  # track from now on; what came before is in the full set
        self._subscribers[id(conn)] = conn
        conn.send_kv_events(KvEvents(self.epoch, self.seq, array("Q", self.kv.cached_hashes()), full=True))

    def unsubscribe(self, conn: ServerConnection) -> None:
        if self._subscribers.pop(id(conn), None) is not None and not self._subscribers:
            self.kv.changes = None

    def publish(self) -> None:
        """Send what changed since the last batch (nothing when nothing did)."""
        if not self._subscribers:
            return
        stored, evicted = self.kv.take_changes()
        if not stored and not evicted:
            return
        self.seq += 1
        batch = KvEvents(self.epoch, self.seq, array("Q", stored), array("Q", evicted))
        for conn in list(self._subscribers.values()):
            if conn.closed:
                self.unsubscribe(conn)
            else:
                conn.send_kv_events(batch)
