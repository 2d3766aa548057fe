"""Session tickets for QUIC resumption and 0-RTT: encrypted at rest, rotating keys, single use.

How it works: aioquic's TLS server makes each ticket's identity (64 random bytes
sent to the client) and hands us the resumption state through its
``session_ticket_handler``; on resumption it asks its ``session_ticket_fetcher``
for the state by identity. :class:`TicketStore` is both callbacks' state:

* :meth:`issue` keeps the state under ``SHA-256(identity)`` (a leaked store
  does not give the identities a client would present), sealed with AES-GCM
  under the current ticket key (the lookup key is the associated data, so a
  blob cannot be moved to another ticket). Keys rotate every ``rotation``
  seconds; a key is kept as long as tickets sealed under it can live, then
  dropped, which makes those tickets unreadable (the client does a full
  handshake).
* :meth:`take` opens the state and, with replay protection on, claims the
  ticket in a :class:`~gateway.http.replay.SingleUseStore`: a ticket resumes
  (and so carries 0-RTT) once. A second presentation gets no state, so TLS
  falls back to a full handshake and the replayed 0-RTT packets cannot even be
  decrypted (RFC 8446 8.1, RFC 9001 9.2).

Shared between gateway processes: the blobs are self-describing (key id, nonce,
ciphertext), so the dict can be any key-value store with expiry; the single-use
claim must then be atomic in that store, and the ticket keys shared by every
process that can open a ticket. With ``shared`` (:class:`~gateway.http.ticket_dir.SharedTickets`,
the processes of one host under ``[server] processes``) the keys are derived from
one secret per rotation period (the key id is the period) and the blobs live in a
directory, claimed by an atomic rename; nothing else changes. Across hosts the same
would be Redis (``SET key blob EX lifetime``, claimed by ``GETDEL``) and a key
from a KMS (not built). Either way a ticket opens only where its single use is
claimed in the one store of everyone holding its key: the ground 0-RTT generation
stands on (:mod:`gateway.http.h3_state`).
"""

from __future__ import annotations

import datetime
import hashlib
import os
from collections import OrderedDict

import msgpack
from aioquic.tls import CipherSuite, SessionTicket
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gateway.http.replay import SingleUseStore
from gateway.http.ticket_dir import SharedTickets

__all__ = ["TicketStore"]

_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


def _ts(d: datetime.datetime) -> float:
    if d.tzinfo is None:
        d = d.replace(tzinfo=datetime.UTC)
    return (d - _EPOCH).total_seconds()


def _dt(ts: float) -> datetime.datetime:
    return _EPOCH + datetime.timedelta(seconds=ts)


class TicketStore:
    """In-memory session-ticket store (see the module docstring for the shared design)."""

    def __init__(self, *, lifetime: float, rotation: float, capacity: int, single_use: bool,
                 shared: SharedTickets | None = None) -> None:
        self.shared = shared
        self.lifetime = lifetime
        self.rotation = rotation
        self.capacity = capacity
        self.single_use = single_use
        self.used = SingleUseStore(capacity)
        self._blobs: OrderedDict[bytes, tuple[float, bytes]] = OrderedDict()  # lookup -> (expires, blob)
        self._keys: dict[int, tuple[float, AESGCM]] = {}  # key id -> (created, cipher)
        self._key_id = 0
        self.issued = 0
        self.resumed = 0
        self.refused = 0  # presented but unknown, expired, undecryptable or already used

    def issue(self, ticket: SessionTicket, now: float) -> None:
        """Keep a ticket the TLS stack just sent (aioquic ``session_ticket_handler``)."""
        self._expire(now)
        key_id, cipher = self._current_key(now)
        lookup = hashlib.sha256(ticket.ticket).digest()
        state = msgpack.packb([
            int(ticket.age_add), int(ticket.cipher_suite), _ts(ticket.not_valid_after),
            _ts(ticket.not_valid_before), ticket.resumption_secret, ticket.server_name,
            ticket.max_early_data_size, [list(e) for e in ticket.other_extensions], now,
        ])
        nonce = os.urandom(12)
        blob = key_id.to_bytes(4, "big") + nonce + cipher.encrypt(nonce, state, lookup)
        self.issued += 1
        if self.shared is not None:
            self.shared.put(lookup, now + self.lifetime, blob, now, self.capacity)
            return
        while len(self._blobs) >= self.capacity:
            self._blobs.popitem(last=False)  # the oldest client does a full handshake
        self._blobs[lookup] = (now + self.lifetime, blob)

    def take(self, identity: bytes, now: float) -> SessionTicket | None:
        """The state of a presented ticket, or None (aioquic ``session_ticket_fetcher``)."""
        self._expire(now)
        lookup = hashlib.sha256(identity).digest()
        if self.shared is not None:  # the claim is the rename: one process of all gets it
            entry = self.shared.claim(lookup) if self.single_use else self.shared.get(lookup)
            ticket = self._open(identity, lookup, entry, now)
            self.resumed += ticket is not None
            self.refused += ticket is None
            return ticket
        entry = self._blobs.pop(lookup, None) if self.single_use else self._blobs.get(lookup)
        ticket = self._open(identity, lookup, entry, now)
        if ticket is None or (self.single_use and not self.used.claim(lookup, entry[0] if entry else now, now)):
            self.refused += 1
            return None
        self.resumed += 1
        return ticket

    def _open(self, identity: bytes, lookup: bytes, entry: tuple[float, bytes] | None,
              now: float) -> SessionTicket | None:
        if entry is None or entry[0] <= now:
            return None
        blob = entry[1]
        kid = int.from_bytes(blob[:4], "big")
        if self.shared is not None:  # a period's key opens its tickets while they can live
            cipher = self.shared.key(kid) if (kid + 1) * self.rotation + self.lifetime > now else None
        else:
            cipher = key[1] if (key := self._keys.get(kid)) is not None else None
        if cipher is None:
            return None  # sealed under a key that has been dropped
        try:
            state = msgpack.unpackb(cipher.decrypt(blob[4:16], blob[16:], lookup))
        except Exception:  # cryptography's InvalidTag: tampered or wrong key
            return None
        age_add, suite, not_after, not_before, secret, server_name, max_early, exts, _issued = state
        return SessionTicket(
            age_add=age_add, cipher_suite=CipherSuite(suite), not_valid_after=_dt(not_after),
            not_valid_before=_dt(not_before), resumption_secret=secret, server_name=server_name,
            ticket=identity, max_early_data_size=max_early, other_extensions=[(t, v) for t, v in exts],
        )

    def _current_key(self, now: float) -> tuple[int, AESGCM]:
        if self.shared is not None:
            period = int(now // self.rotation)
            return period, self.shared.key(period)
        key = self._keys.get(self._key_id)
        if key is None or now - key[0] >= self.rotation:
            self._key_id += 1
            key = self._keys[self._key_id] = (now, AESGCM(AESGCM.generate_key(bit_length=256)))
        return self._key_id, key[1]

    def _expire(self, now: float) -> None:
        blobs = self._blobs
        while blobs:  # expiry is issue time + a constant lifetime: oldest first
            lookup, (expires, _) = next(iter(blobs.items()))
            if expires > now:
                break
            del blobs[lookup]
        # a key seals tickets for `rotation` seconds, each living `lifetime` more
        for kid, (created, _) in list(self._keys.items()):
            if kid != self._key_id and created + self.rotation + self.lifetime <= now:
                del self._keys[kid]
