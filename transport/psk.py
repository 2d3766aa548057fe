"""Pre-shared-key authentication in the HELLO exchange (sans-I/O).

How it works
------------
Both ends hold the same secret key (``transport_psk_file``). Each opens with a
*challenge* HELLO: its role and a fresh 32-byte nonce, nothing that identifies it.
On the peer's challenge it answers AUTH, its proof::

    HMAC-SHA256(key, "quicserve-psk-v1" 0 role 0 peer_nonce own_nonce)

and checks the peer's AUTH against the proof the peer's role would give for the
same two nonces, in constant time. Only then does it send its full HELLO.

* The key never crosses the wire; each proof is bound to both nonces, so an
  eavesdropper's recording answers no later challenge (replay), and to the
  sender's role, so a peer cannot hand our own proof back to us (reflection).
* What it does not do: encrypt, or protect the frames after the handshake. An
  on-path attacker who can rewrite packets can still read prompts or take over
  an authenticated connection; against that, use mutual TLS (``transport_tls_*``).

:class:`PskHandshake` is one side's state; :class:`~transport.flow.FlowConnection`
drives it. :func:`read_key_file` is the one way a key is read from a file.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from .wire import CHALLENGE_SIZE

__all__ = ["PskHandshake", "read_key_file", "MIN_KEY_BYTES", "new_nonce"]

_LABEL = b"quicserve-psk-v1\0"
MIN_KEY_BYTES = 16  # e.g. `openssl rand -hex 32 > transport.psk` gives 64


def new_nonce() -> bytes:
    return os.urandom(CHALLENGE_SIZE)


def read_key_file(path: str) -> bytes:
    """The key in ``path`` (surrounding whitespace, a trailing newline included, is not part of it);
    ``ValueError`` saying what is wrong, never what the key is."""
    try:
        key = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the pre-shared key file {path}: {exc.strerror or exc}") from None
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"the pre-shared key in {path} is {len(key)} bytes; use at least {MIN_KEY_BYTES} "
                         "(e.g. `openssl rand -hex 32`)")
    return key


class PskHandshake:
    """One side of the exchange: its nonce, then the peer's, then whether the peer proved the key."""

    __slots__ = ("_key", "role", "nonce", "peer_nonce", "verified")

    def __init__(self, key: bytes, role: str, nonce: bytes | None = None) -> None:
        self._key = key
        self.role = role
        self.nonce = nonce if nonce is not None else new_nonce()
        self.peer_nonce: bytes | None = None
        self.verified = False

    def __repr__(self) -> str:  # never the key
        return f"PskHandshake(role={self.role!r}, verified={self.verified})"

    def _proof(self, role: str, their_nonce: bytes, own_nonce: bytes) -> bytes:
        msg = _LABEL + role.encode() + b"\0" + their_nonce + own_nonce
        return hmac.new(self._key, msg, hashlib.sha256).digest()

    def answer(self, peer_nonce: bytes) -> bytes:
        """Our proof for the peer's challenge (remembered for :meth:`check`)."""
        self.peer_nonce = peer_nonce
        return self._proof(self.role, peer_nonce, self.nonce)

    def check(self, peer_role: str, proof: bytes) -> bool:
        """Whether the peer's AUTH proves the key (constant-time compare)."""
        if self.peer_nonce is None:
            return False
        expected = self._proof(peer_role, self.nonce, self.peer_nonce)
        self.verified = hmac.compare_digest(expected, proof)
        return self.verified
