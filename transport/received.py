"""What a gateway's connection received, kept so that a stream that ends in an error can say which
tokens it got: the continuation a second replica resumes it from (mid-stream failover).

How it works: the connection appends every decoded :class:`TokenBatch` to a :class:`ReceivedLog`
-- one list append per engine step, whatever the number of requests in it, so the healthy path
does no work per token or per request for it -- and notes the log's position on each stream it
opens (its *mark*). A stream that ends with an error takes its part (its token ids and the bytes
of their text, in the batches from its mark on) before it goes: at once while the connection
lives (:meth:`ReceivedLog.slice`; the log moves on), or, when the connection died, later from the
log, which no longer changes (:meth:`ReceivedLog.frozen_slice`: one pass indexes it for every
stream that asks). Every ``TRIM_EVERY`` batches the log forgets those older than its oldest open
stream, and it keeps ``MAX_BATCHES`` at most: a stream older than that has no history (it cannot
resume; its error is its answer, as before). The connection keeps batches only while a stream
that can resume is open (a whole result, ``Submit.buffered``, starts over instead: it has no mark)
and forgets them all when the last such stream ends, so a connection of whole results keeps
nothing and one of streams keeps about what its open streams received (nothing outlives a burst
for the garbage collector to find). Sans-I/O: the connection calls it.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from itertools import islice

from .api import Received
from .messages import TokenBatch

__all__ = ["ReceivedLog", "TRIM_EVERY", "MAX_BATCHES"]

TRIM_EVERY = 256  # batches between two looks at the open streams' marks
MAX_BATCHES = 4096  # engine steps of history at most (a few minutes of a busy worker)


class ReceivedLog:
    """The token batches one connection received, from its oldest open stream's submit on."""

    __slots__ = ("batches", "base", "trim_at", "_index")

    def __init__(self) -> None:
        self.batches: list[TokenBatch] = []
        self.base = 0  # the position of batches[0] (positions count every batch ever added)
        self.trim_at = TRIM_EVERY  # trim once this many are kept (the connection's receive path reads it)
        self._index: dict[int, list[tuple[int, int, int, int]]] | None = None  # frozen_slice's

    @property
    def position(self) -> int:
        """Where the next batch goes: a stream opened now is in no batch before it (its mark)."""
        return self.base + len(self.batches)

    def add(self, batch: TokenBatch) -> bool:
        """Keep one received batch; True when it is time to :meth:`trim`. (The connection's receive
        path writes this out: an append and a length check per engine step.)"""
        self.batches.append(batch)
        return len(self.batches) >= self.trim_at

    def forget(self) -> None:
        """No open stream can resume: nothing kept is needed (positions go on counting)."""
        self.base += len(self.batches)
        self.batches.clear()
        self.trim_at = TRIM_EVERY

    def trim(self, marks: Iterable[int]) -> None:
        """Forget the batches before the oldest of ``marks`` (the open streams'), and any beyond
        ``MAX_BATCHES``."""
        end = self.position
        cut = max(min(marks, default=end), end - MAX_BATCHES) - self.base
        if cut > 0:
            del self.batches[:cut]
            self.base += cut
        self.trim_at = len(self.batches) + TRIM_EVERY

    def slice(self, rid: int, mark: int) -> Received | None:
        """What stream ``rid``, opened at ``mark``, received: its entries in the batches since
        (request ids are unique among open streams, so every entry of ``rid`` there is its own).
        None when those batches are forgotten."""
        start = mark - self.base
        if start < 0:
            return None
        ids: array[int] = array("I")
        nbytes = 0
        for b in islice(self.batches, start, None):
            try:
                i = b.request_ids.index(rid)
            except ValueError:
                continue
            t = sum(b.counts[:i]) if i else 0
            ids.extend(b.token_ids[t : t + b.counts[i]])
            nbytes += b.text_lens[i]
        return Received(ids, nbytes)

    def frozen_slice(self, rid: int, mark: int) -> Received | None:
        """:meth:`slice` for a log that no longer changes (its connection ended), for many streams
        at once: the first call indexes every entry by request id (one pass), each call then
        reads only its own."""
        start = mark - self.base
        if start < 0:
            return None
        index = self._index
        if index is None:
            index = self._index = {}
            for p, b in enumerate(self.batches):
                t = 0
                for r, n, ln in zip(b.request_ids, b.counts, b.text_lens, strict=True):
                    index.setdefault(r, []).append((p, t, n, ln))
                    t += n
        ids: array[int] = array("I")
        nbytes = 0
        batches = self.batches
        for p, t, n, ln in index.get(rid, ()):
            if p >= start:
                ids.extend(batches[p].token_ids[t : t + n])
                nbytes += ln
        return Received(ids, nbytes)
