"""Per-key concurrency caps across the gateway processes of one host: one table of counts in
shared memory.

How it works: a file in the supervisor's runtime directory (tmpfs), mapped by every process, of
:data:`SLOTS` slots: an 8-byte hash of a key id, then one 32-bit count per process. A request of a
key with a concurrency cap takes its place under an exclusive ``flock`` of the file: the key's
counts summed over the processes against the cap, then this process's count + 1; its end takes
it back. A count per process, not one shared: a process that dies takes its requests with it, and
the one started in its place zeroes its column before serving, so a crash leaks no place. A key
lives within :data:`WINDOW` slots of its hash; a slot whose counts are all zero is free (found
full: the request is refused, 503, as a full shedder would). Only requests of capped keys come
here -- two lock round trips each, the price of an exact cap across processes; the rest of the
admission path (:class:`~gateway.admission.shed.LoadShedder`'s) is unchanged.

Not shared: the pools' queue bounds (``[admission] queue_limit``) stay per process -- each
process bounds what it has outstanding on the workers.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import struct

from ..admission.checks import ShedCheck
from ..admission.gate import Admission
from ..admission.shed import LoadShedder, ShedTicket
from ..errors import APIError

__all__ = ["KeySlots", "SharedKeyShedder", "share_key_caps", "SLOTS", "WINDOW"]

SLOTS = 1 << 14  # capped keys with requests in flight at once, all processes together
WINDOW = 32  # slots a key may sit in, from its hash on


class KeySlots:
    """The shared table (see the module docstring); ``index`` is this process's column of ``of``."""

    def __init__(self, path: str, index: int, of: int, slots: int = SLOTS) -> None:
        self.index, self.of, self.slots = index, of, slots
        self._slot = 8 + 4 * of
        self._counts = struct.Struct(f"<{of}I")
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        size = self._slot * slots
        with self._locked():
            if os.fstat(self._fd).st_size < size:
                os.ftruncate(self._fd, size)
            self._map = mmap.mmap(self._fd, size)
            for i in range(slots):  # this column's requests ended with the process before us
                self._map[i * self._slot + 8 + 4 * index: i * self._slot + 12 + 4 * index] = b"\0\0\0\0"

    def _locked(self) -> _Flock:
        return _Flock(self._fd)

    def _find(self, tag: bytes, free: bool) -> int:
        """The offset of ``tag``'s slot, else (``free``) of the first free slot in its window; -1."""
        start = int.from_bytes(tag[:4], "little") % self.slots
        spare = -1
        for j in range(WINDOW):
            off = ((start + j) % self.slots) * self._slot
            held = any(self._counts.unpack_from(self._map, off + 8))
            if held and self._map[off:off + 8] == tag:
                return off
            if not held and spare < 0:
                spare = off
        return spare if free else -1

    def acquire(self, key: str, cap: int) -> bool | None:
        """Take a place for ``key`` if fewer than ``cap`` are held across processes (None: table full)."""
        tag = hashlib.blake2b(key.encode(), digest_size=8).digest()
        with self._locked():
            off = self._find(tag, free=True)
            if off < 0:
                return None
            counts = list(self._counts.unpack_from(self._map, off + 8))
            if self._map[off:off + 8] == tag and sum(counts) >= cap:
                return False
            if not any(counts):
                self._map[off:off + 8] = tag
            counts[self.index] += 1
            self._counts.pack_into(self._map, off + 8, *counts)
            return True

    def release(self, key: str) -> None:
        tag = hashlib.blake2b(key.encode(), digest_size=8).digest()
        with self._locked():
            off = self._find(tag, free=False)
            if off >= 0:
                at = off + 8 + 4 * self.index
                held = int.from_bytes(self._map[at:at + 4], "little")
                self._map[at:at + 4] = max(0, held - 1).to_bytes(4, "little")

    def held(self, key: str) -> int:
        """Places ``key`` holds across processes now (for tests and figures)."""
        tag = hashlib.blake2b(key.encode(), digest_size=8).digest()
        with self._locked():
            off = self._find(tag, free=False)
            return 0 if off < 0 else sum(self._counts.unpack_from(self._map, off + 8))


class _Flock:
    def __init__(self, fd: int) -> None:
        self._fd = fd

    def __enter__(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)


class SharedKeyShedder(LoadShedder):
    """:class:`LoadShedder` whose per-key caps count every process's requests (:class:`KeySlots`);
    pools, classes and deadlines as before, per process."""

    __slots__ = ("key_slots",)

    def __init__(self, base: LoadShedder, key_slots: KeySlots) -> None:
        super().__init__(base.queue_limit, base.classes, base.headroom, base.max_pools)
        self.key_slots = key_slots

    def take(self, pool: str, key_id: str | None, key_cap: int, priority: int, deadline: float | None,
             now: float) -> str | None:
        if key_id is None or key_cap <= 0:
            return super().take(pool, key_id, key_cap, priority, deadline, now)
        self.check(pool, None, 0, priority, deadline)  # the pool's bound and the deadline, as ever
        taken = self.key_slots.acquire(key_id, key_cap)
        if not taken:
            self._refused(priority, "key_concurrency")
            if taken is None:
                raise APIError(503, "The server is tracking too many keys' concurrent requests.", "server_error",
                               None, "overloaded", 1.0)
            raise APIError(429, f"Too many concurrent requests for this key (limit {key_cap}).",
                           "requests", None, "rate_limit_exceeded", 1.0)
        self.enter(pool, None, now)
        return key_id

    def admit(self, pool: str, key_id: str | None, key_cap: int, priority: int, deadline: float | None,
              now: float) -> ShedTicket:
        return ShedTicket(pool, self.take(pool, key_id, key_cap, priority, deadline, now))

    def untake(self, pool: str, capped_key: str | None) -> None:
        super().untake(pool, None)
        if capped_key is not None:
            self.key_slots.release(capped_key)

    def leave(self, pool: str, capped_key: str | None, now: float) -> None:
        super().leave(pool, None, now)
        if capped_key is not None:
            self.key_slots.release(capped_key)


def share_key_caps(admission: Admission, key_slots: KeySlots) -> None:
    """Make ``admission`` (just built, nothing admitted yet) count key caps across processes."""
    shared = SharedKeyShedder(admission.shedder, key_slots)
    admission.shedder = shared
    for check in admission.checks:
        if isinstance(check, ShedCheck):
            check.shedder = shared
