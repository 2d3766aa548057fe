"""The pool's cache index, fed from each worker connection's KV events (issue #29).

How it works: :meth:`CacheFeed.attach` gives a connection whose worker lists the ``kv_events``
capability a slot in the :class:`~gateway.routing.cache_index.CacheIndex` (its capacity the
worker's KV blocks, capped) and subscribes; the worker answers with its whole cache (a full
:class:`~transport.messages.KvEvents`), which replaces the slot's entries, then one batch per engine
step (``seq`` + 1 each). A batch of another epoch (the worker's cache was reset) empties the slot at
once and resubscribes; a gap in ``seq``, or Stats whose ``kv_seq`` is past the last batch seen (a
lost one), resubscribes (a resync: the entries stay until the full set replaces them). A replica
that leaves (:meth:`detach`: its connection closed, a restart) loses its entries at once. Every
gateway builds the same index from the same events: several need no sync among themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from transport.api import KvEventSource, WorkerConnection
from transport.flow import KV_EVENTS
from transport.messages import KvEvents, Stats

from .cache_index import CacheIndex

__all__ = ["CacheFeed"]

log = logging.getLogger("quicserve.routing")


class _Slot:
    __slots__ = ("slot", "epoch", "seq", "synced")

    def __init__(self, slot: int, epoch: int) -> None:
        self.slot = slot
        self.epoch = epoch
        self.seq = 0
        self.synced = False  # a full set arrived since the last (re)subscription


class CacheFeed:
    """Connections -> index slots, kept exact by their KV events."""

    def __init__(self, index: CacheIndex, max_blocks: int = 1 << 20) -> None:
        self.index = index
        self.max_blocks = max_blocks  # per replica, whatever its Hello says: the index's memory bound
        self._slots: dict[WorkerConnection, _Slot] = {}
        self.resyncs = 0  # resubscriptions after a gap
        self.epochs = 0  # slots emptied by a new epoch

    def attach(self, conn: WorkerConnection) -> None:
        hello = conn.peer_hello
        if KV_EVENTS not in hello.capabilities or conn in self._slots or conn.closed or not isinstance(
                conn, KvEventSource):
            return
        st = self._slots[conn] = _Slot(self.index.add_replica(min(hello.kv_blocks or self.max_blocks,
                                                                  self.max_blocks)), hello.kv_epoch)
        conn.subscribe_kv(lambda ev: self.on_events(conn, ev))
        log.debug("cache index: slot %d for %s (epoch %x)", st.slot, hello.identity, st.epoch)

    def detach(self, conn: WorkerConnection) -> None:
        st = self._slots.pop(conn, None)
        if st is not None:
            log.info("cache index: %s left, its %d blocks dropped", conn.peer_hello.identity,
                     self.index.blocks(st.slot))
            self.index.remove_replica(st.slot)

    def slots(self, replicas: Sequence[WorkerConnection]) -> list[int]:
        """Each replica's slot (-1: no events from it), after checking its latest Stats against what
        the feed saw (a new epoch empties the slot; a later ``kv_seq`` resyncs)."""
        out = []
        get = self._slots.get
        for c in replicas:
            st = get(c)
            if st is None:
                out.append(-1)
                continue
            s = c.latest_stats
            if s is not None and st.synced and s.kv_epoch and (s.kv_epoch != st.epoch or s.kv_seq > st.seq):
                self._stats_disagree(c, st, s)
            out.append(st.slot)
        return out

    def on_events(self, conn: WorkerConnection, ev: KvEvents) -> None:
        st = self._slots.get(conn)
        if st is None:
            return
        index = self.index
        if ev.full:
            index.reset(st.slot)
            index.store(st.slot, ev.stored)
            st.epoch, st.seq, st.synced = ev.epoch, ev.seq, True
            log.info("cache index: %s (epoch %x) holds %d blocks", conn.peer_hello.identity, ev.epoch, len(ev.stored))
            return
        if ev.epoch != st.epoch:  # the cache was reset since: nothing it held before is there
            self._new_epoch(conn, st, ev.epoch)
            return
        if not st.synced:
            return  # a batch the coming full set already includes
        if ev.seq != st.seq + 1:
            log.info("cache index: KV events from %s skipped %d -> %d; resyncing", conn.peer_hello.identity,
                     st.seq, ev.seq)
            self._resync(conn, st)
            return
        st.seq = ev.seq
        if ev.evicted:
            index.evict(st.slot, ev.evicted)
        if ev.stored:
            index.store(st.slot, ev.stored)

    def _stats_disagree(self, conn: WorkerConnection, st: _Slot, s: Stats) -> None:
        if s.kv_epoch != st.epoch:
            self._new_epoch(conn, st, s.kv_epoch)
        else:
            log.info("cache index: %s reports KV batch %d, the last seen was %d; resyncing",
                     conn.peer_hello.identity, s.kv_seq, st.seq)
            self._resync(conn, st)

    def _new_epoch(self, conn: WorkerConnection, st: _Slot, epoch: int) -> None:
        self.epochs += 1
        self.index.reset(st.slot)
        st.epoch = epoch
        self._resync(conn, st)

    def _resync(self, conn: WorkerConnection, st: _Slot) -> None:
        self.resyncs += 1
        st.synced = False
        if not conn.closed and isinstance(conn, KvEventSource):
            conn.subscribe_kv(lambda ev: self.on_events(conn, ev))
