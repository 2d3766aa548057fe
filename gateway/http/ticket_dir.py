"""Session tickets shared by the gateway processes of one host: keys from one secret, sealed
states in one directory (tmpfs), single use by an atomic rename.

How it works (the shared design :mod:`gateway.http.quic_tickets` describes, on one host):

* Keys: the key of rotation period ``e`` (``floor(wall / rotation)``) is HKDF-SHA256 of the
  supervisor's secret with ``e`` as info, so every process seals and opens under the same keys
  with no one writing them and no clock but the host's.
* States: one file per ticket, named by the ticket's lookup key (``SHA-256(identity)``), written
  to a temporary name and renamed into place (a reader sees all of it or nothing); its mtime is
  its expiry, which a sweep now and then reads to delete what has expired and to count what is
  held (past ``capacity`` new tickets are not kept: the client does a full handshake).
* Single use: :meth:`SharedTickets.claim` renames the file to a name of this process's before
  reading it; ``rename`` is atomic, so of any number of processes presented the same ticket
  (a replayed first flight, at this process or any other) exactly one gets the state and the
  rest do a full handshake. A claimed ticket is gone for every process, which is what the
  per-process :class:`~gateway.http.replay.SingleUseStore` remembers for one.
"""

from __future__ import annotations

import contextlib
import os
import struct

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

__all__ = ["SharedTickets"]

_SWEEP_EVERY = 256  # tickets kept between two sweeps of the directory


class SharedTickets:
    """The ticket keys and states several processes share (see the module docstring)."""

    def __init__(self, secret: bytes, path: str) -> None:
        os.makedirs(path, mode=0o700, exist_ok=True)
        self.path = path
        self._secret = secret
        self._keys: dict[int, AESGCM] = {}
        self._since_sweep = 0
        self._held = 0  # tickets in the directory at the last sweep, plus those kept since
        self._tag = f".{os.getpid()}"

    def key(self, epoch: int) -> AESGCM:
        """The ticket key of rotation period ``epoch`` (the same in every process)."""
        key = self._keys.get(epoch)
        if key is None:
            if len(self._keys) > 8:
                self._keys.clear()
            hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"quicserve ticket key %d" % epoch)
            key = self._keys[epoch] = AESGCM(hkdf.derive(self._secret))
        return key

    def put(self, lookup: bytes, expires: float, blob: bytes, now: float, capacity: int) -> bool:
        """Keep a sealed state until ``expires``; False (not kept) when ``capacity`` are held."""
        self._since_sweep += 1
        if self._since_sweep >= _SWEEP_EVERY or self._held >= capacity:
            self.sweep(now)
        if self._held >= capacity:
            return False
        final = os.path.join(self.path, lookup.hex())
        tmp = final + self._tag + ".tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(struct.pack("!d", expires) + blob)
            os.utime(tmp, (expires, expires))
            os.replace(tmp, final)
        except OSError:
            return False
        self._held += 1
        return True

    def claim(self, lookup: bytes) -> tuple[float, bytes] | None:
        """The state, taken for good: only one caller of all processes ever gets it."""
        final = os.path.join(self.path, lookup.hex())
        mine = final + self._tag + ".claimed"
        try:
            os.rename(final, mine)
        except OSError:
            return None  # never issued, expired and swept, or claimed already (here or elsewhere)
        try:
            return self._read(mine)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(mine)

    def get(self, lookup: bytes) -> tuple[float, bytes] | None:
        """The state, left for the next presentation (replay protection off)."""
        return self._read(os.path.join(self.path, lookup.hex()))

    @staticmethod
    def _read(path: str) -> tuple[float, bytes] | None:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            return None
        return (struct.unpack("!d", data[:8])[0], data[8:]) if len(data) > 8 else None

    def sweep(self, now: float) -> None:
        """Delete expired states; count the rest."""
        self._since_sweep = held = 0
        with contextlib.suppress(OSError), os.scandir(self.path) as entries:
            for entry in entries:
                try:
                    mtime = entry.stat().st_mtime
                except OSError:
                    continue
                # a state's mtime is its expiry; a file being written or claimed is a minute's business
                expired = mtime <= now if "." not in entry.name else mtime + 60 <= now
                if expired:
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                else:
                    held += 1
        self._held = held
